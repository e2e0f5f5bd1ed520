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

DSpark (`dspark_loss`, SpecForge's and DeepSpec's objective, docs/dspark.md): rows j = 0..R-1 (every row a
proposal) weighted by exp(-j/gamma) times the cumprod validity mask; the draft logits are the base logits plus
the Markov bias teacher-forced on prev = [anchor, label_0, ...] (`teacher_forced`); the loss is
(α_ce·Σ w·CE(draft, label) + α_l1·Σ w·‖softmax(draft) − softmax(target)‖₁ + α_conf·Σ w·BCE(confidence logit,
1 − TV)) / Σ w, where 1 − TV = 1 − ½‖·‖₁ (clamped to [0, 1], detached) is the probability that rejection
sampling accepts the row's draft: the confidence head learns to predict it. `DSparkTerms` keeps the per-row
pieces the step's metrics read (tau_probabilistic = 1 + Σ_j Π_{i≤j} (1 − TV_i)).
"""

from __future__ import annotations

from dataclasses import dataclass

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


def row_weights(R: int, gamma: float, device: torch.device | None = None) -> Tensor:
    """[R]: DSpark's exp(-j/gamma) for row j (every row a proposal: row j is DFlash's slot j + 1)."""
    return torch.exp(-torch.arange(R, device=device, dtype=torch.float32) / gamma)


def markov_bias(markov: nn.Module, prev: Tensor, h: Tensor) -> Tensor:
    """The Markov head's bias teacher-forced: prev [S, N, R] token ids, h [S, N, R, H] -> [S, N, R, V] (one call
    over every row; the rnn head row by row, its state reset at each block's first row)."""
    S, N, R, H = h.shape
    if markov.kind != "rnn":
        bias, _ = markov.step(prev.reshape(-1), h.reshape(-1, H), None)
        return bias.view(S, N, R, -1)
    flat_prev, flat_h = prev.reshape(S * N, R), h.reshape(S * N, R, H)
    state, out = markov.init_state(flat_h[:, 0]), []
    for j in range(R):
        bias, state = markov.step(flat_prev[:, j], flat_h[:, j], state)
        out.append(bias)
    return torch.stack(out, 1).view(S, N, R, -1)


def teacher_forced(drafter: nn.Module, base: Tensor, h: Tensor, prev: Tensor) -> tuple[Tensor, Tensor | None]:
    """base [S, N, R, V] the base logits, h [S, N, R, H], prev [S, N, R] -> (the draft logits base + bias in float32,
    the confidence logits [S, N, R] in float32, or None without the head)."""
    logits = base.float() + markov_bias(drafter.markov_head, prev, h).float()
    head = drafter.confidence_head
    if head is None:
        return logits, None
    with torch.autocast(device_type=h.device.type, enabled=False):  # float32, as SGLang keeps the head
        e = drafter.markov_head.markov_w1(prev).float() if head.with_markov else None
        return logits, head(h.float(), e)


@dataclass
class DSparkTerms:
    """A DSpark loss's pieces: each term's weighted sum, the weights' sum, and per row what the metrics read."""

    ce: Tensor  # Σ w·CE (detached scalars)
    l1: Tensor  # Σ w·‖p_draft − p_target‖₁
    conf: Tensor | None  # Σ w·BCE, None without the confidence head
    conf_err: Tensor | None  # [S, N, R] σ(confidence logit) − (1 − TV)
    accept: Tensor  # [S, N, R] 1 − TV, clamped to [0, 1]
    w: Tensor  # [S, N, R] the rows' weights (0 where not valid)


def dspark_loss(
    logits: Tensor,
    conf: Tensor | None,
    labels: Tensor,
    valid: Tensor,
    target_logits: Tensor,
    gamma: float,
    alphas: tuple[float, float, float],
) -> tuple[Tensor, DSparkTerms]:
    """logits [S, N, R, V] (base + Markov bias), conf [S, N, R] | None, labels and valid [S, N, R], target_logits
    [S, N, R, V] (the target's at p + j), alphas (ce, l1, confidence) -> (scalar loss, its terms)."""
    S, N, R, V = logits.shape
    a_ce, a_l1, a_conf = alphas
    w = row_weights(R, gamma, logits.device)[None, None] * valid.float()  # [S, N, R]
    den = w.sum().clamp(min=1e-9)
    ce = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1).clamp(min=0), reduction="none").view(S, N, R)
    with torch.set_grad_enabled(torch.is_grad_enabled() and a_l1 > 0):  # else 1 − TV only: the confidence's target
        l1 = (logits.softmax(-1) - target_logits.float().softmax(-1)).abs().sum(-1)  # [S, N, R]
    accept = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    loss = (a_ce * (ce * w).sum() + a_l1 * (l1 * w).sum()) / den
    bce = err = None
    if conf is not None:
        bce = (F.binary_cross_entropy_with_logits(conf, accept, reduction="none") * w).sum()
        loss = loss + a_conf * bce / den
        err = torch.sigmoid(conf.detach()) - accept
    terms = DSparkTerms(
        (ce * w).sum().detach(), (l1 * w).sum().detach(), None if bce is None else bce.detach(), err, accept, w
    )
    return loss, terms
