"""The DFlash drafter (docs/family.md §1): tap defaults, the visibility rule through the real forward,
attention backends agreeing, batched == per-anchor forwards (what the offline replay relies on),
and the HF config format."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import MASK_ID

from dflash.models.drafter.model import DFlashDrafter, DrafterConfig, build_target_layer_ids
from dflash.models.target.forward import tapped_forward

B = 4  # block size of the tiny drafters


# --- tap defaults: the public rule (docs/family.md §1), by hand ----------------------------------------


@pytest.mark.parametrize(
    "layers, n, expected",
    [
        (30, 1, [15]),
        (30, 2, [1, 27]),
        (30, 3, [1, 14, 27]),
        (30, 4, [1, 10, 18, 27]),
        (30, 5, [1, 8, 14, 20, 27]),
        (30, 6, [1, 6, 11, 17, 22, 27]),
        (30, 7, [1, 5, 10, 14, 18, 23, 27]),
        (30, 8, [1, 5, 8, 12, 16, 20, 23, 27]),
        (64, 5, [1, 16, 31, 46, 61]),
        (36, 5, [1, 9, 17, 25, 33]),
    ],
)
def test_build_target_layer_ids_public_rule(layers, n, expected):
    # 1 + i*(L-4)/(n-1) rounded half to even: 30 layers, 5 -> 1, 7.5->8, 14, 20.5->20, 27 (int() gives 7)
    assert build_target_layer_ids(layers, n) == expected


@pytest.mark.parametrize("layers", [6, 28, 30, 36, 64])
def test_build_target_layer_ids_single_tap_is_middle(layers):
    assert build_target_layer_ids(layers, 1) == [layers // 2]


@pytest.mark.parametrize("layers, taps", [(6, 3), (30, 5), (36, 5), (64, 5), (64, 3)])
def test_build_target_layer_ids_never_taps_last_layer(layers, taps):
    ids = build_target_layer_ids(layers, taps)
    assert len(ids) == taps and ids == sorted(set(ids))
    assert ids[0] == 1 and ids[-1] == layers - 3 and layers - 1 not in ids


# --- helpers ---------------------------------------------------------------------------------


def _inputs(drafter: DFlashDrafter, S: int, T: int, anchors: list[list[int]], seed: int = 0):
    """Random context taps [S, T, n*H], random block embeddings [S, N, B, H], anchor_pos [S, N]."""
    g = torch.Generator().manual_seed(seed)
    cfg = drafter.cfg
    taps = torch.randn(S, T, cfg.num_taps * cfg.hidden_size, generator=g)
    N = len(anchors[0])
    emb = torch.randn(S, N, cfg.block_size, cfg.hidden_size, generator=g)
    return taps, emb, torch.tensor(anchors)


def _run(drafter, taps, emb, anchor_pos, **kw):
    with torch.no_grad():
        return drafter(taps, emb, anchor_pos, **kw)


def _same(a, b):
    return torch.allclose(a, b, atol=1e-6, rtol=0)


def _differs(a, b):
    return (a - b).abs().max().item() > 1e-4


@pytest.fixture(scope="module")
def sensitive(qwen3_target, make_drafter):
    """Larger random weights so that every dependency shows clearly in the output."""
    return make_drafter(qwen3_target, num_layers=2, num_taps=3, block_size=B, seed=3, std=0.2)


# --- visibility through the real forward -----------------------------------------------------


def test_context_from_anchor_on_is_invisible_before_is_visible(sensitive):
    p = 6
    taps, emb, anchor = _inputs(sensitive, 1, 12, [[p]])
    ref = _run(sensitive, taps, emb, anchor)

    later = taps.clone()
    later[:, p:] = torch.randn_like(later[:, p:]) * 5  # the anchor's own position and everything after
    assert _same(_run(sensitive, later, emb, anchor), ref)

    earlier = taps.clone()
    earlier[:, p - 1] += 1.0  # the last committed position before the anchor
    out = _run(sensitive, earlier, emb, anchor)
    assert _differs(out, ref)
    assert all(_differs(out[0, 0, k], ref[0, 0, k]) for k in range(B))  # every slot sees the context

    first = taps.clone()
    first[:, 0] += 1.0
    assert _differs(_run(sensitive, first, emb, anchor), ref)


def test_each_block_sees_only_context_before_its_own_anchor(sensitive):
    taps, emb, anchor = _inputs(sensitive, 1, 16, [[3, 9]])
    ref = _run(sensitive, taps, emb, anchor)
    mid = taps.clone()
    mid[:, 3:9] += 1.0  # after block 0's anchor, before block 1's
    out = _run(sensitive, mid, emb, anchor)
    assert _same(out[:, 0], ref[:, 0])
    assert _differs(out[:, 1], ref[:, 1])


def test_blocks_do_not_see_each_other(sensitive):
    taps, emb, anchor = _inputs(sensitive, 2, 16, [[3, 9, 12], [5, 6, 14]])
    ref = _run(sensitive, taps, emb, anchor)
    other = emb.clone()
    other[:, 1] = torch.randn_like(other[:, 1])  # replace block 1's tokens entirely
    out = _run(sensitive, taps, other, anchor)
    assert _same(out[:, 0], ref[:, 0]) and _same(out[:, 2], ref[:, 2])
    assert _differs(out[:, 1], ref[:, 1])


def test_slots_inside_a_block_attend_bidirectionally(sensitive):
    taps, emb, anchor = _inputs(sensitive, 1, 10, [[4, 7]])
    ref = _run(sensitive, taps, emb, anchor)
    last = emb.clone()
    last[0, 0, B - 1] += 1.0  # the last slot of block 0
    out = _run(sensitive, taps, last, anchor)
    for k in range(B - 1):  # earlier slots see a later one: not causal
        assert _differs(out[0, 0, k], ref[0, 0, k]), f"slot {k} does not see slot {B - 1}"
    first = emb.clone()
    first[0, 0, 0] += 1.0  # the anchor slot
    out = _run(sensitive, taps, first, anchor)
    for k in range(1, B):
        assert _differs(out[0, 0, k], ref[0, 0, k]), f"slot {k} does not see the anchor slot"
    assert _same(out[0, 1], ref[0, 1])


def test_see_anchor_makes_the_anchor_position_visible(sensitive):
    p = 5
    taps, emb, anchor = _inputs(sensitive, 1, 12, [[p]])
    at = taps.clone()
    at[:, p] += 1.0
    assert _same(_run(sensitive, at, emb, anchor), _run(sensitive, taps, emb, anchor))
    leak_ref = _run(sensitive, taps, emb, anchor, see_anchor=True)
    assert _differs(_run(sensitive, at, emb, anchor, see_anchor=True), leak_ref)
    after = taps.clone()
    after[:, p + 1 :] += 1.0  # still invisible with the leak
    assert _same(_run(sensitive, after, emb, anchor, see_anchor=True), leak_ref)


def test_sliding_window_mask_by_hand():
    """Window 4, anchor at 20, context 20, B = 4: slot i (position 20 + i) sees context 17 + i .. 19
    and slots 0..i (SGLang: causal, window includes the query); without a window, context < 20 and
    the whole block."""
    from dflash.models.drafter.model import visibility_mask

    anchor = torch.tensor([[20]])
    m = visibility_mask(anchor, 20, 4, window=4)[0]  # [4, 24]
    for i in range(4):
        ctx = [t for t in range(20) if bool(m[i, t])]
        blk = [j for j in range(4) if bool(m[i, 20 + j])]
        assert ctx == list(range(17 + i, 20)) and blk == list(range(i + 1)), (i, ctx, blk)
    assert visibility_mask(anchor, 20, 4)[0].all()


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("see_anchor", [False, True])
def test_dense_mask_and_flex_mask_mod_agree(window, see_anchor):
    """`visibility_mask` and the mask_mod `flex_block_mask` hands to flex_attention, evaluated by
    flex's own create_mask (vmap over the mask_mod) on CPU: identical."""
    from torch.nn.attention.flex_attention import create_mask

    from dflash.models.drafter.model import mask_mod, visibility_mask

    anchor = torch.tensor([[3, 9, 12], [5, 6, 14]])
    flex = create_mask(mask_mod(anchor, 16, B, see_anchor, window), 2, 1, 3 * B, 16 + 3 * B, device="cpu")[:, 0]
    assert torch.equal(flex, visibility_mask(anchor, 16, B, see_anchor, window))


