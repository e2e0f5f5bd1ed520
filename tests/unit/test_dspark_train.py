"""The trainer learns DSpark (issue 41 part 5): `drafter.arch=dspark` on the tiny random targets. Its labels, prev and
cumprod mask and its loss by hand; the Markov bias teacher-forced on the drafted tokens equals the rollout's, for
every head type; a tiny DSpark drafter trained until it fits a small fixed data set replays at a high τ in its own
convention and clearly lower in the other (the convention warning silent), and the same export with
sample_from_anchor flipped makes the warning fire; the export reads back with every key as written; DSpark's metrics
reach metrics.jsonl; a DSpark variant warm-starts its backbone from a DFlash2 export; bad keys are named."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil

import pytest
import torch
from shortcuts import load_drafter
from test_train import seqs, target, tiny_cfg  # noqa: F401 (fixtures)

from dflash import train as T
from dflash.config.train import check
from dflash.evaluation.checks import convention_warning
from dflash.models.drafter.config import parse_config
from dflash.models.drafter.dspark import rollout
from dflash.models.target.forward import tapped_forward
from dflash.stages.metrics import convention_check
from dflash.stages.replay.loop import ReplayOptions, prepare, replay_group
from dflash.train.arch import drafter_config, init_drafter
from dflash.train.data import TrainSeq
from dflash.train.labels import dspark_labels
from dflash.train.loss import dspark_loss, teacher_forced
from dflash.util.errors import ConfigError

DSPARK = {"arch": "dspark", "markov_rank": 8, "conv_kernel_size": 0}


def test_dspark_labels_prev_and_the_cumprod_mask_by_hand():
    ids = torch.arange(100, 120)[None]  # one sequence, T = 12 real tokens, padded to 20
    anchors, block_valid = torch.tensor([[4, 9, 4]]), torch.tensor([[True, True, False]])
    labels, prev, valid = dspark_labels(ids, torch.tensor([12]), anchors, block_valid, 3)
    assert labels[0, 0].tolist() == [105, 106, 107] and prev[0, 0].tolist() == [104, 105, 106]
    assert valid[0].tolist() == [[True, True, True], [True, True, False], [False, False, False]]  # 9+3 = 12: past T
    assert labels[0, 1].tolist()[:2] == [110, 111]


def test_dspark_loss_by_hand_and_its_confidence_target_detached():
    """Two rows, gamma 1 (weights 1, e^-1), V = 2. Row 0: draft softmax [3/4, 1/4] against the target's [1/2, 1/2]:
    CE log(4/3), L1 1/2, 1 - TV = 3/4, BCE(0, 3/4) = log 2. Row 1: draft [1/2, 1/2] on the target's own, label 1:
    CE log 2, L1 0, 1 - TV = 1, BCE(0, 1) = log 2."""
    logits = torch.tensor([[[[math.log(3), 0.0], [0.0, 0.0]]]], requires_grad=True)  # [1, 1, 2, 2]
    target = torch.zeros(1, 1, 2, 2)
    conf = torch.zeros(1, 1, 2, requires_grad=True)
    labels, valid = torch.tensor([[[0, 1]]]), torch.ones(1, 1, 2, dtype=torch.bool)
    a = (0.1, 0.9, 1.0)
    loss, t = dspark_loss(logits, conf, labels, valid, target, 1.0, a)
    w1 = math.exp(-1)
    want = (a[0] * (math.log(4 / 3) + w1 * math.log(2)) + a[1] * 0.5 + a[2] * (1 + w1) * math.log(2)) / (1 + w1)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert t.accept[0, 0].tolist() == pytest.approx([0.75, 1.0]) and t.w[0, 0].tolist() == pytest.approx([1, w1])
    assert t.conf_err[0, 0].tolist() == pytest.approx([-0.25, -0.5])
    valid[0, 0, 1] = False  # the second row out: the first alone
    loss, _ = dspark_loss(logits, conf, labels, valid, target, 1.0, a)
    assert loss.item() == pytest.approx(a[0] * math.log(4 / 3) + a[1] * 0.5 + a[2] * math.log(2), rel=1e-6)
    # the confidence term alone sends no gradient into the drafts: its target 1 - TV is detached
    loss, _ = dspark_loss(logits, conf, labels, valid, target, 1.0, (0.0, 0.0, 1.0))
    loss.backward()
    assert logits.grad is None or not logits.grad.any()
    assert conf.grad[0, 0, 0] == pytest.approx(0.5 - 0.75) and conf.grad[0, 0, 1] == 0


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_the_teacher_forced_bias_on_the_drafted_tokens_is_the_rollouts(target, tmp_path, kind):  # noqa: F811
    """What training computes (prev given) and what both loops run (prev = the drafted token) agree: teacher-forced
    on the rollout's own drafts, the draft logits' argmax is the rollout and the confidences are its confidences."""
    cfg = tiny_cfg(tmp_path, drafter={**DSPARK, "markov_head_type": kind, "block_size": 5})
    model = init_drafter(drafter_config(cfg, target, [1, 2]), target, 0, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.markov_head.parameters():  # heads far from their zero start
            p.copy_(torch.randn(p.shape, generator=g))
    S, N, R = 2, 3, 5
    taps = torch.randn(S, 24, 2 * 32, generator=g)
    anchors = torch.tensor([[4, 9, 14], [5, 10, 15]])
    tok = torch.randint(3, 90, (S, N), generator=g)
    block = torch.full((S, N, R), 5)
    block[..., 0] = tok
    with torch.no_grad():
        h = model(taps, target.embed(block), anchors)
        base = target.lm_head(h)
        drafts, conf = rollout(
            model.markov_head, model.confidence_head, base.view(-1, R, 96), h.view(-1, R, 32), tok.view(-1)
        )
        prev = torch.cat([tok.view(-1, 1), drafts[:, :-1]], 1).view(S, N, R)
        logits, tf_conf = teacher_forced(model, base, h, prev)
    assert torch.equal(logits.argmax(-1).view(-1, R), drafts)
    assert torch.allclose(torch.sigmoid(tf_conf).view(-1, R), conf, atol=1e-6)


def pattern_data(n: int = 8, seed: int = 0) -> list[TrainSeq]:
    """Sequences the backbone must read from the context: four random tokens, then a period-4 pattern [x, y, x, z]
    (after x comes y or z: the previous token alone does not tell, the token four back does)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        x, y, z = rng.sample(range(10, 90), 3)
        out.append(TrainSeq(ids=[rng.randrange(10, 90) for _ in range(4)] + ([x, y, x, z] * 11), prompt_len=4))
    return out


