"""Device agreement: the CUDA path of DFlash and DFlash2 drafters against the CPU float32 result, on the suite's
tiny random models. Every test runs per device (`cpu`, and `cuda` where CUDA exists; flex is CUDA only);
what the CPU-only tests already hold (every replay mode equals the online loop, visited == all, ...) is
not repeated here: these tests are about the device giving the CPU's numbers.

- The replay (dflash/stages/replay/loop.py through the pipeline's `iter_features` -> `prepare` -> `replay_group`)
  of a DFlash drafter, a DFlash2 drafter (convolutions and selector far from identity) and a DFlash2 drafter
  with non-causal sliding layers (window < context), in every mode (`anchors` all / visited, `tf_stride`
  1 / 4, with scores): every counter, block and proposal equal to the CPU's; NLL / confidence within 1e-4.
- The LM head in chunks of the vocabulary (dflash/models/drafter/head.py): the replay with 16 chunks equal to the
  CPU's one-chunk replay; the chunked top 1 / top k on integer-valued (tied) logits equal to torch.argmax / the
  canonical order, float32 and bfloat16, also inside a captured CUDA graph.
- flex attention (CUDA) against the CPU sdpa result on the sliding non-causal DFlash2 drafter, both modes.
- The feature pass batched (`features.batch_tokens`) on the device against the CPU's one sequence per pass.
- Local references: `greedy_generate` (on CUDA the static-cache engine with CUDA graphs) equals the CPU's
  dynamic-cache greedy decode, prompt by prompt.
- The trainer (`dflash.train.train`, two steps, DFlash and its DFlash2 twin in lockstep) under bf16 autocast
  (flex on CUDA): finite losses, gradients reaching every convolution and selector weight.

Everything is float32 with IEEE matmuls (TF32 off, restored after each test: the trainer turns it on for
the process), so the devices agree to rounding and every argmax (greedy token, walk) is the same; a flip
would need two logits within ~1e-6 of each other. On a GPU machine: `pytest tests/unit/test_cuda.py`, or without
internet access `bash run.sh tests` from an offline bundle (docs/offline-gpu.md).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from conftest import loop_counters
from shortcuts import get_features
from test_dflash2 import make_dflash2
from test_dflash2_replay import mixed_reference
from test_replay_modes import accepting_reference
from test_train import VOCAB, greedy_seqs, tiny_cfg, tiny_target

from dflash.models.drafter.model import DFlashDrafter
from dflash.models.target.model import load_target
from dflash.stages.references.local import greedy_generate
from dflash.stages.replay.loop import ReplayOptions, prepare, replay_group

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
B = 6  # the block size of test_replay_modes / test_dflash2_replay's reference builders
# the sliding layers' window: below every sequence's length (>= 29), >= B (the parser's rule for non-causal layers)
WINDOW = 8
PROMPTS = [(4, 40), (9, 25), (6, 33)]  # (prompt length, reference length)


@pytest.fixture(autouse=True)
def ieee_fp32():
    """float32 matmuls in IEEE precision, as on the CPU (the legacy flag, the API `dflash.train.loop.pick_device` uses
    to turn TF32 on: mixing it with set_float32_matmul_precision is an error in recent torch); restored after."""
    was = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = was


@pytest.fixture
def fresh_dynamo():
    """torch.compile's caches emptied before and after: the compiled flex_attention (`drafter._compiled_flex`,
    dynamic=False) compiles once per shape, and past dynamo's recompile limit (8) runs flex's eager, unfused
    implementation instead (the replay's many shapes reach it, as in the pipeline). So each test using flex
    compiles its own first shapes, and leaves the suite's later flex tests a fresh budget."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# --- the cases: CPU drafters with references they partly predict ---------------------------------------


@pytest.fixture(scope="module")
def targets(qwen3_dir, qwen3_target):
    """The tiny Qwen3 target per device, float32, loaded as the pipeline loads it (the CUDA one on first use)."""
    loaded = {"cpu": qwen3_target}

    def get(device: str):
        if device not in loaded:
            loaded[device] = load_target("hf", str(qwen3_dir), dtype="float32", device=device, attn="sdpa")
        return loaded[device]

    return get


@pytest.fixture(scope="module")
def cases(qwen3_target, make_drafter):
    """kind -> (CPU drafter, [(prompt, reference)]): references built from the drafter's own proposals on the CPU,
    so that blocks are accepted past slot 1 (a random drafter alone is rejected at once and tests nothing)."""
    import random

    dflash = make_drafter(qwen3_target, num_layers=2, block_size=B, seed=1, std=0.2)
    dflash2 = make_dflash2(make_drafter, qwen3_target, num_layers=2, block_size=B, seed=1, std=0.2)
    cfg = dataclasses.replace(dflash2.cfg, layer_types=["sliding_attention"] * 2, sliding_window=WINDOW, causal=False)
    sliding = DFlashDrafter(cfg).eval()
    sliding.load_state_dict(dflash2.state_dict())
    assert sliding.windows == [WINDOW, WINDOW] and sliding.causal == [False, False]
    out = {}
    for kind, drafter, build in (
        ("dflash", dflash, accepting_reference),
        ("dflash2", dflash2, mixed_reference),
        ("dflash2_sliding", sliding, mixed_reference),
    ):
        rng = random.Random(0)
        items = []
        for i, (P, n) in enumerate(PROMPTS):
            x = [rng.randrange(3, 200) for _ in range(P)]
            items.append((x, build(qwen3_target, drafter, x, n, seed=i)))
        out[kind] = (drafter, items)
    return out


def replay_on(device: str, target, drafter: DFlashDrafter, items, **opt):
    """The pipeline's replay on `device`: the target's taps (iter_features, cache off), `prepare`, `replay_group`."""
    d = copy.deepcopy(drafter).to(device)
    layers = d.cfg.target_layer_ids
    feats, _ = get_features(target, [x + r for x, r in items], [layers], cache=False)
    seqs = [prepare(d, target, x, r, f.taps(layers)) for (x, r), f in zip(items, feats)]
    assert all(s.ids.device.type == device and s.kv[0][0].device.type == device for s in seqs)
    out = replay_group(d, target, seqs, ReplayOptions(**opt))
    sync(device)
    return out


def exact(out) -> list:
    """Everything a replay gives that must be equal across devices: every counter (loop, unary walk, teacher-forced
    incl. unary top-1 and top-k recall) and every block (anchor, accepted, proposal, unary argmax)."""
    return [
        (
            loop_counters(c),
            c.unary_steps,
            c.unary_committed,
            c.tf_correct,
            c.tf_total,
            c.tf_unary_correct,
            c.tf_topk_hit,
            [(b.anchor_pos, b.accepted, b.proposal, b.unary) for b in blocks],
        )
        for c, blocks in out
    ]


def scores(out) -> list[float]:
    return [x for c, _ in out for x in c.tf_nll + c.tf_conf]


@pytest.fixture(scope="module")
def on_cpu(targets, cases):
    """The CPU float32 sdpa replay of (kind, mode, stride), computed once."""
    memo = {}

    def get(kind: str, anchors: str, stride: int):
        if (kind, anchors, stride) not in memo:
            drafter, items = cases[kind]
            memo[kind, anchors, stride] = replay_on(
                "cpu", targets("cpu"), drafter, items, anchors=anchors, tf_stride=stride, scores=True
            )
        return memo[kind, anchors, stride]

    return get


def test_the_cases_exercise_the_walks(targets, on_cpu, cases):
    """What the device tests rely on (CPU only, once): blocks accepted past slot 1, DFlash2's walk differing from
    its unary argmax, and the sliding window cutting the context (the same weights without it draft otherwise)."""
    for kind in cases:
        out = on_cpu(kind, "all", 1)
        assert sum(c.accepted for c, _ in out) > 2 * len(PROMPTS), kind
        if kind != "dflash":
            assert any(b.unary[: b.accepted + 1] != b.proposal[: b.accepted + 1] for _, bs in out for b in bs), kind
    drafter, items = cases["dflash2_sliding"]
    assert min(len(x) + len(r) for x, r in items) > 3 * WINDOW
    unwindowed = DFlashDrafter(drafter.cfg, sliding_window="ignore").eval()
    unwindowed.load_state_dict(drafter.state_dict())
    unwindowed.causal = [False, False]  # the same non-causal layers, full context
    windowed, full = (
        exact(on_cpu("dflash2_sliding", "all", 1)),
        exact(replay_on("cpu", targets("cpu"), unwindowed, items)),
    )
    assert [bs for *_, bs in windowed] != [bs for *_, bs in full], "the window should change the drafts"


# --- the replay -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dflash2_sliding"])
@pytest.mark.parametrize("anchors, stride", [("all", 1), ("all", 4), ("visited", 1), ("visited", 4)])
def test_replay_on_the_device_equals_cpu(targets, cases, on_cpu, device, kind, anchors, stride):
    drafter, items = cases[kind]
    got = replay_on(device, targets(device), drafter, items, anchors=anchors, tf_stride=stride, scores=True)
    want = on_cpu(kind, anchors, stride)
    assert exact(got) == exact(want)
    assert scores(got) == pytest.approx(scores(want), rel=1e-4, abs=1e-4)


@CUDA
@pytest.mark.parametrize("anchors, stride", [("all", 1), ("visited", 4)])
def test_flex_equals_cpu_sdpa_on_sliding_non_causal_dflash2(targets, cases, on_cpu, fresh_dynamo, anchors, stride):
    """flex_attention's BlockMask (`flex_block_mask`) on the sliding, non-causal layers of public DFlash2 configs,
    window < context: the CPU sdpa replay's counters and drafts (flex in IEEE fp32: `ieee_fp32`). The first 8 shapes
    run the compiled kernel, later ones flex's eager implementation (`fresh_dynamo`); both must agree."""
    drafter, items = cases["dflash2_sliding"]
    got = replay_on(
        "cuda", targets("cuda"), drafter, items, anchors=anchors, tf_stride=stride, scores=True, backend="flex"
    )
    want = on_cpu("dflash2_sliding", anchors, stride)
    assert exact(got) == exact(want)
    assert scores(got) == pytest.approx(scores(want), rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("anchors, stride", [("all", 4), ("visited", 4)])
def test_replay_with_the_head_in_chunks_on_the_device(
    targets, cases, on_cpu, monkeypatch, device, kind, anchors, stride
):
    """The LM head over 16 chunks of 16 ids (dflash/models/drafter/head.py, one anchor per head call) on the device:
    the CPU's one-chunk counters and drafts."""
    from dflash.models.drafter import head
    from dflash.stages.replay import drafts

    monkeypatch.setattr(head, "MIN_COLS", 16)
    monkeypatch.setattr(drafts, "HEAD_BYTES", 1)
    drafter, items = cases[kind]
    got = replay_on(device, targets(device), drafter, items, anchors=anchors, tf_stride=stride, scores=True)
    want = on_cpu(kind, anchors, stride)
    assert exact(got) == exact(want)
    assert scores(got) == pytest.approx(scores(want), rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_top_k_on_the_device_equals_the_canonical_order(device, dtype):
    """Integer-valued h and W (every product exact in any order, ties everywhere): on the device the chunked top 1 is
    torch.argmax and the chunked top k the canonical order (a stable sort), in chunks and in one; on CUDA also inside
    a captured CUDA graph (no host check can run there: every chunk ranked by keys)."""
    from test_head import head, stable_topk, tied_case

    from dflash.models.drafter.head import select, top_of_chunks

    h, W = (x.to(device) for x in tied_case(dtype))
    z = torch.nn.functional.linear(h, W)
    for cols in (7, 64, 4096):
        for k in (1, 5, 16):
            out = top_of_chunks(head(W).chunks(h, cols), k)
            assert torch.equal(out.ids.cpu(), stable_topk(z.cpu(), k)[1])
            assert torch.equal(out.ids[:, 0], z.argmax(-1))
    if device == "cuda":
        hd, out = head(W), {}
        static = h.clone()
        select(hd, static, 16)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out["o"] = select(hd, static, 16, budget=4 * h.shape[0] * 1024)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out["o"].ids.cpu(), stable_topk(z.cpu(), 16)[1])


# --- the feature pass, batched ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_batched_features_on_the_device_equal_cpu_one_per_pass(targets, device):
    """`features.batch_tokens`: consecutive sequences of other lengths right-padded into one target pass on the device
    give the CPU's one-sequence-per-pass states, each at its own length (the 27B bench times the two on a GPU)."""
    import random

    rng = random.Random(5)
    seqs = [[rng.randrange(3, 250) for _ in range(n)] for n in (29, 7, 40, 18)]
    want, _ = get_features(targets("cpu"), seqs, [[0, 2]], cache=False)
    got, _ = get_features(targets(device), seqs, [[0, 2]], cache=False, batch_tokens=4096)
    sync(device)
    for a, b, seq in zip(want, got, seqs):
        assert b.states.shape[0] == len(seq)
        torch.testing.assert_close(b.states.float().cpu(), a.states, atol=1e-4, rtol=1e-4)


# --- local references -----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_generate_equals_the_cpu_dynamic_cache(targets, device):
    """`greedy_generate` (dflash/stages/references/local.py, what the references stage calls): on CUDA the static-cache
    engine (generator.Generator, CUDA graphs) in batches with left padding; on the CPU the dynamic cache. Both
    give the CPU's dynamic-cache decode of each prompt alone."""
    import random

    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (3, 11, 6, 17, 9)]
    want = [greedy_generate(targets("cpu"), [p], 24, batch_size=1)[0] for p in prompts]
    engines: list[str] = []
    got = greedy_generate(
        targets(device), prompts, 24, batch_size=2, compile=False, on_engine=lambda label, _s: engines.append(label)
    )
    sync(device)
    assert engines == [
        "static cache, CUDA graphs, not compiled (references.compile=false)" if device == "cuda" else "dynamic cache"
    ]
    assert got == want
    assert all(len(c) == 24 or c[-1] in targets("cpu").eos_ids for c in want)


# --- the trainer ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def train_seqs():
    return greedy_seqs(tiny_target(head_dim=16), n=4, new=24)  # flex_attention's kernels need head_dim >= 16


@pytest.mark.parametrize("device", DEVICES)
def test_trainer_steps_under_autocast(train_seqs, tmp_path, monkeypatch, fresh_dynamo, device):
    """`dflash.train.train`: two lockstep steps of DFlash (`fixed`) and its DFlash2 twin under bf16 autocast, flex
    on CUDA (optim.attention=auto). Each step's loss is finite; at step 2 (the successor codebook no longer zero)
    every convolution and selector weight has a finite, nonzero gradient, and DFlash's fc one."""
    from dflash import train as T
    from dflash.train import loop

    seen = []  # per train_step: (variant arch, settings, loss, {name: grad})
    real = loop.train_step

    def recording(model, opt, target, x, anchors, bugs, s, lr):
        m = real(model, opt, target, x, anchors, bugs, s, lr)
        sync(device)
        grads = {n: None if p.grad is None else p.grad.detach().float().cpu() for n, p in model.named_parameters()}
        seen.append((model.cfg.arch, s, m.loss, grads, anchors.device.type, next(model.parameters()).device.type))
        return m

    monkeypatch.setattr(loop, "train_step", recording)
    target = tiny_target(device=device, head_dim=16)
    # selector_top_k = the whole vocabulary: every valid slot carries selector loss (with a small top-k a random
    # drafter rarely has the label among its candidates, and the selector's gradient may be zero by chance)
    cfg = tiny_cfg(
        tmp_path,
        variants=["fixed", "fixed-dflash2"],
        device={"name": device},
        optim={"steps": 2, "amp": "bf16", "attention": "auto", "max_seq_len": 48},
        drafter={"selector_rank": 4, "selector_top_k": VOCAB, "conv_group_size": 8, "conv_kernel_size": 2},
    )
    T.train(cfg, target=target, seqs=train_seqs)
    assert [arch for arch, *_ in seen] == ["dflash", "dflash2"] * 2
    for arch, s, loss, grads, *where in seen:
        assert s.amp == torch.bfloat16 and s.backend == ("flex" if device == "cuda" else "sdpa")
        assert where == [device, device]
        assert math.isfinite(loss) and loss > 0, (arch, loss)
        assert all(g is None or bool(torch.isfinite(g).all()) for g in grads.values()), arch
    last = {arch: grads for arch, _, _, grads, *_ in seen[2:]}
    assert last["dflash"]["fc.weight"].abs().sum() > 0
    d2 = last["dflash2"]
    wanted = [n for n in d2 if "_conv." in n or n.startswith("candidate_selector.")]
    assert (
        len(wanted) == 4 + 3
    )  # base_kernel, kernel_projection of attention_conv and mlp_conv (1 layer); 3 selector tensors
    assert all(d2[n] is not None and d2[n].abs().sum() > 0 for n in wanted), [
        n for n in wanted if d2[n] is None or not d2[n].abs().sum()
    ]
