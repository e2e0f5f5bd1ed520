"""Labels: the target's greedy tokens at anchor + k, and bug 1's labels from noised hidden states.

A correct trainer's label of slot k >= 1 is the regenerated sequence's token at p + k
(`block_labels`): the target's own greedy token there. Augmentation noise (`noised`) may touch only
the fc inputs. DSpark (`dspark_labels`, the anchor convention): row j = 0..R-1 is labelled with the token at
p + j + 1, its Markov head teacher-forced with the token at p + j (the anchor, then the labels before it),
and a row counts only where every row before it does (SpecForge's cumprod mask); `aligned_target_logits`
gives the target's logits at p + j, the distribution row j's label was drawn from.

Bug 1 (`bug1_labels`) is the one place that needs more of the target than the taps: the final
layer's state at every position of the batch (tap num_layers - 1: transformers' `hidden_states[-1]`,
after the final norm), noised like the fc inputs, then the target's LM head at p + k - 1 and argmax.
`final_tap_is_normed` checks once, with the one full forward (logits) of the trainer, whether that
tap is already through the final norm; if not, the norm is applied before the LM head.

`label_flip_stats` measures what bug 1 does to the labels at a noise level (scripts/label_noise.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dflash.train.taps import final_layer_states


def block_labels(ids: Tensor, seq_lens: Tensor, anchors: Tensor, block_valid: Tensor, B: int) -> tuple[Tensor, Tensor]:
    """ids [S, L] (padded) -> labels [S, N, B] = ids[p + k] (slot 0: the anchor itself; past the
    padded length: the last id), slot_valid [S, N, B]: k >= 1, p + k < T, block valid."""
    S, L = ids.shape
    k = torch.arange(B, device=ids.device)
    pos = anchors[..., None] + k  # [S, N, B]
    labels = torch.gather(ids, 1, pos.clamp(max=L - 1).view(S, -1)).view_as(pos)
    valid = (k >= 1) & (pos < seq_lens[:, None, None]) & block_valid[..., None]
    return labels, valid


def dspark_labels(
    ids: Tensor, seq_lens: Tensor, anchors: Tensor, block_valid: Tensor, R: int
) -> tuple[Tensor, Tensor, Tensor]:
    """ids [S, L] (padded) -> labels [S, N, R] = ids[p + j + 1], prev [S, N, R] = ids[p + j] (the Markov head's
    teacher-forced input: the anchor, then the labels before row j), valid [S, N, R]: p + j + 1 < T, the block
    valid, and every earlier row valid (cumprod along the block)."""
    S, L = ids.shape
    pos = anchors[..., None] + torch.arange(R + 1, device=ids.device)  # [S, N, R+1]: p .. p+R
    tok = torch.gather(ids, 1, pos.clamp(max=L - 1).view(S, -1)).view_as(pos)
    valid = (pos[..., 1:] < seq_lens[:, None, None]) & block_valid[..., None]
    return tok[..., 1:], tok[..., :-1], valid.long().cumprod(-1).bool()


def aligned_target_logits(target: Any, final: Tensor, anchors: Tensor, R: int, normed: bool) -> Tensor:
    """The target's logits at positions p + j, j = 0..R-1, from its final-layer states final [S, T, H] (`normed`:
    through the final norm already) -> [S, N, R, V]: row j's label distribution (no gradient)."""
    S, T, H = final.shape
    pos = (anchors[..., None] + torch.arange(R, device=anchors.device)).clamp(max=T - 1)  # [S, N, R]
    h = torch.gather(final, 1, pos.reshape(S, -1, 1).expand(-1, -1, H))  # [S, N*R, H]
    with torch.no_grad():
        return logits_from_last(target, h, normed).view(*pos.shape, -1)


def noised(x: Tensor, std: float, gen: torch.Generator | None = None) -> Tensor:
    """x + N(0, std^2) scaled by each position's RMS (std 0: x itself)."""
    if std <= 0:
        return x
    rms = x.float().pow(2).mean(-1, keepdim=True).sqrt()  # [..., 1]
    eps = (
        torch.randn(x.shape, generator=gen, device=x.device, dtype=torch.float32)
        if gen is not None
        else torch.randn_like(x, dtype=torch.float32)
    )
    return (x.float() + std * rms * eps).to(x.dtype)