STEPS = 300


@pytest.fixture(scope="module")
def fitted(target, tmp_path_factory):  # noqa: F811
    """A tiny DSpark drafter (gamma 4, vanilla head) trained by the trainer on pattern_data until it fits it."""
    tmp = tmp_path_factory.mktemp("dspark_fit")
    cfg = tiny_cfg(
        tmp,
        drafter={**DSPARK, "intermediate_size": 64},
        optim={
            "steps": STEPS,
            "lr": 2e-2,
            "warmup_steps": 5,
            "batch_size": 8,
            "blocks_per_seq": 8,
            "max_seq_len": 48,
            "ce_loss_alpha": 1.0,
            "l1_loss_alpha": 0.0,  # the data are not the random target's: its distributions are not theirs
        },
        metrics_every=50,
        save_every=1000,
        log_every=1000,
    )
    data = pattern_data()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tensors this small gain nothing from a second thread, and lose much on a busy machine
    try:
        out = T.train(cfg, target=target, seqs=data)
    finally:
        torch.set_num_threads(threads)
    return tmp, data, out["fixed"]


def replay(target, folder, data):  # noqa: F811
    d = load_drafter(target, "hf", "x", path=str(folder)).model.float().eval()
    items = [
        prepare(
            d,
            target,
            s.ids[: s.prompt_len],
            s.ids[s.prompt_len :],
            tapped_forward(target, torch.tensor([s.ids]), d.cfg.target_layer_ids)[0],
        )
        for s in data
    ]
    res = replay_group(d, target, items, ReplayOptions(anchors="visited"))
    return d, convention_check([c for c, _ in res])


