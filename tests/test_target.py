"""The target (DFLASH.md §1, §5): taps are the outputs of decoder layers (hidden_states[L + 1]),
HF and VL-text loading, the KV-cache glue, and load errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dflash.target import TargetError, crop_cache, forward, load_target, new_cache, tap, tapped_forward


def _layer_outputs(target, ids, layers):
    """Capture decoder layer L's output with a forward hook on model.model.layers[L]."""
    got, handles = {}, []
    for L in layers:
        def hook(_mod, _inp, out, L=L):
            got[L] = (out[0] if isinstance(out, tuple) else out).detach().clone()

        handles.append(target.model.model.layers[L].register_forward_hook(hook))
    try:
        with torch.no_grad():
            target.model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return got


def _ids(S=2, T=11, seed=0):
    return torch.randint(3, 250, (S, T), generator=torch.Generator().manual_seed(seed))


def _check_taps(target, layers):
    H = target.hidden_size
    ids = _ids()
    taps = tapped_forward(target, ids, layers)
    assert taps.shape == (2, 11, len(layers) * H)
    want = _layer_outputs(target, ids, layers)
    for i, L in enumerate(layers):
        torch.testing.assert_close(taps[..., i * H : (i + 1) * H], want[L], atol=1e-6, rtol=1e-5, msg=f"tap {L}")
    # the +1 matters: hidden_states[L] (the layer's input) would be a different tensor
    with torch.no_grad():
        hs = forward(target, ids, hidden_states=True).hidden_states
    assert len(hs) == target.num_layers + 1
    L = layers[-1]
    assert not torch.allclose(hs[L], want[L])


def test_qwen3_taps_are_decoder_layer_outputs(qwen3_target):
    n = qwen3_target.num_layers
    assert n == 6
    _check_taps(qwen3_target, [0, 1, 3, n - 2])
    _check_taps(qwen3_target, [n - 2, 0])  # order of the list is the concatenation order


def test_qwen3_target_properties(qwen3_target, qwen3_dir):
    t = qwen3_target
    assert (t.num_layers, t.hidden_size, t.vocab_size) == (6, 64, 256)
    assert t.dtype == torch.float32 and t.device.type == "cpu"
    assert t.max_context == 512
    assert t.eos_ids == [2]
    assert t.identity.startswith("hf-") and t.source == str(qwen3_dir)
    assert not any(p.requires_grad for p in t.model.parameters()) and not t.model.training
    ids = _ids(1, 5)
    with torch.no_grad():
        logits = t.model(input_ids=ids).logits
        hs = forward(t, ids, hidden_states=True).hidden_states
    torch.testing.assert_close(t.lm_head(hs[-1]), logits)
    assert t.embed(ids).shape == (1, 5, 64)


def test_max_context_is_capped_by_the_model(qwen3_dir):
    assert load_target("hf", str(qwen3_dir), max_context=100).max_context == 100
    assert load_target("hf", str(qwen3_dir), max_context=10_000).max_context == 512


def test_identity_changes_with_the_config(qwen3_dir, tmp_path):
    other = tmp_path / "copy"
    shutil.copytree(qwen3_dir, other)
    a = load_target("hf", str(other)).identity
    assert load_target("hf", str(other)).identity == a
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(cfg))
    b = load_target("hf", str(other))
    assert b.identity != a  # a rewritten source is reloaded, not served from the reuse cache
    assert b.model.config.rms_norm_eps == 1e-5


def test_new_weights_of_the_same_shapes_are_a_new_target(qwen3_dir, tmp_path):
    """Retrained weights at the same path: same file sizes, other values. The reference cache is
    keyed on the identity, so the identity must change, and a reload must read the new weights."""
    import os

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    other = tmp_path / "copy"
    shutil.copytree(qwen3_dir, other)
    first = load_target("hf", str(other))
    st = other / "model.safetensors"
    sd = load_file(str(st))
    with safe_open(str(st), framework="pt") as f:
        meta = f.metadata()
    size, mtime = st.stat().st_size, st.stat().st_mtime_ns
    save_file({k: v + 1 if k == "model.norm.weight" else v for k, v in sd.items()}, str(st), metadata=meta)
    os.utime(st, ns=(mtime + 1_000_000, mtime + 1_000_000))  # a later write, even on a coarse clock
    assert st.stat().st_size == size
    second = load_target("hf", str(other))
    assert second.identity != first.identity
    assert second.model is not first.model
    torch.testing.assert_close(second.model.model.norm.weight, first.model.model.norm.weight + 1)
    assert load_target("hf", str(other)) is second  # unchanged: reused


def test_tap_helper_indexes_plus_one():
    hs = tuple(torch.full((1, 2, 3), float(i)) for i in range(5))  # embedding + 4 layers
    out = tap(hs, [0, 2])
    assert out.shape == (1, 2, 6)
    assert out[..., :3].eq(1).all() and out[..., 3:].eq(3).all()


