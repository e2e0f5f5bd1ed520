"""The drafter the trainer builds: its taps, its DrafterConfig, its initial weights.

The one place where the trainer meets dflash.models.drafter's config and tap rule (`DrafterConfig` through
`checkpoint.init_config`, `build_target_layer_ids`), so a change there is a change here only.
Taps, in order of precedence: `drafter.target_layer_ids`; the target's `default_taps` when their
count is `drafter.num_taps`; the public spread for `drafter.num_taps` taps.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash.models.checkpoint import init_config
from dflash.models.drafter import DFlashDrafter, DrafterConfig, build_target_layer_ids
from dflash.util.errors import ConfigError


def base_layer_ids(cfg: Any, num_target_layers: int) -> list[int]:
    """The taps of a drafter without bug 2."""
    d, default = cfg.drafter, getattr(cfg.target, "default_taps", None)
    if d.target_layer_ids:
        return list(d.target_layer_ids)
    if default and int(d.num_taps) == len(default):
        return list(default)
    return build_target_layer_ids(num_target_layers, int(d.num_taps))


def drafter_config(cfg: Any, target: Any, layer_ids: list[int]) -> DrafterConfig:
    """A drafter shaped like the target's layers, `drafter.*` sizes, taps `layer_ids`."""
    d = cfg.drafter
    mask = d.mask_token_id if d.mask_token_id is not None else cfg.target.mask_token_id
    if mask is None:
        raise ConfigError("drafter.mask_token_id (or target.mask_token_id) must be set: a token id the target's embedding has")
    c = init_config(target, int(d.num_layers), len(layer_ids), int(mask), int(d.block_size), layer_ids)
    if d.intermediate_size:
        c.intermediate_size = int(d.intermediate_size)
    return c


def init_drafter(dcfg: DrafterConfig, target: Any, seed: int, device: torch.device) -> DFlashDrafter:
    """Seeded random weights; the output norm starts at the target's final norm (its lm_head's scale)."""
    model = DFlashDrafter(dcfg).init_weights(seed)
    tnorm = getattr(getattr(target.model, "model", None), "norm", None)
    if tnorm is not None and tuple(tnorm.weight.shape) == tuple(model.norm.weight.shape):
        with torch.no_grad():
            model.norm.weight.copy_(tnorm.weight.float().cpu())
    return model.to(device)
