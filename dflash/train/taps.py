"""The trainer's one entry to the target's hidden states: `target_states` calls tapped_forward.

One call per step serves every variant: it taps the union of their layers (`needed_layers`) and
each variant slices its own (`TargetStates.select`), so a lockstep run costs one target pass.
Bug 1 needs the final layer's state as well (tap `num_layers - 1`, i.e. `hidden_states[num_layers]`,
which transformers gives after the final norm); it joins the union when a noisy_labels variant
or a DSpark one (the target's distributions its loss compares with) runs, so that pass then runs the
whole depth and still skips the LM head. Nothing here needs logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import Tensor

from dflash.models.target.forward import tapped_forward


@dataclass
class TargetStates:
    """states[..., i*H:(i+1)*H] is the output of decoder layer layer_ids[i]."""

    layer_ids: list[int]
    states: Tensor  # [S, T, n*H]

    def select(self, layer_ids: list[int]) -> Tensor:
        """-> [S, T, m*H], the layers in the order given."""
        H = self.states.shape[-1] // len(self.layer_ids)
        pos = {L: i for i, L in enumerate(self.layer_ids)}
        return torch.cat([self.states[..., pos[L] * H : (pos[L] + 1) * H] for L in layer_ids], dim=-1)


def needed_layers(layer_sets: Iterable[list[int]], num_target_layers: int, final: bool) -> list[int]:
    """The union of the variants' taps, plus the final layer when bug 1's labels need it."""
    out = {L for ids in layer_sets for L in ids}
    if final:
        out.add(num_target_layers - 1)
    return sorted(out)


def target_states(target: Any, ids: Tensor, seq_lens: Tensor | None, layer_ids: list[int]) -> TargetStates:
    """ids [S, T] right-padded to seq_lens [S] (None: no padding) -> the tapped states of `layer_ids`
    at every position."""
    attn = (
        None if seq_lens is None else (torch.arange(ids.shape[1], device=ids.device)[None] < seq_lens[:, None]).long()
    )  # [S, T]
    return TargetStates(list(layer_ids), tapped_forward(target, ids, list(layer_ids), attention_mask=attn))


def final_layer_states(target: Any, ids: Tensor, seq_lens: Tensor | None = None) -> Tensor:
    """The final layer's state (tap num_layers - 1) at every position -> [S, T, H]."""
    return target_states(target, ids, seq_lens, [target.num_layers - 1]).states
