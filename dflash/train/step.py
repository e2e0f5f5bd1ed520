"""One optimizer step of one variant on a shared batch, and its teacher-forced counters.

`variant_inputs` turns the step's target states and batch into what one variant trains on: its taps
(noised: augmentation touches the fc inputs only), the block `[anchor, mask, ...]` embedded by the
target, and its labels (the greedy tokens; bug 1's from noised logits). `train_step` runs the
drafter (block n sees taps at t < p_n, t <= p_n under bug 2, and its own block), the target's LM
head, the loss, clipping and AdamW. `StepStats` holds raw counters per slot; metrics.py turns sums
of them into ratios. The learning rate: linear warm-up, then cosine decay to lr * min_lr_ratio.
DSpark (`model.cfg.dspark`): its rows, labels and teacher-forced prev (labels.dspark_labels), the target's
logits at each row's label position (from the final layer's states, which the step's target pass then
includes), its loss (loss.dspark_loss) and its counters: per row (row j is slot j + 1 of the counters, so
the teacher-forced prefix gives the accepted length the greedy rollout would reach on the data), plus
DSpark's own sums (`dspark_sums`: the three terms, 1 − TV per slot, tau_probabilistic, the confidence's error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dflash.config.train import BugsConfig
from dflash.models.drafter.dflash2 import transform
from dflash.models.drafter.model import DFlashDrafter
from dflash.stages.metrics import ratio
from dflash.train.batch import Batch
from dflash.train.labels import aligned_target_logits, block_labels, bug1_labels, dspark_labels, noised
from dflash.train.loss import DSparkTerms, dflash_loss, dspark_loss, selector_loss, teacher_forced
from dflash.train.taps import TargetStates
from dflash.util.errors import ConfigError


@dataclass
class StepSettings:
    backend: str  # sdpa | eager | flex: the drafter's attention
    amp: torch.dtype | None  # autocast dtype (None: fp32)
    gamma: float
    grad_clip: float
    noise_std: float
    normed: bool  # the target's final tap is through its final norm (bug 1's logits)
    selector_alpha: float = 1.0  # DFlash2: weight of the selector's CE (optim.selector_loss_alpha)
    dspark_alphas: tuple[float, float, float] | None = None  # DSpark: optim.{ce,l1,confidence}_loss_alpha


@dataclass
class VariantInputs:
    taps: Tensor  # [S, T, n*H] fc inputs, noised
    embeds: Tensor  # [S, N, B, H] the blocks [anchor, mask, ..., mask] through the target's embedding
    labels: Tensor  # [S, N, B] what the loss trains toward (DSpark: [S, N, R], row j the token at p + j + 1)
    clean: Tensor  # [S, N, B] the target's greedy tokens at p + k
    slot_valid: Tensor  # [S, N, B]
    prev: Tensor | None = None  # DSpark [S, N, R]: the Markov head's teacher-forced input, the token at p + j
    target_logits: Tensor | None = None  # DSpark [S, N, R, V]: the target's logits at p + j


@dataclass
class StepStats:
    loss: float
    grad_norm: float | None  # before clipping; None: clipping off (optim.grad_clip=0), not computed
    hit_own: Tensor  # [K] slots right against the variant's own labels (K proposals: DFlash's slots 1..B-1)
    hit_clean: Tensor  # [B-1] ... against the greedy tokens
    count: Tensor  # [B-1] valid slots
    prefix: Tensor  # [B-1] blocks whose slots 1..k are all right (own labels)
    label_flip_rate: (
        float | None
    )  # bug 1: share of valid labels that are not the greedy token; None: not bug 1, or no valid label
    tokens: int  # labelled slots
    sums: dict[str, tuple[float, float]] | None = None  # DSpark: name -> (numerator, denominator), summed per window


def lr_at(step: int, total: int, warmup: int, base: float, min_ratio: float) -> float:
    """Linear warm-up to `base`, then cosine decay to base * min_ratio at `total` (step is 0-based)."""
    if warmup > 0 and step < warmup:
        return base * (step + 1) / warmup
    t = min(max(step - warmup, 0) / max(total - warmup, 1), 1.0)
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def resolve_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if name == "flex" and device.type != "cuda":
        raise ConfigError("optim.attention=flex needs CUDA; use sdpa or eager on CPU")
    return name


def resolve_amp(name: str, device: torch.device) -> torch.dtype | None:
    return {"auto": torch.bfloat16 if device.type == "cuda" else None, "bf16": torch.bfloat16, "none": None}[name]


def make_optimizer(model: DFlashDrafter, o: Any, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.parameters(),
        lr=float(o.lr),
        betas=(float(o.beta1), float(o.beta2)),
        weight_decay=float(o.weight_decay),
        fused=device.type == "cuda",
    )


def variant_inputs(
    target: Any,
    states: TargetStates,
    batch: Batch,
    model: DFlashDrafter,
    bugs: BugsConfig,
    s: StepSettings,
    noise_gen: torch.Generator | None,
) -> VariantInputs:
    """What one variant trains on this step (noise drawn from noise_gen: taps first, then bug 1's)."""
    B = model.cfg.block_size
    taps = noised(states.select(model.cfg.target_layer_ids), s.noise_std, noise_gen)  # augmentation: fc inputs only
    if model.cfg.dspark is not None:  # every row a proposal; bugs refused for DSpark (variants.resolve_variants)
        labels, prev, valid = dspark_labels(batch.ids, batch.seq_lens, batch.anchors, batch.block_valid, B)
        final = states.select([target.num_layers - 1])  # [S, T, H]
        tl = aligned_target_logits(target, final, batch.anchors, B, s.normed)
        block = torch.full_like(labels, model.cfg.mask_token_id)
        block[..., 0] = prev[..., 0]
        return VariantInputs(taps, target.embed(block), labels, labels, valid, prev, tl)
    clean, slot_valid = block_labels(batch.ids, batch.seq_lens, batch.anchors, batch.block_valid, B)
    labels = clean
    if bugs.noisy_labels:  # bug 1: the labels' logits come from noised hidden states
        final = states.select([target.num_layers - 1])  # [S, T, H]
        labels = bug1_labels(target, final, clean, batch.anchors, s.noise_std, noise_gen, s.normed)
    block = torch.full_like(clean, model.cfg.mask_token_id)
    block[..., 0] = clean[..., 0]
    return VariantInputs(taps, target.embed(block), labels, clean, slot_valid)


def train_step(
    model: DFlashDrafter,
    opt: torch.optim.Optimizer,
    target: Any,
    x: VariantInputs,
    anchors: Tensor,
    bugs: BugsConfig,
    s: StepSettings,
    lr: float,
) -> StepStats:
    """One optimizer step of one variant -> its counters."""
    for g in opt.param_groups:
        g["lr"] = lr
    with torch.autocast(device_type=anchors.device.type, dtype=s.amp, enabled=s.amp is not None):
        taps, emb = (x.taps.float(), x.embeds.float()) if s.amp is None else (x.taps, x.embeds)
        h = model(taps, emb, anchors, backend=s.backend, see_anchor=bugs.final_layer)  # [S, N, B, H]
        logits = target.lm_head(h.to(target.dtype) if s.amp is None else h)  # [S, N, B, V]
        d2, terms = model.cfg.dflash2, None
        if model.cfg.dspark is not None:  # the base logits plus the Markov bias, teacher-forced
            assert s.dspark_alphas is not None and x.prev is not None and x.target_logits is not None
            logits, conf = teacher_forced(model, logits, h, x.prev)
            loss, terms = dspark_loss(logits, conf, x.labels, x.slot_valid, x.target_logits, s.gamma, s.dspark_alphas)
        else:
            loss = dflash_loss(
                logits if d2 is None else transform(logits, d2),
                x.labels,
                x.slot_valid,
                s.gamma,
                dilution_bug=bugs.loss_dilution,
            )
        if d2 is not None and s.selector_alpha > 0:  # DFlash2: the selector's CE over the unary top-k beside it
            loss = loss + s.selector_alpha * selector_loss(model, logits, h, x.labels, x.slot_valid, s.gamma)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = (
        float(torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip))
        if s.grad_clip and s.grad_clip > 0
        else None
    )
    opt.step()
    stats = step_stats(logits.detach(), x, float(loss.detach()), gnorm, bugs.noisy_labels, model.cfg.offset)
    if terms is not None:
        stats.sums = dspark_sums(terms)
    return stats


