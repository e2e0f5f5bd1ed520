"""The DFlash training loss (docs/family.md §4) and bug 3's diluted version; DFlash2's selector loss (§8).

Correct: cross-entropy of slot k >= 1 weighted by exp(-(k-1)/gamma) (gamma = 7 for B = 16),
normalised by the sum of the weights over valid slots; the anchor slot, slots past the sequence end
and blocks padded in where a response is short carry no weight. Bug 3 (`dilution_bug`): the plain
mean over every slot, so the slots that decide τ get a fraction of the gradient.

DFlash2 (`selector_loss`, SpecForge's objective): the DFlash loss on the transformed unary logits, plus
alpha × a categorical CE of the selector over the strict unary top-k of each slot, teacher-forced (the
predecessor is the label before the slot, the anchor at slot 1), toward the label's place among the
candidates; a slot whose label is outside the top-k carries no selector loss. Same position weights,
and the same denominator as the DFlash loss (the weights of every valid slot).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.models.drafter.dflash2 import transform


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


def selector_loss(
    drafter: nn.Module, logits: Tensor, h: Tensor, labels: Tensor, slot_valid: Tensor, gamma: float
) -> Tensor:
    """DFlash2's selector CE: logits [S, N, B, V] raw, h [S, N, B, H] the drafter's final states, labels and
    slot_valid [S, N, B] -> scalar, normalised as `dflash_loss` (add alpha times it)."""
    d2, sel = drafter.cfg.dflash2, drafter.candidate_selector
    S, N, B, V = logits.shape
    vals, cand = transform(logits[:, :, 1:], d2).topk(d2.selector_top_k, dim=-1)  # [S, N, B-1, k]
    tgt = labels[:, :, 1:].clamp(min=0)
    match = cand == tgt[..., None]
    proj = sel.hidden_projection(h[:, :, 1:].to(sel.hidden_projection.weight.dtype)).float()  # [S, N, B-1, r]
    score = vals + sel.transition(proj, labels[:, :, :-1].clamp(min=0), cand)
    ce = F.cross_entropy(
        score.reshape(-1, score.shape[-1]), match.long().argmax(-1).reshape(-1), reduction="none"
    ).view_as(tgt)
    w = position_weights(B, gamma, logits.device)[None, None] * slot_valid.float()  # [S, N, B]
    return (ce * w[:, :, 1:] * match.any(-1)).sum() / w.sum().clamp(min=1e-9)