# --- backends --------------------------------------------------------------------------------


def _real_inputs(target, drafter, anchors: list[list[int]], T: int = 20, seed: int = 0):
    """Taps from the target on random ids; blocks [ids[p], mask, ...] embedded by the target."""
    g = torch.Generator().manual_seed(seed)
    S = len(anchors)
    ids = torch.randint(3, 240, (S, T), generator=g)
    taps = tapped_forward(target, ids, drafter.cfg.target_layer_ids)
    anchor_pos = torch.tensor(anchors)
    block = torch.full((S, anchor_pos.shape[1], B), MASK_ID)
    block[..., 0] = torch.gather(ids, 1, anchor_pos)
    with torch.no_grad():
        emb = target.embed(block)
    return taps, emb, anchor_pos


def test_sdpa_and_eager_agree(qwen3_target, make_drafter):
    drafter = make_drafter(qwen3_target, num_layers=2, block_size=B, seed=1)
    taps, emb, anchor = _real_inputs(qwen3_target, drafter, [[2, 7, 15], [4, 9, 11]])
    hs = _run(drafter, taps, emb, anchor, backend="sdpa")
    he = _run(drafter, taps, emb, anchor, backend="eager")
    assert hs.shape == (2, 3, B, qwen3_target.hidden_size)
    assert torch.isfinite(hs).all()
    torch.testing.assert_close(hs, he, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        ls, le = qwen3_target.lm_head(hs), qwen3_target.lm_head(he)
    assert ls.shape[-1] == qwen3_target.vocab_size
    assert torch.equal(ls.argmax(-1), le.argmax(-1))


def test_unknown_backend_is_refused(qwen3_target, make_drafter):
    drafter = make_drafter(qwen3_target, block_size=B)
    taps, emb, anchor = _real_inputs(qwen3_target, drafter, [[3]])
    with pytest.raises(ValueError, match="attention backend"):
        _run(drafter, taps, emb, anchor, backend="flash")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention needs CUDA")
@pytest.mark.parametrize("causal", [False, True])  # True: vLLM's dflash_config.causal (docs/formats.md)
def test_flex_agrees_with_sdpa(qwen3_target, make_drafter, causal):
    drafter = make_drafter(qwen3_target, num_layers=2, block_size=B, seed=1)
    drafter.causal = [causal] * 2
    taps, emb, anchor = _real_inputs(qwen3_target, drafter, [[2, 7, 15], [4, 9, 11]])
    hs = _run(drafter, taps, emb, anchor, backend="sdpa")
    d = drafter.to("cuda")
    try:
        hf = _run(d, taps.cuda(), emb.cuda(), anchor.cuda(), backend="flex").cpu()
    finally:
        drafter.to("cpu")
    torch.testing.assert_close(hf, hs, atol=1e-4, rtol=1e-3)
    with torch.no_grad():
        assert torch.equal(qwen3_target.lm_head(hf).argmax(-1), qwen3_target.lm_head(hs).argmax(-1))


def test_flex_takes_its_inputs_in_the_autocast_dtype(monkeypatch):
    """flex_attention is not autocast-aware: under bf16 autocast (the trainer on a GPU) RMSNorm hands it fp32
    q/k beside a bf16 v, which it refuses. `attend` casts all three to autocast's dtype (flex itself stood in
    by a recorder: it needs CUDA)."""
    from dflash.models.drafter import model as drafter_mod

    seen = []

    def flex(q, k, v, block_mask=None, enable_gqa=False):
        seen.append((q.dtype, k.dtype, v.dtype, enable_gqa))
        return q

    monkeypatch.setattr(drafter_mod, "_compiled_flex", lambda: flex)
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        drafter_mod.attend(q, k, v, None, "flex")
    drafter_mod.attend(q, k, v.float(), None, "flex")  # no autocast: left as given
    assert seen == [(torch.bfloat16,) * 3 + (True,), (torch.float32,) * 3 + (True,)]


# --- batched == per-anchor (the offline replay's premise) -------------------------------------


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("causal", [False, True])
def test_batched_anchors_equal_single_anchor_forwards(qwen3_target, make_drafter, backend, causal):
    drafter = make_drafter(qwen3_target, num_layers=2, block_size=B, seed=2, std=0.1)
    drafter.causal = [causal, False]  # one causal layer beside a bidirectional one
    anchors = [[1, 5, 6, 13, 19], [2, 3, 10, 11, 17]]
    taps, emb, anchor = _real_inputs(qwen3_target, drafter, anchors, T=20)
    batched = _run(drafter, taps, emb, anchor, backend=backend)
    for s, row in enumerate(anchors):
        for n, p in enumerate(row):
            single = _run(drafter, taps[s : s + 1, :p], emb[s : s + 1, n : n + 1], torch.tensor([[p]]), backend=backend)
            torch.testing.assert_close(batched[s, n], single[0, 0], atol=1e-5, rtol=1e-4)


# --- config format ---------------------------------------------------------------------------


def _cfg(**kw) -> DrafterConfig:
    base = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_target_layers=6,
        target_layer_ids=[1, 2, 3],
        mask_token_id=MASK_ID,
        block_size=B,
    )
    return DrafterConfig(**{**base, **kw})


