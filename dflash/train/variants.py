"""Variants: which of the three training bugs of DFLASH.md §4 a run has switched on.

Each bug reproduces its mechanism, and each acts in one place:
- `noisy_labels` (bug 1): the augmentation noise is also added to the target's final hidden state
  before the logits whose argmax gives the labels (labels.bug1_labels): corrupted labels;
- `final_layer` (bug 2): fc is fed the target's final layer in place of the last tap
  (`variant_layer_ids`) and the training mask lets a block see the feature at its anchor
  (`see_anchor`, step.train_step): at p that feature encodes token p+1, a shortcut inference
  never offers;
- `loss_dilution` (bug 3): plain mean of the cross-entropy over every slot of every block, anchor
  slot, slots past the end and padded blocks included, no position weighting (loss.dflash_loss).

`variants=[fixed,noisy_labels,...]` trains several in lockstep (same data, anchors, initial
weights, one target forward per step); names join bugs with '+' (`noisy_labels+final_layer`).
Without `variants`, one run with `bugs.*`, named `name` or after its bugs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from dflash.config.train import BugsConfig
from dflash.util.errors import ConfigError

VARIANT_NAMES = ("fixed", "noisy_labels", "final_layer", "loss_dilution")
BUG_NAMES = tuple(f.name for f in fields(BugsConfig))


@dataclass
class Variant:
    name: str
    bugs: BugsConfig


def parse_variant(name: str) -> Variant:
    """'fixed', a bug name, or bug names joined by '+' -> Variant."""
    parts = [p for p in str(name).split("+") if p != "fixed"]
    bad = [p for p in parts if p not in VARIANT_NAMES]
    if bad:
        raise ConfigError(f"variants: unknown variant {name!r}; use {', '.join(VARIANT_NAMES)} (joined by '+')")
    return Variant(str(name), BugsConfig(**{p: True for p in parts}))


def resolve_variants(cfg: Any) -> list[Variant]:
    """cfg.variants (lockstep) or the single run of cfg.bugs / cfg.name."""
    if cfg.variants:
        return [parse_variant(n) for n in cfg.variants]
    bugs = BugsConfig(**{k: bool(getattr(cfg.bugs, k)) for k in BUG_NAMES})
    on = [k for k in BUG_NAMES if getattr(bugs, k)]
    return [Variant(cfg.name or ("+".join(on) if on else "fixed"), bugs)]


def variant_layer_ids(base: list[int], num_target_layers: int, bugs: BugsConfig) -> list[int]:
    """Bug 2 feeds fc the target's final layer in place of the last tap."""
    if not bugs.final_layer:
        return list(base)
    return list(base[:-1]) + [num_target_layers - 1]