def logits_from_last(target: Any, h: Tensor, normed: bool) -> Tensor:
    """The target's logits from final-layer states h [..., H] (`normed`: already through the final norm)."""
    return target.lm_head(h if normed else target.model.model.norm(h))


@torch.no_grad()
def final_tap_is_normed(target: Any) -> bool:
    """Does tap num_layers - 1 come through the final norm (lm_head of it == the logits)? Checked, not assumed."""
    from dflash.models.target.forward import forward

    ids = torch.tensor([[1, 2, 3, 4]], device=target.device)
    logits = forward(target, ids).logits  # the full forward: the only one the trainer runs
    return bool(
        torch.allclose(target.lm_head(final_layer_states(target, ids)).float(), logits.float(), atol=1e-3, rtol=1e-3)
    )


def greedy_labels_from_hidden(target: Any, last_hidden: Tensor, anchors: Tensor, B: int, normed: bool) -> Tensor:
    """Labels of slot k = argmax of the target's logits at p + k - 1 computed from `last_hidden`
    [S, L, H] (the final layer's state; `normed`: already through the final norm) -> [S, N, B] (slot 0: -1)."""
    S, L, H = last_hidden.shape
    k = torch.arange(1, B, device=anchors.device)
    pos = (anchors[..., None] + k - 1).clamp(max=L - 1)  # [S, N, B-1]
    h = torch.gather(last_hidden, 1, pos.reshape(S, -1, 1).expand(-1, -1, H))  # [S, N*(B-1), H]
    lab = logits_from_last(target, h, normed).argmax(-1).view(S, *pos.shape[1:])
    return torch.cat([torch.full_like(lab[..., :1], -1), lab], dim=-1)


def bug1_labels(
    target: Any, final: Tensor, clean: Tensor, anchors: Tensor, std: float, gen: torch.Generator | None, normed: bool
) -> Tensor:
    """Bug 1: labels from the target's logits over its final state final [S, T, H] with the
    augmentation noise added (one draw over every position) -> [S, N, B] (slot 0: the anchor, from clean)."""
    B = clean.shape[-1]
    labels = greedy_labels_from_hidden(target, noised(final, std, gen), anchors, B, normed)
    return torch.where(torch.arange(B, device=clean.device) == 0, clean, labels)


@torch.no_grad()
def response_last_hidden(target: Any, seqs: list[Any]) -> Tensor:
    """Final-layer states at every position whose next token is a response token of seqs
    (dflash.train.data.TrainSeq) -> [N, H]."""
    return torch.cat(
        [
            final_layer_states(target, torch.tensor([s.ids], device=target.device))[0, s.prompt_len - 1 : -1]
            for s in seqs
        ]
    )


@dataclass
class LabelFlipStats:
    flip_rate: float  # share of noisy greedy labels that differ from the clean ones (training's label_flip_rate)
    majority_flip_rate: float  # share of positions whose most frequent noisy label is not the clean one
    majority_flip_rate_confident: float  # the same where the target's top-1 probability is > 0.5
    confident_share: float  # share of positions where it is


@torch.no_grad()
def label_flip_stats(
    target: Any, last_hidden: Tensor, std: float, normed: bool, draws: int = 32, gen: torch.Generator | None = None
) -> LabelFlipStats:
    """What bug 1 does to the labels at noise `std`, over positions last_hidden [N, H] (final layer),
    `draws` noise draws each. Where the majority label flips, a drafter trained on these labels
    learns another token than the target's; the confident positions are those it can get right."""
    logits = logits_from_last(target, last_hidden, normed).float()  # [N, V]
    clean, confident = logits.argmax(-1), logits.softmax(-1).amax(-1) > 0.5  # [N]
    noisy = torch.stack(
        [logits_from_last(target, noised(last_hidden, std, gen), normed).argmax(-1) for _ in range(draws)]
    )  # [draws, N]
    majority = noisy.mode(0).values != clean  # [N]
    return LabelFlipStats(
        flip_rate=float((noisy != clean).float().mean()),
        majority_flip_rate=float(majority.float().mean()),
        majority_flip_rate_confident=float(majority[confident].float().mean())
        if bool(confident.any())
        else float("nan"),
        confident_share=float(confident.float().mean()),
    )