# --- vision-language checkpoint: only the text decoder ---------------------------------------


def test_vlm_text_builds_only_the_text_decoder(vl_target, vl_full):
    names = [n for n, _ in vl_target.model.named_parameters()]
    assert names and not any("visual" in n or "vision" in n for n in names)
    full_visual = sum(p.numel() for n, p in vl_full.named_parameters() if "visual" in n)
    assert full_visual > 0
    assert sum(p.numel() for p in vl_target.model.parameters()) == sum(p.numel() for n, p in vl_full.named_parameters() if "visual" not in n)
    assert not any(p.is_meta for p in vl_target.model.parameters())
    assert not any(b.is_meta for b in vl_target.model.buffers())
    assert (vl_target.num_layers, vl_target.hidden_size, vl_target.vocab_size) == (4, 64, 256)


def test_vlm_text_matches_the_full_model_on_text(vl_target, vl_full):
    ids = _ids(2, 9, seed=3)
    with torch.no_grad():
        ours = forward(vl_target, ids, hidden_states=True)
        full = vl_full(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(ours.logits, full.logits, atol=1e-5, rtol=1e-5)
    assert len(ours.hidden_states) == len(full.hidden_states) == vl_target.num_layers + 1
    for a, b in zip(ours.hidden_states, full.hidden_states):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_vlm_text_taps_are_decoder_layer_outputs(vl_target):
    _check_taps(vl_target, [0, 1, vl_target.num_layers - 2])


def test_vlm_text_rejects_a_text_only_folder(qwen3_dir):
    with pytest.raises(TargetError, match="text_config"):
        load_target("vlm_text", str(qwen3_dir))


# --- KV cache --------------------------------------------------------------------------------


def test_crop_cache_keeps_the_first_positions_and_decoding_continues(qwen3_target):
    t = qwen3_target
    ids = _ids(1, 20, seed=5)
    cache = new_cache(t)
    with torch.no_grad():
        forward(t, ids[:, :10], cache)  # prefill
        assert cache.get_seq_length() == 10
        forward(t, ids[:, 10:16], cache)  # a verify block, partly rejected
        assert cache.get_seq_length() == 16
        keys_before = [layer.keys.clone() for layer in cache.layers]
        crop_cache(cache, 12)
        assert cache.get_seq_length() == 12
        for before, layer in zip(keys_before, cache.layers):
            assert layer.keys.shape[-2] == 12
            assert torch.equal(layer.keys, before[..., :12, :])
        crop_cache(cache, 12)  # no-op when nothing is to drop
        crop_cache(cache, 50)
        assert cache.get_seq_length() == 12
        # continue with tokens other than the dropped ones: as if the cache never held them
        cont = torch.randint(3, 250, (1, 5), generator=torch.Generator().manual_seed(9))
        assert not torch.equal(cont, ids[:, 12:17])
        step = forward(t, cont, cache).logits
        assert cache.get_seq_length() == 17
        fresh = t.model(input_ids=torch.cat([ids[:, :12], cont], dim=1)).logits
    torch.testing.assert_close(step, fresh[:, 12:], atol=1e-5, rtol=1e-4)


def test_cached_decoding_equals_a_full_forward(qwen3_target):
    t = qwen3_target
    ids = _ids(2, 14, seed=6)
    cache = new_cache(t)
    with torch.no_grad():
        parts = [forward(t, ids[:, :8], cache).logits]
        for i in range(8, 14):
            parts.append(forward(t, ids[:, i : i + 1], cache).logits)
        full = t.model(input_ids=ids).logits
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-4)


# --- errors ----------------------------------------------------------------------------------


def test_missing_folder(tmp_path):
    with pytest.raises(TargetError, match="config.json") as e:
        load_target("hf", str(tmp_path / "nowhere"))
    assert "target.path" in str(e.value)


def test_folder_without_config_json(qwen3_dir, tmp_path):
    folder = tmp_path / "noconfig"
    shutil.copytree(qwen3_dir, folder)
    (folder / "config.json").unlink()
    for kind in ("hf", "vlm_text"):
        with pytest.raises(TargetError, match=f"{folder}.*config.json"):
            load_target(kind, str(folder))


def test_unknown_kind(qwen3_dir):
    with pytest.raises(TargetError, match="gguf, hf or vlm_text"):
        load_target("onnx", str(qwen3_dir))


def test_missing_gguf_file(tmp_path):
    with pytest.raises(TargetError, match="does not exist"):
        load_target("gguf", str(tmp_path / "model.gguf"), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(TargetError, match="not installed"):
        load_target("gguf", "pkg:no_such_package_here", cache_dir=str(tmp_path / "cache"))
