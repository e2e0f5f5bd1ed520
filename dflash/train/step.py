"""One optimizer step of one variant on a shared batch, and its teacher-forced counters.

`variant_inputs` turns the step's target states and batch into what one variant trains on: its taps
(noised: augmentation touches the fc inputs only), the block `[anchor, mask, ...]` embedded by the
target, and its labels (the greedy tokens; bug 1's from noised logits). `train_step` runs the
drafter (block n sees taps at t < p_n, t <= p_n under bug 2, and its own block), the target's LM
head, the loss, clipping and AdamW. `StepStats` holds raw counters per slot; metrics.py turns sums
of them into ratios. The learning rate: linear warm-up, then cosine decay to lr * min_lr_ratio.
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
from dflash.train.labels import block_labels, bug1_labels, noised
from dflash.train.loss import dflash_loss, selector_loss
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


@dataclass
class VariantInputs:
    taps: Tensor  # [S, T, n*H] fc inputs, noised
    embeds: Tensor  # [S, N, B, H] the blocks [anchor, mask, ..., mask] through the target's embedding
    labels: Tensor  # [S, N, B] what the loss trains toward
    clean: Tensor  # [S, N, B] the target's greedy tokens at p + k
    slot_valid: Tensor  # [S, N, B]


@dataclass
class StepStats:
    loss: float
    grad_norm: float | None  # before clipping; None: clipping off (optim.grad_clip=0), not computed
    hit_own: Tensor  # [B-1] slots right against the variant's own labels
    hit_clean: Tensor  # [B-1] ... against the greedy tokens
    count: Tensor  # [B-1] valid slots
    prefix: Tensor  # [B-1] blocks whose slots 1..k are all right (own labels)
    label_flip_rate: (
        float | None
    )  # bug 1: share of valid labels that are not the greedy token; None: not bug 1, or no valid label
    tokens: int  # labelled slots


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
        d2 = model.cfg.dflash2
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
    return step_stats(logits.detach(), x, float(loss.detach()), gnorm, bugs.noisy_labels)


@torch.no_grad()
def step_stats(logits: Tensor, x: VariantInputs, loss: float, grad_norm: float | None, noisy_labels: bool) -> StepStats:
    """Teacher-forced counters of one step's predictions logits [S, N, B, V]."""
    pred, v = logits.argmax(-1), x.slot_valid.float()  # [S, N, B]
    hit_own = ((pred == x.labels).float() * v).sum((0, 1))[1:]  # [B-1]
    hit_clean = ((pred == x.clean).float() * v).sum((0, 1))[1:]
    count = v.sum((0, 1))[1:]
    ok = ((pred == x.labels) | ~x.slot_valid)[..., 1:].long().cumprod(-1).float() * v[..., 1:]  # slots 1..k all right
    tokens = int(x.slot_valid.sum())
    flips = ratio(int(((x.labels != x.clean) & x.slot_valid).sum()), tokens) if noisy_labels else None
    return StepStats(loss, grad_norm, hit_own.cpu(), hit_clean.cpu(), count.cpu(), ok.sum((0, 1)).cpu(), flips, tokens)
