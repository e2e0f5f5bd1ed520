"""A drafter's config.json read the way the field's implementations read it, or refused.

`parse_config(raw)` builds transformers' `Qwen3Config` from the architecture keys (exactly as
`from_pretrained` would, rope forms and sliding-window keys included) and takes every architectural
value from it; DFlash's own fields follow SGLang's parser (`dflash_config` first, then the top level, a
warning when both differ; overrides fill only what the checkpoint lacks); DFlash2's keys are checked in
dflash/models/drafter/dflash2_config.py, and other formats are translated first by dflash/models/drafter/formats.py.
Every top-level and `dflash_config` key falls in one class of the tables below: UNDERSTOOD (read and
implemented), HARMLESS (changes nothing computed; written back), EXTENSIONS (accepted only at the value
meaning "off") or unknown (accepted only when null, false or empty). Anything else is a `CheckpointError`
naming the key and what to do, raised before the target loads. What is read how: docs/checkpoints.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash.models.drafter.dflash2_config import DFLASH2_FIELDS, DFlash2Config, parse_dflash2
from dflash.models.drafter.dspark_config import (
    DSPARK_ARCHITECTURES,
    NESTED_KEYS,
    TOP_KEYS,
    TRAINING_ONLY,
    DSparkConfig,
    parse_dspark,
    refuse_architecture,
    refuse_variant,
)
from dflash.models.drafter.rope import (
    attention_scaling_warning,
    dynamic_rope_warning,
    qwen3_config,
    read_rope,
    rotary_parameters,
)
from dflash.util.errors import CheckpointError

LAYER_TYPES = ("full_attention", "sliding_attention")
ARCHITECTURES = {
    "DFlashDraftModel": "dflash",
    "DFlash2DraftModel": "dflash2",
    **dict.fromkeys(DSPARK_ARCHITECTURES, "dspark"),
}  # config.json's name -> DrafterConfig.arch
DFLASH_FIELDS = ("block_size", "target_layer_ids", "mask_token_id", "num_target_layers", "mask_token")
# Qwen3 architecture keys handed to transformers' Qwen3Config (then read back from it)
ARCH_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "attention_bias",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "hidden_act",
    "partial_rotary_factor",
)
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
HEAD_KEYS = (
    "target_hidden_size",
    "draft_vocab_size",
    "logit_scale",
)  # vLLM's qwen3_dflash fields (dflash/models/drafter/formats.py)
HEAD_OFF = {"logit_scale": 1.0}  # not written back at these values
UNDERSTOOD = {*ARCH_KEYS, *DFLASH_FIELDS, *HEAD_KEYS, "dflash_config", "architectures", "model_type"}
HARMLESS = {
    "vocab_size",
    "tie_word_embeddings",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "use_cache",
    "initializer_range",
    "attention_dropout",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "num_labels",
    "problem_type",
    "finetuning_task",
    "task_specific_params",
    "tokenizer_class",
    "prefix",
    "_name_or_path",
    "auto_map",
    "_attn_implementation_autoset",
    *TRAINING_ONLY,
}
# key -> (values meaning "off", what it would change)
EXTENSIONS: dict[str, tuple[tuple[Any, ...], str]] = {
    "projector_type": ((None,), "SGLang's context projector other than fc + hidden_norm"),
    "conv_kernel_size": ((None, 0), "DFlash2's dynamic causal convolutions"),
    "conv_group_size": ((None, 0), "DFlash2's dynamic causal convolutions"),
    "selector_rank": ((None, 0), "DFlash2's candidate selector"),
    "selector_top_k": ((None, 0), "DFlash2's candidate selector"),
    "output_multiplier": ((None, 1), "a multiplier on the draft logits"),
    "final_logit_softcapping": ((None, 0), "soft-capped draft logits"),
    "attention_sink_bias": ((None, False), "attention sinks"),
    "attention_sinks": ((None, False), "attention sinks"),
    "attention_value_scale": ((None, 1), "scaled attention values"),
    "has_embed_tokens": ((None, False), "a token embedding of the drafter's own"),
    "quantization_config": ((None,), "quantized weights"),
    "input_embedding_scale": ((None, 1), "scaled block embeddings (z-lab)"),
    "is_causal": ((None,), "causal attention chosen per config (z-lab) instead of per layer type (SGLang)"),
    "mlp_bias": ((None, False), "MLP biases (transformers' Qwen3MLP and SGLang's DFlash MLP have none)"),
    "rope_is_neox_style": ((None, True), "interleaved (GPT-J style) rotary"),
    "is_neox_style": ((None, True), "interleaved (GPT-J style) rotary"),
    "sample_from_anchor": (
        (None, False),
        "the anchor slot convention (DSpark's: every block row a proposal), which SGLang's DFlash does not read",
    ),
}


def build_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """The public rule (z-lab, SGLang; docs/family.md §1): `num_taps` = the number of draft layers,
    spread with Python's round() over layers 1 .. L-3; one tap is [L // 2]."""
    if num_taps == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(
            f"the public tap rule needs a target of at least 4 layers, this one has {num_target_layers}; set the taps "
            f"explicitly"
        )
    span = num_target_layers - 4  # layers 1 .. L-3
    return [round(1 + i * span / (num_taps - 1)) for i in range(num_taps)]