def test_a_trained_dspark_fits_and_replays_in_its_own_convention(target, fitted):  # noqa: F811
    """τ read as exported (the anchor convention, gamma 4: at most 5) is high; read in DFlash's convention it is
    clearly lower, so the convention check stays silent; the trainer's teacher-forced accepted length agrees."""
    tmp, data, summary = fitted
    assert summary["tf_prefix_tau"] > 4.5 and summary["acc_1"] > 0.9
    d, cc = replay(target, tmp / "ckpt" / "fixed" / f"step_{STEPS}", data)
    assert d.cfg.dspark.sample_from_anchor and d.cfg.proposals == 4
    assert cc.tau > 4.5, cc
    assert cc.other_tau < cc.tau - 1.5 and cc.z < -3, cc
    assert convention_warning(d.cfg, cc, 3.0) == []
    assert d.markov_head.markov_w2.weight.abs().sum() > 0, "the Markov head learned (markov_w2 starts at zero)"


def test_the_same_export_with_sample_from_anchor_flipped_warns(target, fitted, tmp_path):  # noqa: F811
    tmp, data, _ = fitted
    flipped = tmp_path / "flipped"
    shutil.copytree(tmp / "ckpt" / "fixed" / f"step_{STEPS}", flipped)
    cfg = json.loads((flipped / "config.json").read_text())
    (flipped / "config.json").write_text(json.dumps({**cfg, "sample_from_anchor": False}))
    d, cc = replay(target, flipped, data)
    assert not d.cfg.dspark.sample_from_anchor and d.cfg.proposals == 4  # gamma + 1 rows, row 0 dropped
    assert cc.tau < cc.other_tau - 1.5 and cc.z > 3, cc
    (w,) = convention_warning(d.cfg, cc, 3.0)
    assert "set sample_from_anchor: true" in w, w


@pytest.mark.parametrize(
    "drafter",
    [{}, {"markov_head_type": "gated", "confidence_with_markov": False, "conv_kernel_size": 2, "conv_group_size": 8}],
)
def test_the_export_reads_back_with_every_key_as_written(target, seqs, tmp_path, drafter):  # noqa: F811
    """The export's config.json is SGLang 0.5.23's layout (the head keys and sample_from_anchor at the top level,
    Qwen3DSparkModel) and the evaluator reads every key of it as written: parsing it and writing it back gives the
    same file, without a warning; the training checkpoint reads as the same drafter."""
    T.train(tiny_cfg(tmp_path, drafter={**DSPARK, **drafter}, optim={"steps": 2}), target=target, seqs=seqs)
    folder = tmp_path / "ckpt" / "fixed" / "step_2"
    raw = json.loads((folder / "config.json").read_text())
    want = {
        "architectures": ["Qwen3DSparkModel"],
        "block_size": 4,
        "markov_rank": 8,
        "markov_head_type": drafter.get("markov_head_type", "vanilla"),
        "enable_confidence_head": True,
        "confidence_head_with_markov": drafter.get("confidence_with_markov", True),
        "sample_from_anchor": True,
        "vocab_size": 96,
    }
    assert {k: raw.get(k) for k in want} == want
    assert raw["dflash_config"]["mask_token_id"] == 5 and raw["dflash_config"]["target_layer_ids"] == [1, 1]
    if drafter:  # the convolutions' block = gamma = the rows, where SGLang's index is right
        assert {k: raw["dflash_config"][k] for k in ("block_size", "conv_kernel_size", "conv_group_size")} == {
            "block_size": 4,
            "conv_kernel_size": 2,
            "conv_group_size": 8,
        }
    cfg, warnings = parse_config(raw)
    assert warnings == [] and cfg.to_hf() == raw
    for kind, where in (("hf", {"path": str(folder)}), ("training", {"run_dir": str(tmp_path / "runs" / "fixed")})):
        d = load_drafter(target, kind, "x", **where).model
        assert d.cfg.dspark == dataclasses.replace(cfg.dspark, vocab_size=96)
        assert d.confidence_head.proj.weight.dtype == torch.float32