@torch.no_grad()
def step_stats(
    logits: Tensor, x: VariantInputs, loss: float, grad_norm: float | None, noisy_labels: bool, first: int = 1
) -> StepStats:
    """Teacher-forced counters of one step's predictions logits [S, N, B, V] over the proposal slots first.. (DFlash:
    1.., the anchor slot proposes nothing; DSpark: 0.., every row)."""
    pred, v = logits.argmax(-1), x.slot_valid.float()  # [S, N, B]
    hit_own = ((pred == x.labels).float() * v).sum((0, 1))[first:]  # [K]
    hit_clean = ((pred == x.clean).float() * v).sum((0, 1))[first:]
    count = v.sum((0, 1))[first:]
    right = ((pred == x.labels) | ~x.slot_valid)[..., first:]
    ok = right.long().cumprod(-1).float() * v[..., first:]  # slots 1..k all right
    tokens = int(x.slot_valid.sum())
    flips = ratio(int(((x.labels != x.clean) & x.slot_valid).sum()), tokens) if noisy_labels else None
    return StepStats(loss, grad_norm, hit_own.cpu(), hit_clean.cpu(), count.cpu(), ok.sum((0, 1)).cpu(), flips, tokens)


@torch.no_grad()
def dspark_sums(t: DSparkTerms) -> dict[str, tuple[float, float]]:
    """DSpark's step sums, name -> (numerator, denominator): the loss terms (per unit of row weight), 1 − TV per
    slot k = row k-1 (`accept_p_k`, over valid rows), tau_probabilistic = 1 + Σ_j Π_{i≤j} (1 − TV_i) over blocks
    with a valid row (a row past the end counts 0, as SpecForge's), and the confidence head's mean absolute error
    and bias against 1 − TV (row-weighted)."""
    valid = t.w > 0  # [S, N, R]
    W = float(t.w.sum())
    acc = t.accept * valid
    blocks = valid.any(-1)
    out = {"ce_loss": (float(t.ce), W), "l1_loss": (float(t.l1), W)}
    per_row, n_row = acc.sum((0, 1)).tolist(), valid.sum((0, 1)).tolist()
    out.update({f"accept_p_{j + 1}": (a, n) for j, (a, n) in enumerate(zip(per_row, n_row))})
    out["tau_probabilistic"] = (float(((1.0 + acc.cumprod(-1).sum(-1)) * blocks).sum()), float(blocks.sum()))
    if t.conf is not None and t.conf_err is not None:
        out["confidence_loss"] = (float(t.conf), W)
        out["confidence_abs_error"] = (float((t.conf_err.abs() * t.w).sum()), W)
        out["confidence_bias"] = (float((t.conf_err * t.w).sum()), W)
    return out
