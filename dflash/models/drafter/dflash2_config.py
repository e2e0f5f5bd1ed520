"""DFlash2's own config keys (docs/family.md §8.4), read as SGLang's `parse_dflash_draft_config` reads them.

`parse_config` (dflash/models/drafter/config.py, the one parser) calls `parse_dflash2` when
`architectures` is `["DFlash2DraftModel"]`; every key of `dflash_config` below is checked here with a
message naming it (a `CheckpointError`, exit 2):

- `selector_rank` (>= 1) and `selector_top_k` (1 .. vocab): both required, as SGLang's DFlash2DraftModel
  requires the selector. The vocabulary is the config's `vocab_size` (the codebooks' rows, SGLang's
  choice); without it the checkpoint's codebook rows, and `selector_top_k` is checked against it when
  the drafter is fitted to the target (`check_dflash2_vocab`).
- `conv_kernel_size` (1 .. block_size) and `conv_group_size` (>= 1, divides hidden_size): both or neither,
  as SGLang (neither, or 0: no convolutions, which SGLang serves; SpecForge always trains them).
- `output_multiplier`: finite and > 0 (SGLang refuses <= 0); default 1.
- `final_logit_softcapping`: > 0 applies `c·tanh(x/c)`; null or 0 is off (SGLang); < 0 is refused
  (SpecForge refuses it, SGLang silently drops it: neither is a clear meaning).
- `attention_mode`: gqa and mha are the attention implemented here (SpecForge's two names for it);
  mla is refused by name (SGLang does not serve it either).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dflash.util.errors import CheckpointError

DFLASH2_FIELDS = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
    "attention_mode",
)
ATTENTION_MODES = ("gqa", "mha")


@dataclass(frozen=True)
class DFlash2Config:
    """What DFlash2 adds to a DFlash drafter: block convolutions, unary logit transform, candidate selector."""

    selector_rank: int
    selector_top_k: int
    conv_kernel_size: int | None = None  # T taps; None: no convolutions
    conv_group_size: int | None = None  # channels per group sharing one dynamic coefficient
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None  # None: no soft-capping
    vocab_size: int | None = None  # the codebooks' rows; None until read from the checkpoint or the target
    attention_mode: str | None = None  # as read (gqa / mha), written back

    @property
    def has_conv(self) -> bool:
        return self.conv_kernel_size is not None

    def to_dflash_config(self) -> dict[str, Any]:
        """The `dflash_config` keys of this part, as SpecForge exports them."""
        d: dict[str, Any] = {"selector_rank": self.selector_rank, "selector_top_k": self.selector_top_k}
        if self.has_conv:
            d.update(conv_kernel_size=self.conv_kernel_size, conv_group_size=self.conv_group_size)
        if self.output_multiplier != 1.0:
            d["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            d["final_logit_softcapping"] = self.final_logit_softcapping
        if self.attention_mode is not None:
            d["attention_mode"] = self.attention_mode
        return d


def _bad(name: str, v: Any, want: str) -> CheckpointError:
    return CheckpointError(
        f"config field dflash_config.{name}={v!r} should be {want} (DFlash2DraftModel); fix config.json"
    )


def _int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, v, "an integer")
    return v


def _num(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(name, v, "a finite number")
    return float(v)


def parse_dflash2(dflash: dict[str, Any], hidden_size: int, block_size: int, vocab_size: Any) -> DFlash2Config:
    """`dflash_config` of a DFlash2DraftModel (+ the top-level vocab_size) -> DFlash2Config, or a CheckpointError naming
    the key."""
    g = {k: dflash.get(k) for k in DFLASH2_FIELDS}
    for k in ("selector_rank", "selector_top_k"):
        if g[k] is None:
            raise CheckpointError(
                f"DFlash2DraftModel needs dflash_config.{k} (the candidate selector, as SGLang requires); fix "
                f"config.json"
            )
    rank, top_k = _int("selector_rank", g["selector_rank"]), _int("selector_top_k", g["selector_top_k"])
    if rank < 1:
        raise _bad("selector_rank", rank, "an integer >= 1")
    vocab = None
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise CheckpointError(
                f"config field vocab_size={vocab_size!r} should be an integer >= 1 (the selector codebooks' rows)"
            )
        vocab = vocab_size
    if top_k < 1 or (vocab is not None and top_k > vocab):
        raise _bad("selector_top_k", top_k, f"an integer in 1..{vocab if vocab is not None else 'vocab_size'}")
    T, gs = (None if g[k] in (None, 0) else _int(k, g[k]) for k in ("conv_kernel_size", "conv_group_size"))
    if (T is None) != (gs is None):
        raise CheckpointError(
            f"dflash_config.conv_kernel_size={g['conv_kernel_size']!r} and conv_group_size={g['conv_group_size']!r}: "
            f"the block "
            "convolutions need both (or neither), as SGLang requires; fix config.json"
        )
    if T is not None and not 1 <= T <= block_size:
        raise _bad("conv_kernel_size", T, f"an integer in 1..block_size ({block_size})")
    if gs is not None and (gs < 1 or hidden_size % gs):
        raise _bad("conv_group_size", gs, f"a positive divisor of hidden_size ({hidden_size})")
    mult = 1.0 if g["output_multiplier"] is None else _num("output_multiplier", g["output_multiplier"])
    if mult <= 0:
        raise _bad("output_multiplier", g["output_multiplier"], "a finite number > 0 (SGLang refuses others)")
    cap = (
        None
        if g["final_logit_softcapping"] in (None, 0)
        else _num("final_logit_softcapping", g["final_logit_softcapping"])
    )
    if cap is not None and cap < 0:
        raise _bad("final_logit_softcapping", cap, "a number > 0 (or null / 0: no soft-capping)")
    mode = g["attention_mode"]
    if mode == "mla":
        raise CheckpointError(
            "dflash_config.attention_mode='mla': multi-head latent attention is not implemented here (SGLang does not "
            "serve "
            "DFlash2 MLA drafters either); evaluate a gqa or mha drafter"
        )
    if mode is not None and mode not in ATTENTION_MODES:
        raise _bad("attention_mode", mode, f"one of {list(ATTENTION_MODES)}")
    return DFlash2Config(rank, top_k, T, gs, mult, cap, vocab, mode)


def check_dflash2_vocab(d2: DFlash2Config, target_vocab: int) -> list[str]:
    """What cannot work against a target with `target_vocab` LM-head rows (error strings; empty: fits)."""
    errs = []
    if d2.vocab_size is not None and d2.vocab_size != target_vocab:
        errs.append(
            f"vocab_size {d2.vocab_size} (the selector codebooks' rows) != the target's {target_vocab}: "
            "the selector indexes its codebooks with the target's token ids"
        )
    if d2.selector_top_k > target_vocab:
        errs.append(f"dflash_config.selector_top_k {d2.selector_top_k} should be in 1..vocab ({target_vocab})")
    return errs
