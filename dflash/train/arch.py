"""The drafter the trainer builds: its taps, its DrafterConfig, its initial weights.

The one place where the trainer meets dflash.models.drafter.model's config and tap rule (`DrafterConfig` through
`checkpoint.init_config`, `build_target_layer_ids`), so a change there is a change here only.
`drafter.arch=dflash2` adds DFlash2's block convolutions and candidate selector (sizes `drafter.conv_*`,
`drafter.selector_*`, checked by the evaluator's own DFlash2 parser), started as SpecForge starts them:
identity convolutions and a zero successor codebook, so the untrained additions change nothing.
`drafter.arch=dspark` builds the DSpark drafter SpecForge and DeepSpec train (docs/dspark.md): the anchor
convention (`sample_from_anchor: true`), gamma = `drafter.block_size` rows `[anchor, mask, ...]`, row j
proposing the token at anchor + j + 1; a Markov head (`drafter.markov_rank`, `drafter.markov_head_type`),
started with a zero markov_w2 so that the untrained head changes nothing; the confidence head when
`drafter.confidence_head`; DFlash2's block convolutions when `drafter.conv_kernel_size` > 0 (SGLang builds
them for DSpark, right where rows = gamma = the model's block size, which is how they are exported). Its
config is checked by the evaluator's own DSpark parser, on the config.json the export will write.
Taps, in order of precedence: `drafter.target_layer_ids`; the target's `default_taps` when their
count is `drafter.num_taps`; the public spread for `drafter.num_taps` taps.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch

from dflash.models.drafter.checkpoint import init_config
from dflash.models.drafter.dflash2_config import parse_dflash2
from dflash.models.drafter.dspark_config import parse_dspark
from dflash.models.drafter.model import DFlashDrafter, DrafterConfig, build_target_layer_ids
from dflash.util.errors import CheckpointError, ConfigError


def with_overrides(d: Any, overrides: dict[str, Any]) -> Any:
    """cfg.drafter with a variant's shape overrides (variants.ARCH_SUFFIXES) as a plain namespace.
    A variant that changes the taps' count drops an explicit `target_layer_ids`."""
    if not overrides:
        return d
    fields = {k: getattr(d, k) for k in (d.keys() if hasattr(d, "keys") else vars(d))}
    if "num_taps" in overrides:
        fields["target_layer_ids"] = None
    return SimpleNamespace(**{**fields, **overrides})


def base_layer_ids(cfg: Any, num_target_layers: int, overrides: dict[str, Any] | None = None) -> list[int]:
    """The taps of a drafter without bug 2."""
    d, default = with_overrides(cfg.drafter, overrides or {}), getattr(cfg.target, "default_taps", None)
    if d.target_layer_ids:
        return list(d.target_layer_ids)
    if default and int(d.num_taps) == len(default):
        return list(default)
    return build_target_layer_ids(num_target_layers, int(d.num_taps))


def drafter_config(
    cfg: Any, target: Any, layer_ids: list[int], overrides: dict[str, Any] | None = None
) -> DrafterConfig:
    """A drafter shaped like the target's layers, `drafter.*` sizes (a variant's `overrides` first), taps
    `layer_ids`."""
    d = with_overrides(cfg.drafter, overrides or {})
    mask = d.mask_token_id if d.mask_token_id is not None else cfg.target.mask_token_id
    if mask is None:
        raise ConfigError(
            "drafter.mask_token_id (or target.mask_token_id) must be set: a token id the target's embedding has"
        )
    c = init_config(target, int(d.num_layers), len(layer_ids), int(mask), int(d.block_size), layer_ids)
    if d.intermediate_size:
        c.intermediate_size = int(d.intermediate_size)
    if getattr(d, "arch", "dflash") == "dflash2":
        keys = {
            k: int(getattr(d, k)) for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        }
        try:
            d2 = parse_dflash2(keys, c.hidden_size, c.block_size, int(target.vocab_size))
        except CheckpointError as e:
            raise ConfigError(
                str(e).replace("config field dflash_config.", "drafter.").replace("dflash_config.", "drafter.")
            ) from None
        c = dataclasses.replace(c, arch="dflash2", dflash2=d2)
    if getattr(d, "arch", "dflash") == "dspark":
        c = dspark_config(d, c, int(target.vocab_size))
    return c


DSPARK_ARCHITECTURE = "Qwen3DSparkModel"  # the name SGLang, DeepSpec and SpecForge's normalised exports use


def dspark_config(d: Any, c: DrafterConfig, vocab: int) -> DrafterConfig:
    """A DrafterConfig of the DSpark drafter the `drafter.*` keys describe, through the evaluator's DSpark parser
    (dspark_config.parse_dspark) over the keys its export writes: every head key at the top level, the anchor
    convention explicit, the convolutions' block = gamma."""
    B, T = int(d.block_size), int(d.conv_kernel_size)
    raw = {
        "block_size": B,
        "markov_rank": int(d.markov_rank),
        "markov_head_type": str(d.markov_head_type),
        "enable_confidence_head": bool(d.confidence_head),
        "confidence_head_with_markov": bool(d.confidence_with_markov),
        "sample_from_anchor": True,
        "vocab_size": vocab,
    }
    conv = {"block_size": B, "conv_kernel_size": T, "conv_group_size": int(d.conv_group_size)} if T else {}
    try:
        ds, _ = parse_dspark(raw, conv, DSPARK_ARCHITECTURE, c.hidden_size, [])
    except CheckpointError as e:
        raise ConfigError(
            str(e).replace("config field dflash_config.", "drafter.").replace("dflash_config.", "drafter.")
        ) from None
    return dataclasses.replace(c, arch="dspark", dspark=ds, block_size=ds.rows)


def init_drafter(dcfg: DrafterConfig, target: Any, seed: int, device: torch.device) -> DFlashDrafter:
    """Seeded random weights; the output norm starts at the target's final norm (its lm_head's scale); DSpark's
    markov_w2 at zero (the head adds nothing until trained)."""
    model = DFlashDrafter(dcfg).init_weights(seed)
    if dcfg.dspark is not None:
        with torch.no_grad():
            model.markov_head.markov_w2.weight.zero_()
    tnorm = getattr(getattr(target.model, "model", None), "norm", None)
    if tnorm is not None and tuple(tnorm.weight.shape) == tuple(model.norm.weight.shape):
        with torch.no_grad():
            model.norm.weight.copy_(tnorm.weight.float().cpu())
    return model.to(device)
