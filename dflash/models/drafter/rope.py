"""Rotary embeddings of a drafter config, as transformers computes them, and where the serving engines differ.

`read_rope(hf)` checks the rope parameters of transformers' own `Qwen3Config` (what `qwen3_config` builds from
a drafter's config.json) and refuses what is not implemented; `rotary_parameters(cfg)` takes frequencies,
attention scaling and position limit from transformers' `Qwen3RotaryEmbedding`; `dynamic_rope_warning` and
`attention_scaling_warning` say where SGLang / vLLM serve another rope than transformers computes.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Protocol

from dflash.util.errors import CheckpointError


class RopeConfig(Protocol):
    """What the rope reads of a config (dflash.models.drafter.config.DrafterConfig has it all)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_parameters: dict[str, Any]


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
ROPE_KEYS = {
    "rope_type",
    "type",
    "rope_theta",
    "partial_rotary_factor",
    "factor",
    "original_max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "short_factor",
    "long_factor",
    "low_freq_factor",
    "high_freq_factor",
    "mscale",
    "mscale_all_dim",
    "truncate",
}


def qwen3_config(arch: dict[str, Any]):
    """transformers' Qwen3Config from architecture keys, as `from_pretrained` builds it."""
    from transformers import Qwen3Config

    try:
        return Qwen3Config.from_dict(copy.deepcopy(arch))
    except Exception as e:  # strict field validation, rope validation (KeyError for a missing rope key)...
        raise CheckpointError(
            f"transformers cannot read this drafter config as a Qwen3 config: {type(e).__name__}: {str(e)[:300]}"
        ) from None


def read_rope(hf) -> dict[str, Any]:
    rp = hf.rope_parameters
    if not isinstance(rp, dict) or any(isinstance(v, dict) for v in rp.values()):
        raise CheckpointError(
            f"rope parameters per layer type ({rp!r}) are not implemented for DFlash drafters; use one flat "
            f"rope_parameters dict"
        )
    rp = {k: v for k, v in rp.items() if k != "type"}
    if rp.get("rope_type") not in ROPE_TYPES:
        raise CheckpointError(
            f"rope_parameters.rope_type={rp.get('rope_type')!r} is not implemented; supported: {', '.join(ROPE_TYPES)}"
        )
    for k, v in rp.items():
        if k not in ROPE_KEYS and v is not None:
            raise CheckpointError(
                f"rope_parameters.{k}={v!r} is not a rope parameter transformers' Qwen3 reads (e.g. multimodal rope); "
                f"not implemented"
            )
    prf = rp.pop("partial_rotary_factor", None)
    if prf is not None and float(prf) != 1.0:
        raise CheckpointError(
            f"partial_rotary_factor={prf!r} is not implemented: transformers' Qwen3 rotates the whole head for the "
            f"default rope "
            "type (and fails for the scaled ones) and SGLang's DFlash drafter rotates the whole head, so neither "
            "computes what "
            "a drafter trained with a partial rotary does"
        )
    return rp


def _served_attention_scaling(cfg: RopeConfig) -> float | None:
    """The attention scaling SGLang's yarn / longrope apply (they read neither `attention_factor` nor
    `mscale` / `mscale_all_dim`); None for the other rope types, which have none."""
    rp = cfg.rope_parameters
    if rp["rope_type"] == "yarn":
        f = float(rp.get("factor") or 1.0)
        return 0.1 * math.log(f) + 1.0 if f > 1 else 1.0
    if rp["rope_type"] == "longrope":
        orig = rp.get("original_max_position_embeddings") or cfg.max_position_embeddings
        scale = cfg.max_position_embeddings / orig
        return math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
    return None


def attention_scaling_warning(cfg: RopeConfig) -> str | None:
    """transformers' yarn / longrope honour `attention_factor` (and yarn `mscale` / `mscale_all_dim`); the
    serving engines do not: say so when that changes the scaling."""
    served = _served_attention_scaling(cfg)
    if served is None:
        return None
    _, hf, _ = rotary_parameters(cfg)
    if math.isclose(hf, served, rel_tol=1e-6):
        return None
    return (
        f"rope_type {cfg.rope_parameters['rope_type']}: attention scaling {hf:.6g} as transformers computes it (from "
        f"attention_factor / mscale); SGLang and vLLM ignore those keys and apply {served:.6g}, so a served drafter "
        f"with this "
        "config does not compute what is measured here"
    )


def dynamic_rope_warning(cfg: RopeConfig) -> str:
    """transformers and the serving engines disagree on dynamic NTK rope: say which one is evaluated."""
    rp, d = cfg.rope_parameters, cfg.head_dim
    f, theta = float(rp.get("factor", 1.0)), float(rp["rope_theta"])
    served = theta * (f * f - f + 1) ** (
        d / (d - 2)
    )  # SGLang / vLLM: the base scaled for max_position_embeddings * factor
    return (
        f"rope_type dynamic (factor {f:g}): evaluated as transformers computes it, the unscaled base {theta:g} up to "
        f"max_position_embeddings={cfg.max_position_embeddings}; SGLang and vLLM serve dynamic NTK with a fixed base "
        f"{served:.6g} at every position, so a served drafter with this config does not compute what is measured here"
    )


def rotary_parameters(cfg: RopeConfig):
    """(inv_freq [D/2] float32, attention scaling, position limit or None) from transformers'
    `Qwen3RotaryEmbedding` for this config: every rope type's frequencies and yarn's / longrope's
    attention factor as transformers computes them.

    The position limit: dynamic and longrope change their frequencies with the sequence length in
    transformers' forward (from `max_position_embeddings` / `original_max_position_embeddings` on),
    statefully, so what a loop computes there depends on its history: sequences must stay within the
    limit, where transformers uses its initial frequencies. Within it, SGLang's longrope uses the
    same short factors; SGLang's (and vLLM's) dynamic rope does not: it serves a fixed base scaled
    for `max_position_embeddings * factor` at every position, which `parse_config` warns about.
    transformers 5.17's forward multiplies positions by inv_freq in a float32 matmul (TF32-rounded
    when TF32 is on) and 5.24's elementwise: `dflash.models.drafter.model.Rotary` computes the product
    elementwise from these values, identical to 5.24's forward.
    """
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    hf = qwen3_config(
        {
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_position_embeddings,
            "rope_parameters": copy.deepcopy(cfg.rope_parameters),
        }
    )
    rp = cfg.rope_parameters
    if rp["rope_type"] == "longrope":
        for k in ("short_factor", "long_factor"):
            if not isinstance(rp.get(k), list) or len(rp[k]) != cfg.head_dim // 2:
                raise CheckpointError(
                    f"rope_parameters.{k} should be a list of head_dim / 2 = {cfg.head_dim // 2} numbers"
                )
    try:
        rot = Qwen3RotaryEmbedding(hf)
    except Exception as e:
        raise CheckpointError(
            f"transformers cannot compute this rope ({rp!r}): {type(e).__name__}: {str(e)[:200]}"
        ) from None
    limit = {"dynamic": cfg.max_position_embeddings, "longrope": rp.get("original_max_position_embeddings")}.get(
        rp["rope_type"]
    )
    return rot.inv_freq.float().cpu(), float(rot.attention_scaling), limit
