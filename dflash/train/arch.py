"""The drafter the trainer builds: its taps, its DrafterConfig, its initial weights.

The one place where the trainer meets dflash.models.drafter.model's config and tap rule (`DrafterConfig` through
`checkpoint.init_config`, `build_target_layer_ids`), so a change there is a change here only.
`drafter.arch=dflash2` adds DFlash2's block convolutions and candidate selector (sizes `drafter.conv_*`,
`drafter.selector_*`, checked by the evaluator's own DFlash2 parser), started as SpecForge starts them:
identity convolutions and a zero successor codebook, so the untrained additions change nothing.
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
    return c


def init_drafter(dcfg: DrafterConfig, target: Any, seed: int, device: torch.device) -> DFlashDrafter:
    """Seeded random weights; the output norm starts at the target's final norm (its lm_head's scale)."""
    model = DFlashDrafter(dcfg).init_weights(seed)
    tnorm = getattr(getattr(target.model, "model", None), "norm", None)
    if tnorm is not None and tuple(tnorm.weight.shape) == tuple(model.norm.weight.shape):
        with torch.no_grad():
            model.norm.weight.copy_(tnorm.weight.float().cpu())
    return model.to(device)