def test_to_hf_from_hf_round_trip():
    cfg = _cfg(
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        attention_bias=True,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        extra={"torch_dtype": "bfloat16", "vocab_size": 256},
    )
    d = json.loads(json.dumps(cfg.to_hf()))  # through JSON, as config.json
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 2, 3]}
    assert d["layer_types"] == ["sliding_attention", "full_attention"] and d["use_sliding_window"] is True
    assert d["block_size"] == B and d["num_target_layers"] == 6
    assert "mask_token_id" not in d and "target_layer_ids" not in d  # only under dflash_config
    assert DrafterConfig.from_hf(d) == cfg
    from transformers import Qwen3Config  # transformers reads it as the same Qwen3 architecture

    hf = Qwen3Config.from_dict(d)
    assert (hf.rope_parameters["rope_type"], hf.sliding_window, hf.attention_bias, hf.layer_types) == (
        "yarn",
        8,
        True,
        d["layer_types"],
    )


def test_from_hf_reads_a_public_style_config():
    public = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "num_hidden_layers": 1,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "block_size": 16,
        "num_target_layers": 36,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "layer_types": ["full_attention"],
        "torch_dtype": "bfloat16",
        "vocab_size": 151936,
    }
    cfg = DrafterConfig.from_hf(public, overrides={"mask_token_id": 5, "block_size": 8, "target_layer_ids": [0]})
    assert cfg.mask_token_id == 151669  # overrides only fill what the checkpoint lacks
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] and cfg.num_taps == 5
    assert cfg.block_size == 16 and cfg.num_target_layers == 36
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (4096, 1, 128)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1000000.0}
    assert cfg.extra == {"torch_dtype": "bfloat16", "vocab_size": 151936}
    # written back, it is still the public format
    again = cfg.to_hf()
    assert again["dflash_config"] == public["dflash_config"] and again["architectures"] == ["DFlashDraftModel"]


