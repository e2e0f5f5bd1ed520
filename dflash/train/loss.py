"""The DFlash training loss (DFLASH.md §4) and bug 3's diluted version.

Correct: cross-entropy of slot k >= 1 weighted by exp(-(k-1)/gamma) (gamma = 7 for B = 16),
normalised by the sum of the weights over valid slots; the anchor slot, slots past the sequence end
and blocks padded in where a response is short carry no weight. Bug 3 (`dilution_bug`): the plain
mean over every slot, so the slots that decide τ get a fraction of the gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def position_weights(B: int, gamma: float, device: torch.device | None = None) -> Tensor:
    """[B]: 0 for the anchor slot, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(B, device=device, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


def dflash_loss(logits: Tensor, labels: Tensor, slot_valid: Tensor, gamma: float, dilution_bug: bool = False) -> Tensor:
    """logits [S, N, B, V], labels [S, N, B], slot_valid [S, N, B] -> scalar.

    Correct: sum_k w_k * CE over valid slots / sum of w_k over valid slots.
    Bug 3 (`dilution_bug`): mean CE over every slot (anchor slot, invalid slots, padded blocks)."""
    S, N, B, V = logits.shape
    ce = F.cross_entropy(logits.reshape(-1, V).float(), labels.reshape(-1).clamp(min=0), reduction="none").view(S, N, B)
    if dilution_bug:
        return ce.mean()
    w = position_weights(B, gamma, logits.device)[None, None] * slot_valid.float()  # [S, N, B]
    return (ce * w).sum() / w.sum().clamp(min=1e-9)