def test_dspark_metrics_reach_metrics_jsonl(target, seqs, tmp_path):  # noqa: F811
    T.train(tiny_cfg(tmp_path, drafter=DSPARK, optim={"steps": 2}), target=target, seqs=seqs)
    rows = [json.loads(x) for x in (tmp_path / "runs" / "fixed" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "tau_probabilistic" in r][-1]
    names = ("tf_prefix_tau", "ce_loss", "l1_loss", "confidence_loss", "confidence_abs_error", "confidence_bias")
    assert all(isinstance(last[k], float) for k in names)
    assert 1 <= last["tau_probabilistic"] <= 5 and all(0 <= last[f"accept_p_{k}"] <= 1 for k in range(1, 5))
    assert "acc_4" in last and "acc_5" not in last  # gamma 4: four proposals, each a slot


def test_a_dspark_variant_warm_starts_its_backbone_from_a_dflash2_export(target, seqs, tmp_path):  # noqa: F811
    """init_from a DFlash2 export: fc, norms, layers and block convolutions transfer, the selector is dropped, the
    heads start fresh (markov_w2 zero); a DFlash export of another depth is refused, naming the tensors."""
    from safetensors.torch import load_file

    d2 = {"arch": "dflash2", "selector_rank": 4, "selector_top_k": 4, "conv_group_size": 8}

    def warm_start(src: str, dst: str, drafter: dict | None) -> tuple[dict, dict]:
        """A 2-step export at src (drafter), a DSpark variant warm-started from it at dst -> both exports' tensors."""
        over = {"drafter": drafter} if drafter else {}
        T.train(tiny_cfg(tmp_path / src, optim={"steps": 2}, **over), target=target, seqs=seqs)
        cfg = tiny_cfg(
            tmp_path / dst,
            drafter={**DSPARK, "conv_kernel_size": 2, "conv_group_size": 8},
            optim={"steps": 2},
            init_from=str(tmp_path / src / "ckpt"),
            stop_after=0,
        )
        T.train(cfg, target=target, seqs=seqs)
        step = {src: "step_2", dst: "step_0"}
        return tuple(
            load_file(str(tmp_path / f / "ckpt" / "fixed" / step[f] / "model.safetensors")) for f in (src, dst)
        )

    a, b = warm_start("a", "b", d2)
    backbone = [k for k in b if not k.startswith(("markov_head.", "confidence_head."))]
    assert any("attention_conv" in k for k in backbone) and all(torch.equal(a[k], b[k]) for k in backbone)
    assert not b["markov_head.markov_w2.weight"].any() and not any(k.startswith("candidate_selector") for k in b)
    # from a DFlash export (no convolutions): the DSpark variant's convolutions start as the identity
    p, q = warm_start("p", "q", None)
    base = q["layers.0.attention_conv.base_kernel"]
    assert base[:, 0].eq(1).all() and not base[:, 1:].any() and torch.equal(q["fc.weight"], p["fc.weight"])
    with pytest.raises(ConfigError, match=r"init_from: .* missing \['layers\.1\..*drafter.num_layers"):
        T.train(
            tiny_cfg(tmp_path / "c", drafter={**DSPARK, "num_layers": 2}, init_from=str(tmp_path / "a" / "ckpt")),
            target=target,
        )
    with pytest.raises(ConfigError, match=r"no place for \(block convolutions: set drafter.conv_kernel_size\)"):
        T.train(tiny_cfg(tmp_path / "d", drafter=DSPARK, init_from=str(tmp_path / "a" / "ckpt")), target=target)


@pytest.mark.parametrize(
    "over, words",
    [
        ({"drafter": {**DSPARK, "markov_head_type": "lstm"}}, "drafter.markov_head_type='lstm'"),
        ({"drafter": {**DSPARK, "markov_rank": 0}}, "drafter.markov_rank=0: must be >= 1"),
        ({"drafter": {**DSPARK, "conv_kernel_size": 5}}, "drafter.conv_kernel_size=5 with DSpark"),
        ({"drafter": DSPARK, "optim": {"ce_loss_alpha": 0.0, "l1_loss_alpha": 0.0}}, "optim.ce_loss_alpha=0.0"),
        ({"drafter": DSPARK, "optim": {"confidence_loss_alpha": 0.0}}, "drafter.confidence_head=true with optim"),
        ({"drafter": DSPARK, "optim": {"l1_loss_alpha": -1.0}}, "optim.l1_loss_alpha=-1.0: must be >= 0"),
        ({"variants": ["fixed-dspark"], "drafter": {"markov_rank": -2}}, "drafter.markov_rank=-2"),
        ({"variants": ["final_layer-dspark"]}, "variant 'final_layer-dspark' trains DSpark with final_layer"),
        ({"variants": ["fixed-dspark-q2"]}, "unknown suffix -q2"),
    ],
)
def test_bad_dspark_train_config_names_the_key(target, tmp_path, over, words):  # noqa: F811
    cfg = tiny_cfg(tmp_path, **over)
    with pytest.raises(ConfigError) as e:
        check(cfg)
        T.train(cfg, target=target, seqs=[])
    assert words in str(e.value), str(e.value)


def test_compare_pairs_a_dspark_runs_thresholds_with_the_default_s_whole_block():
    """dflash-compare DEFAULT DSPARK: the DSpark run's τ at each confidence threshold, paired against the other
    run's whole-block τ (a drafter without a confidence head verifies its whole block at any threshold); hand
    counts on two prompts."""
    from dflash.report.pairs import RunIdentity, align, compare
    from dflash.stages.metrics import PromptRow

    def row(i: int, steps: int, committed: int, **kw) -> PromptRow:
        return PromptRow(
            f"p{i}",
            "x",
            10,
            64,
            steps,
            committed,
            [0],
            [1],
            [1],
            None,
            prompt_digest=f"p{i}",
            reference_digest=f"r{i}",
            **kw,
        )

    default = [row(0, 20, 60), row(1, 30, 60)]  # τ 3 and 2
    dspark = [
        row(0, 16, 64, thresholds=[0.5, 0.9], thr_steps=[20, 32], thr_committed=[64, 64]),
        row(1, 20, 60, thresholds=[0.5, 0.9], thr_steps=[24, 40], thr_committed=[60, 60]),
    ]
    ident = RunIdentity("t", "float32")
    for a, b, sign in ((default, dspark, 1), (dspark, default, -1)):
        out = {r.metric: r for r in compare(align(a, b, ident, ident))}
        t5 = out["confidence_threshold/0.5"]
        assert (t5.a, t5.b)[::sign] == pytest.approx((120 / 50, 124 / 44))
        assert out["confidence_threshold/0.9"].diff == pytest.approx(sign * (124 / 72 - 120 / 50))
        assert out["acceptance_length"].diff == pytest.approx(sign * (124 / 36 - 120 / 50))


def test_the_training_results_page_reads_a_dspark_evaluation_and_its_pairs():
    """scripts/training_results.py on the console's own DSpark lines and dflash-compare's own table: the Markov gain
    and the τ at each threshold beside the evaluation, and the paired whole-block and threshold τ as table rows."""
    import importlib.util
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from dflash.report.console import dspark_lines
    from dflash.report.pairs import CompareRow, render
    from dflash.stages.metrics import DSparkSummary, ThresholdRow

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("training_results", root / "scripts" / "training_results.py")
    tr = importlib.util.module_from_spec(spec)
    sys.modules["training_results"] = tr
    spec.loader.exec_module(tr)
    rows = [ThresholdRow(t, tau, 0.05, tau - 3.2, 0.02, 4.0, 0.5) for t, tau in ((0.5, 2.9), (0.9, 2.1))]
    res = SimpleNamespace(
        dspark=DSparkSummary(2.8, 0.1, 0.4, 0.03, 2.7, 15.0, 0.2, rows),
        metrics={"acceptance_length": 3.2, "acceptance_length_se": 0.1},
        info=SimpleNamespace(
            drafter_config={"dspark_markov_head_type": "vanilla", "dspark_markov_rank": 32, "dspark_gamma": 15}
        ),
    )
    assert tr.dspark_line("\n".join(dspark_lines(res))) == (
        "Markov gain +0.400 ± 0.030; τ at confidence threshold 0.5 2.900 ± 0.050, 0.9 2.100 ± 0.050"
    )
    table = render(
        "default@step_5000",
        "fixed-l4-dspark-b15@step_3000",
        12,
        [
            CompareRow("acceptance_length", 3.1, 3.2, 0.1, 0.04, 2.5),
            CompareRow("confidence_threshold/0.5", 3.1, 2.9, -0.2, 0.05, -4.0),
        ],
    )
    text = "### python -m dflash.compare default@step_5000 fixed-l4-dspark-b15@step_3000\n" + table
    assert tr.dspark_pairs(text) == [
        "| default@step_5000 | fixed-l4-dspark-b15@step_3000 | whole block | 3.100 | 3.200 | +0.100 ± 0.040 | +2.5 |",
        "| default@step_5000 | fixed-l4-dspark-b15@step_3000 | confidence ≥ 0.5 | 3.100 | 2.900 | -0.200 ± 0.050 | "
        "-4.0 |",
    ]
    assert tr.dspark_pairs(text.replace("confidence_threshold/0.5", "accuracy/pos_01")) == []  # no DSpark pair
