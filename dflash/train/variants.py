"""Variants: which of the three training bugs of docs/family.md §4 a run has switched on.

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
A name may end in drafter-shape suffixes, each after a '-', that override `drafter.*` for that
variant only (`ARCH_SUFFIXES`): `fixed-dflash2` (drafter.arch=dflash2: the DFlash2 twin),
`fixed-dspark` (drafter.arch=dspark: the DSpark twin), `fixed-l2` (2 layers), `fixed-t5` (5 taps),
`fixed-i1536` (intermediate size), `fixed-b15` (block size: a DSpark twin's gamma), combinable
(`fixed-l4-dspark-b15`): capacity probes and twins share the data and the target pass of one run.
The bugs are DFlash's training: a DSpark variant with one is refused.
Without `variants`, one run with `bugs.*`, named `name` or after its bugs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

from dflash.config.train import BugsConfig
from dflash.util.errors import ConfigError

VARIANT_NAMES = ("fixed", "noisy_labels", "final_layer", "loss_dilution")
BUG_NAMES = tuple(f.name for f in fields(BugsConfig))
ARCH_SUFFIXES = {
    "l": "num_layers",
    "t": "num_taps",
    "i": "intermediate_size",
    "b": "block_size",
}  # -l2, -t5, -i1536, -b15
ARCHS = ("dflash2", "dspark")  # -dflash2, -dspark


@dataclass
class Variant:
    name: str
    bugs: BugsConfig
    arch: dict[str, Any] = field(default_factory=dict)  # drafter.* overrides of this variant (name suffixes)


def parse_suffix(suffix: str, name: str) -> tuple[str, Any]:
    """'dflash2' | 'dspark' | 'l2' | 't5' | 'i1536' | 'b15' -> (drafter key, value)."""
    if suffix in ARCHS:
        return "arch", suffix
    m = re.fullmatch(r"([ltib])([1-9][0-9]*)", suffix)
    if m is None:
        raise ConfigError(
            f"variants: unknown suffix -{suffix} in {name!r}; use -dflash2, -dspark, -l<layers>, -t<taps>, "
            "-i<intermediate size> or -b<block size>"
        )
    return ARCH_SUFFIXES[m.group(1)], int(m.group(2))


def parse_variant(name: str) -> Variant:
    """'fixed', a bug name, or bug names joined by '+', optionally with '-' suffixes -> Variant."""
    head, *suffixes = str(name).split("-")
    parts = [p for p in head.split("+") if p != "fixed"]
    bad = [p for p in parts if p not in VARIANT_NAMES]
    if bad:
        raise ConfigError(
            f"variants: unknown variant {name!r}; use {', '.join(VARIANT_NAMES)} (joined by '+', shape suffixes after "
            f"'-')"
        )
    return Variant(
        str(name), BugsConfig(**{p: True for p in parts}), dict(parse_suffix(s, str(name)) for s in suffixes)
    )


def resolve_variants(cfg: Any) -> list[Variant]:
    """cfg.variants (lockstep) or the single run of cfg.bugs / cfg.name; a DSpark variant with a bug refused."""
    if cfg.variants:
        out = [parse_variant(n) for n in cfg.variants]
    else:
        bugs = BugsConfig(**{k: bool(getattr(cfg.bugs, k)) for k in BUG_NAMES})
        on = [k for k in BUG_NAMES if getattr(bugs, k)]
        out = [Variant(cfg.name or ("+".join(on) if on else "fixed"), bugs)]
    for v in out:
        on = [k for k in BUG_NAMES if getattr(v.bugs, k)]
        if on and v.arch.get("arch", cfg.drafter.arch) == "dspark":
            raise ConfigError(
                f"variant {v.name!r} trains DSpark with {', '.join(on)}: the bugs are DFlash's training "
                "(docs/family.md §4), not implemented for DSpark; train DSpark without them (fixed-dspark)"
            )
    return out


def variant_layer_ids(base: list[int], num_target_layers: int, bugs: BugsConfig) -> list[int]:
    """Bug 2 feeds fc the target's final layer in place of the last tap."""
    if not bugs.final_layer:
        return list(base)
    return list(base[:-1]) + [num_target_layers - 1]