def test_from_hf_defaults_are_transformers_defaults():
    """Absent keys read as transformers' Qwen3Config reads them: head_dim 128, rope θ 10000."""
    d = _cfg(head_dim=128).to_hf()
    for k in ("head_dim", "rope_parameters"):
        del d[k]
    cfg = DrafterConfig.from_hf(d)
    assert cfg.head_dim == 128 and cfg.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("missing", ["mask_token_id", "target_layer_ids"])
def test_from_hf_leaves_target_dependent_fields_to_the_fit(missing):
    d = _cfg().to_hf()
    del d["dflash_config"][missing]
    assert (
        getattr(DrafterConfig.from_hf(d), missing) is None
    )  # resolved against the target (dflash.models.drafter.checkpoint.fit_drafter)
    value = 7 if missing == "mask_token_id" else [0, 4]
    assert getattr(DrafterConfig.from_hf(d, overrides={missing: value}), missing) == value
    assert (
        getattr(DrafterConfig.from_hf(d, overrides={missing: None}), missing) is None
    )  # a null override fills nothing


def test_from_hf_without_dflash_config():
    d = _cfg().to_hf()
    del d["dflash_config"]
    cfg = DrafterConfig.from_hf(d, overrides={"target_layer_ids": [1, 3], "mask_token_id": 9})
    assert cfg.target_layer_ids == [1, 3] and cfg.mask_token_id == 9


def test_replay_scores_are_the_drafters_own_distribution(qwen3_target, make_drafter):
    """draft_every_anchor's proposal, NLL of the reference token and top-1 probability at every
    anchor equal a single-anchor forward's argmax, -log_softmax[ref] and max softmax."""
    from shortcuts import draft_every_anchor

    drafter = make_drafter(qwen3_target, num_layers=1, block_size=B, seed=3, std=0.1)
    T, P = 14, 5
    seq = torch.randint(3, 240, (T,), generator=torch.Generator().manual_seed(4))
    taps = tapped_forward(qwen3_target, seq[None], drafter.cfg.target_layer_ids)[0]
    props, nll, conf = draft_every_anchor(drafter, qwen3_target, seq, taps, P, anchors_per_chunk=3, scores=True)
    assert torch.equal(
        draft_every_anchor(drafter, qwen3_target, seq, taps, P, anchors_per_chunk=3)[0], props
    )  # scores change no draft
    assert props.shape == nll.shape == conf.shape == (T - 1 - P, B - 1)
    for i, p in enumerate(range(P, T - 1)):
        block = torch.full((1, 1, B), MASK_ID)
        block[0, 0, 0] = seq[p]
        with torch.no_grad():
            h = drafter(taps[None, :p], qwen3_target.embed(block), torch.tensor([[p]]))
            logp = qwen3_target.lm_head(h[0, 0, 1:]).float().log_softmax(-1)  # [B-1, V]
        assert torch.equal(props[i], logp.argmax(-1))
        torch.testing.assert_close(conf[i], logp.max(-1).values.exp(), atol=1e-5, rtol=1e-4)
        for k in range(1, B):
            if p + k < T:
                torch.testing.assert_close(nll[i, k - 1], -logp[k - 1, seq[p + k]], atol=1e-4, rtol=1e-4)