@dataclass
class DrafterConfig:
    """The effective drafter config: every value the computation reads. `target_layer_ids`,
    `mask_token_id` and `num_target_layers` may stay None until fitted to a target."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_target_layers: int | None
    target_layer_ids: list[int] | None
    mask_token_id: int | None
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    layer_types: list[str] = field(default_factory=list)  # per draft layer; empty: all full_attention
    sliding_window: int | None = None  # keys a sliding_attention query sees, itself included (HF's convention)
    mask_token: str | None = None  # resolved through the target's tokenizer when mask_token_id is absent
    extra: dict[str, Any] = field(default_factory=dict)  # harmless config.json keys, written back
    # vLLM's fields (docs/formats.md; dflash/models/drafter/formats.py translates other formats into these)
    causal: bool | None = None  # dflash_config.causal: every layer causal in the block (None: sliding layers only)
    target_hidden_size: int | None = None  # the taps' width when it differs from hidden_size (own embedding + head)
    logit_scale: float = 1.0  # draft logits times this (vLLM's LogitsProcessor scale)
    draft_vocab_size: int | None = None  # rows of the drafter's own lm_head when smaller than the target's vocabulary
    vocab_size: int | None = (
        None  # config vocab_size (the target's), set by formats.own_tensors where own tensors need it
    )
    own_embed: bool = False  # embed_tokens.weight in the checkpoint: block tokens embedded with it
    own_lm_head: bool = False  # lm_head.weight in the checkpoint: draft logits through it
    vocab_map: bool = False  # d2t [draft_vocab_size] in the checkpoint: draft id i is target id i + d2t[i]
    arch: str = "dflash"  # ARCHITECTURES' values: "dflash2" adds the `dflash2` part, "dspark" the `dspark` part
    dflash2: DFlash2Config | None = None  # DFlash2DraftModel: convolutions, unary transform, selector
    dspark: DSparkConfig | None = None  # DSpark: slot convention, Markov head, confidence head (block_size = its rows)

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers

    @property
    def offset(self) -> int:
        """The block row of the first proposal: 0 in the anchor convention (DSpark's sample_from_anchor), else 1."""
        return 0 if self.dspark is not None and self.dspark.sample_from_anchor else 1

    @property
    def proposals(self) -> int:
        """Tokens drafted per verify step: rows `offset` .. block_size - 1 of the block."""
        return self.block_size - self.offset

    @property
    def width(self) -> int:
        """Tokens a verify step runs the target on: the anchor and the proposals (SGLang's num_draft_tokens)."""
        return self.proposals + 1

    @property
    def conv(self) -> tuple[int, int] | None:
        """(kernel taps, group size) of DFlash2's block convolutions where the drafter has them (DFlash2 or DSpark)."""
        for part in (self.dflash2, self.dspark):
            if part is not None and part.conv_kernel_size is not None:
                return part.conv_kernel_size, part.conv_group_size
        return None

    def layer_causal(self, layer_type: str) -> bool:
        """vLLM's rule: `causal` when set, else causal exactly on sliding layers (SGLang's rule too)."""
        return self.causal if self.causal is not None else layer_type == "sliding_attention"

    @property
    def num_taps(self) -> int:  # without target_layer_ids: the public rule's count, one per draft layer
        return len(self.target_layer_ids) if self.target_layer_ids else self.num_hidden_layers

    def to_hf(self) -> dict[str, Any]:
        """config.json of the public HF format (a Qwen3 config as transformers 5 writes it, plus DFlash's fields)."""
        skip = (
            "extra",
            "target_layer_ids",
            "mask_token_id",
            "mask_token",
            "causal",
            "own_embed",
            "own_lm_head",
            "vocab_map",
            "arch",
            "dflash2",
            "dspark",
        )
        d = {
            k: v
            for k, v in asdict(self).items()
            if k not in skip and not (k in (*HEAD_KEYS, "vocab_size") and v in (None, HEAD_OFF.get(k)))
        }
        dflash = (
            {"mask_token_id": self.mask_token_id}
            if self.mask_token_id is not None
            else {"mask_token": self.mask_token}
            if self.mask_token
            else {}
        )
        if self.causal is not None:
            dflash["causal"] = self.causal
        if self.target_layer_ids:
            dflash["target_layer_ids"] = list(self.target_layer_ids)
        if (
            self.dflash2 is not None
        ):  # SpecForge's export: block_size and DFlash2's keys in dflash_config, the codebooks' vocab_size
            dflash.update(block_size=self.block_size, **self.dflash2.to_dflash_config())
            if self.dflash2.vocab_size is not None:
                d["vocab_size"] = self.dflash2.vocab_size
        if self.dspark is not None:  # SGLang builds DSpark's heads from the top level only: every key there
            ds = self.dspark
            d.update(ds.to_top_level())
            if ds.vocab_size is not None:
                d["vocab_size"] = ds.vocab_size
            if ds.conv_kernel_size is not None:
                dflash.update(
                    block_size=d["block_size"], conv_kernel_size=ds.conv_kernel_size, conv_group_size=ds.conv_group_size
                )
            if ds.attention_mode is not None:
                dflash["attention_mode"] = ds.attention_mode
        sliding = "sliding_attention" in self.layer_types
        arch = (
            self.dspark.architecture
            if self.dspark is not None
            else next(name for name, a in ARCHITECTURES.items() if a == self.arch)
        )
        return {
            **self.extra,
            **d,
            "use_sliding_window": sliding,
            "hidden_act": "silu",
            "architectures": [arch],
            "model_type": "qwen3",
            "dflash_config": dflash,
        }

    @classmethod
    def from_hf(cls, d: dict[str, Any], overrides: dict[str, Any] | None = None) -> "DrafterConfig":
        """Parse a config.json dict; `parse_config` also returns the precedence warnings."""
        return parse_config(d, overrides)[0]


# --- checks ----------------------------------------------------------------------------------------


def _bad(name: str, value: Any, want: str) -> CheckpointError:
    return CheckpointError(f"config field {name}={value!r} should be {want}; fix config.json")


def _int(name: str, v: Any, lo: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, v, "an integer")
    if lo is not None and v < lo:
        raise _bad(name, v, f"an integer >= {lo}")
    return v


def _num(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(name, v, "a finite number")
    return float(v)


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _bad(name, v, "true or false")
    return v


def _int_list(name: str, v: Any) -> list[int]:
    if not isinstance(v, (list, tuple)) or not v:
        raise _bad(name, v, "a non-empty list of integers")
    return [_int(f"{name}[{i}]", x, 0) for i, x in enumerate(v)]


TYPES = {  # present and not null -> checked before transformers sees it
    "hidden_size": lambda n, v: _int(n, v, 1),
    "num_hidden_layers": lambda n, v: _int(n, v, 1),
    "num_attention_heads": lambda n, v: _int(n, v, 1),
    "num_key_value_heads": lambda n, v: _int(n, v, 1),
    "head_dim": lambda n, v: _int(n, v, 1),
    "intermediate_size": lambda n, v: _int(n, v, 1),
    "max_position_embeddings": lambda n, v: _int(n, v, 1),
    "max_window_layers": lambda n, v: _int(n, v, 0),
    "sliding_window": lambda n, v: _int(n, v, 1),
    "rms_norm_eps": _num,
    "rope_theta": _num,
    "partial_rotary_factor": _num,
    "attention_bias": _bool,
    "use_sliding_window": _bool,
    "block_size": lambda n, v: _int(n, v, 1),
    "num_target_layers": lambda n, v: _int(n, v, 1),
    "mask_token_id": lambda n, v: _int(n, v, 0),
    "target_layer_ids": _int_list,
    "target_hidden_size": lambda n, v: _int(n, v, 1),
    "draft_vocab_size": lambda n, v: _int(n, v, 1),
    "logit_scale": _num,
    "causal": _bool,
    "vocab_size": lambda n, v: _int(n, v, 1),
}


def _check_type(name: str, v: Any) -> None:
    key = name.rsplit(".", 1)[-1]
    if key in TYPES:
        TYPES[key](name, v)
    elif key in ("rope_parameters", "rope_scaling", "dflash_config") and not isinstance(v, dict):
        raise _bad(name, v, "a mapping")
    elif key in ("hidden_act", "mask_token") and not (isinstance(v, str) and v):
        raise _bad(name, v, "a non-empty string")
    elif key in ("layer_types", "architectures") and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
        raise _bad(name, v, "a list of strings")


def _is_off(v: Any, off: tuple[Any, ...]) -> bool:
    return any(
        v is o or (o is not None and not isinstance(v, bool) and isinstance(v, (int, float)) and v == o) for o in off
    )


def _classify(d: dict[str, Any], where: str, known: set[str]) -> dict[str, Any]:
    """Refuse extension keys switched on and unknown keys with a value; return the harmless ones."""
    kept = {}
    for k, v in d.items():
        name = f"{where}{k}"
        if k in known:
            continue
        if k in HARMLESS:
            kept[k] = v
        elif k in EXTENSIONS:
            off, what = EXTENSIONS[k]
            if not _is_off(v, off):
                raise CheckpointError(
                    f"config key {name}={v!r} switches on {what}, which this evaluator does not implement: evaluating "
                    f"without it would measure a different model. Use a drafter without it (accepted values: "
                    f"{list(off)})"
                )
        elif not (v is None or v is False or v in ({}, [], "")):
            raise CheckpointError(
                f"unknown config key {name}={v!r}: neither transformers' Qwen3 nor DFlash's implementations that this "
                "evaluator follows read it, so it may change the drafter in a way not implemented here. If it is only "
                "metadata, delete it from config.json (or set it to null)"
            )
    return kept


def _pick(name: str, dflash: dict[str, Any], top: dict[str, Any], warnings: list[str]) -> Any:
    """dflash_config first, then the top level (SGLang's precedence); a warning when both differ."""
    a, b = dflash.get(name), top.get(name)
    if a is not None and b is not None and a != b:
        warnings.append(
            f"config has {name}={b!r} at the top level and dflash_config.{name}={a!r}: using dflash_config's {a!r}, as "
            f"SGLang does"
        )
    return a if a is not None else b


# --- parsing ---------------------------------------------------------------------------------------


def parse_config(raw: dict[str, Any], overrides: dict[str, Any] | None = None) -> tuple[DrafterConfig, list[str]]:
    """config.json dict (-> CheckpointError naming the key) -> (DrafterConfig, warnings)."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"the drafter config should be a mapping, got {type(raw).__name__}")
    dflash = raw.get("dflash_config") or {}
    for k, v in [
        *raw.items(),
        *((f"dflash_config.{k}", v) for k, v in (dflash.items() if isinstance(dflash, dict) else ())),
    ]:
        if v is not None:
            _check_type(k, v)
    archs = raw.get("architectures") or ["DFlashDraftModel"]
    if len(archs) == 1 and (refused := refuse_architecture(archs[0])) is not None:
        raise refused
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise CheckpointError(
            f"architectures={archs!r}: one of {[[a] for a in ARCHITECTURES]} is implemented (not other variants)"
        )
    arch = ARCHITECTURES[archs[0]]
    dspark_only = [k for k in TOP_KEYS if k != "sample_from_anchor"]  # DFlash's: EXTENSIONS (false is DFlash's own)
    if arch != "dspark" and (keys := [k for k in dspark_only if raw.get(k) not in (None, False, 0, {})]):
        raise CheckpointError(
            f"config keys {keys} are DSpark's, but architectures={archs!r} is not a DSpark drafter: SGLang would serve "
            f"it without DSpark's heads. Name it as what it is (a DSpark drafter: one of {list(DSPARK_ARCHITECTURES)})"
        )
    if arch == "dspark":
        refuse_variant(raw)
    extra = _classify(raw, "", UNDERSTOOD | (set(TOP_KEYS) if arch == "dspark" else set()))
    nested_known = {*DFLASH_FIELDS, "causal"} | (
        set(DFLASH2_FIELDS)
        if arch == "dflash2"
        else {*NESTED_KEYS, "sample_from_anchor", *TRAINING_ONLY}
        if arch == "dspark"
        else set()
    )
    _classify(dflash, "dflash_config.", nested_known)
    if raw.get("model_type", "qwen3") not in ("qwen3", None):
        raise CheckpointError(
            f"model_type={raw['model_type']!r}: DFlash draft layers are Qwen3 layers; only model_type qwen3 is "
            f"implemented"
        )
    missing = [k for k in REQUIRED if raw.get(k) is None]
    if missing:
        raise CheckpointError(
            f"drafter config lacks {missing}; the checkpoint should store them (a Qwen3 config with DFlash's fields)"
        )

    hf = qwen3_config({k: raw[k] for k in ARCH_KEYS if k in raw})
    if hf.hidden_act != "silu":
        raise CheckpointError(
            f"hidden_act={hf.hidden_act!r} is not implemented (DFlash drafters use silu, as SGLang requires)"
        )
    layer_types = list(hf.layer_types or ["full_attention"] * hf.num_hidden_layers)
    if len(layer_types) != hf.num_hidden_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise CheckpointError(
            f"layer_types={layer_types!r}: one of {LAYER_TYPES} per draft layer ({hf.num_hidden_layers}) is implemented"
        )
    window = hf.sliding_window if "sliding_attention" in layer_types else None
    if "sliding_attention" in layer_types and window is None:
        raise CheckpointError(
            "layer_types has sliding_attention layers but the config gives no window (transformers keeps "
            "sliding_window only "
            "with use_sliding_window: true; SGLang refuses such a config): set use_sliding_window: true and "
            "sliding_window"
        )
    if "sliding_attention" in layer_types and dflash.get("causal") is False and window < _block_of(dflash, raw):
        raise CheckpointError(
            f"is_causal / dflash_config.causal=false with sliding_window={window} < block_size: a non-causal sliding "
            f"layer's window "
            "then cuts its own block, where SGLang's attention backends disagree (FA3: both sides, FlashInfer / "
            "Triton: the left "
            "side only); not implemented. Use a window of at least block_size (public DFlash2 drafters use 2048)"
        )
    if hf.num_attention_heads % hf.num_key_value_heads:
        raise CheckpointError(
            f"num_attention_heads={hf.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={hf.num_key_value_heads}"
        )

    warnings: list[str] = []
    dv = {k: _pick(k, dflash, raw, warnings) for k in DFLASH_FIELDS}
    for k, v in (overrides or {}).items():  # fill only what the checkpoint lacks
        if dv.get(k) is None and v is not None:
            dv[k] = list(v) if k == "target_layer_ids" else v
    ds = None
    if arch == "dspark":  # DSpark's own precedence for gamma, mask id and taps (dspark_config.py)
        ds, fields = parse_dspark(raw, dflash, archs[0], hf.hidden_size, warnings)
        dv.update(fields)
    if dv["target_layer_ids"] is not None:
        dv["target_layer_ids"] = _int_list("target_layer_ids", dv["target_layer_ids"])
    block = 16 if dv["block_size"] is None else dv["block_size"]
    d2 = parse_dflash2(dflash, hf.hidden_size, block, raw.get("vocab_size")) if arch == "dflash2" else None
    cfg = DrafterConfig(
        hidden_size=hf.hidden_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim,
        intermediate_size=hf.intermediate_size,
        num_target_layers=dv["num_target_layers"],
        target_layer_ids=dv["target_layer_ids"],
        mask_token_id=dv["mask_token_id"],
        block_size=block,
        rms_norm_eps=float(hf.rms_norm_eps),
        rope_parameters=read_rope(hf),
        max_position_embeddings=hf.max_position_embeddings,
        attention_bias=bool(hf.attention_bias),
        layer_types=layer_types,
        sliding_window=window,
        mask_token=dv["mask_token"],
        extra=extra,
        arch=arch,
        dflash2=d2,
        dspark=ds,
        causal=dflash.get("causal"),
        target_hidden_size=raw.get("target_hidden_size"),
        draft_vocab_size=raw.get("draft_vocab_size"),
        logit_scale=1.0 if raw.get("logit_scale") is None else float(raw["logit_scale"]),
    )
    rotary_parameters(cfg)  # transformers computes this rope, or the config is refused now
    if cfg.rope_parameters["rope_type"] == "dynamic":
        warnings.append(dynamic_rope_warning(cfg))
    if (w := attention_scaling_warning(cfg)) is not None:
        warnings.append(w)
    return cfg, warnings


def _block_of(dflash: dict[str, Any], raw: dict[str, Any]) -> int:
    """block_size as SGLang reads it (dflash_config first, then the top level, else 16); its type checked already."""
    b = dflash.get("block_size", raw.get("block_size"))
    return 16 if b is None else int(b)


def effective_config(cfg: DrafterConfig, apply_window: bool = True) -> dict[str, Any]:
    """What was evaluated, as a flat dict of plain values with stable names (logged, printed)."""
    rp = cfg.rope_parameters
    _, scaling, _ = rotary_parameters(cfg)
    sliding = [i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention"]
    out: dict[str, Any] = {
        "block_size": cfg.block_size,
        "target_layer_ids": list(cfg.target_layer_ids or []),
        "mask_token_id": cfg.mask_token_id,
        "num_target_layers": cfg.num_target_layers,
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": cfg.attention_bias,
        "rope_type": rp["rope_type"],
        "rope_theta": float(rp["rope_theta"]),
        "rope_attention_scaling": scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "sliding_layers": sliding,
        "sliding_window": cfg.sliding_window,
        "sliding_window_applied": bool(sliding) and apply_window,
        "causal_layers": [
            i for i, t in enumerate(cfg.layer_types) if cfg.layer_causal(t) and (apply_window or cfg.causal)
        ],
        "logit_scale": cfg.logit_scale,
        "own_embed": cfg.own_embed,
        "own_lm_head": cfg.own_lm_head,
        "draft_vocab_size": cfg.draft_vocab_size,
    }
    out.update({f"rope_{k}": v for k, v in sorted(rp.items()) if k not in ("rope_type", "rope_theta")})
    if cfg.dflash2 is not None:
        out.update(
            {
                "architecture": "DFlash2DraftModel",
                **{f"dflash2_{k}": v for k, v in asdict(cfg.dflash2).items() if v is not None},
            }
        )
    if cfg.dspark is not None:
        out.update(
            {
                "architecture": cfg.dspark.architecture,
                "dspark_rows": cfg.block_size,
                **{f"dspark_{k}": v for k, v in asdict(cfg.dspark).items() if v is not None and k != "architecture"},
            }
        )
    return out
