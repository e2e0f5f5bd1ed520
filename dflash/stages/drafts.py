"""The drafter's side of the offline replay (dflash/stages/replay.py walks the loop over what this drafts).

- `prepare`: a prompt + reference's context K/V, once per sequence (`Sequence`); every block reads a prefix.
- `drafter_hidden`: one drafter pass over one block per row (context lengths rounded to CTX_ROUND).
- `draft_anchors`: the proposals at given anchors (`Drafts`), opt.chunk per pass, through
  dflash.models.dflash2's proposal rule: the argmax for DFlash; for DFlash2 the selector's walk, beside
  the unary argmax and the unary top-k from the same pass (no second replay), and with `scores` the
  NLL of the reference token and the top-1 probability (of the transformed unary logits for DFlash2).
- `lazy_proposals` (the visited mode): the LM head only on the slot groups of HEAD_GROUPS that a walk
  still reads, per row: a group runs while the drafted prefix (or, for DFlash2, the unary prefix, whose
  own walk the replay also follows) equals the reference. The DFlash2 walk in a group starts from the
  token it chose before the group, so its proposals equal the full walk's on every slot it computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.models.dflash2 import propose_logits, transform, unary_candidates, walk
from dflash.models.drafter import DFlashDrafter
from dflash.models.target import Target
from dflash.util.errors import NumericsError

CTX_ROUND = 64  # context lengths of a drafter pass rounded up to this: attention kernels see a few shapes, not one per step
KV = list[tuple[Tensor, Tensor]]  # per drafter layer: context keys, values [S, Hkv, T, D]
HEAD_GROUPS = (1, 2, 4, 8)  # LM-head slot groups of the visited mode: slots 1, 2-3, 4-7, 8-15


@dataclass(frozen=True)
class ReplayOptions:
    anchors: str = "all"  # ANCHOR_MODES: which anchors are drafted
    tf_stride: int = 1  # teacher-forced statistics at every tf_stride-th anchor
    chunk: int = 32  # anchors per drafter pass (all), prompts per lockstep pass (visited)
    backend: str = "sdpa"
    scores: bool = False  # NLL of the reference token and top-1 probability at the teacher-forced anchors
    see_anchor: bool = False  # the leak probe: a block also sees its anchor's own feature


@dataclass
class Sequence:
    """One prompt's replay input: prompt + reference ids [T] and the drafter's context K/V of its taps."""

    ids: Tensor  # [T] on the target's device
    first: int  # P: the first anchor (the token the prefill produced)
    kv: KV  # [1, Hkv, T, D] per drafter layer

    @property
    def T(self) -> int:
        return self.ids.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for pair in self.kv for x in pair)


@dataclass(frozen=True)
class Drafts:
    """Proposals at A anchors (row i: the i-th anchor asked for)."""

    tokens: Tensor  # [A, B-1] what is drafted (the walk for DFlash2)
    unary: Tensor | None = None  # [A, B-1] DFlash2: the unary argmax
    topk: Tensor | None = None  # [A, B-1, k] DFlash2: the unary top-k ids
    nll: Tensor | None = None  # [A, B-1] with scores: -log p of the reference token (slots past the end: the last token's)
    conf: Tensor | None = None  # [A, B-1] with scores: the top-1 probability


@torch.no_grad()
def prepare(drafter: DFlashDrafter, target: Target, prompt_ids: list[int], completion_ids: list[int], taps: Tensor) -> Sequence:
    """taps [T, n*H] of prompt + reference -> a Sequence (the taps are not kept)."""
    dev, dt = drafter.fc.weight.device, drafter.fc.weight.dtype  # with the target's last layers
    ids = torch.tensor(prompt_ids + completion_ids, device=target.device)
    return Sequence(ids, len(prompt_ids), drafter.context_kv(taps[None].to(dev, dt)))


def drafter_hidden(drafter: DFlashDrafter, target: Target, tokens: Tensor, anchors: Tensor, kv: KV, backend: str,
                   see_anchor: bool) -> Tensor:
    """The drafter over one block per row: anchor tokens [S, N] at positions anchors [S, N], context kv
    (rows match S) -> the hidden states of slots 1..B-1 [S, N, B-1, H] in the target's dtype."""
    S, N = tokens.shape
    B, dev, dt = drafter.cfg.block_size, drafter.fc.weight.device, drafter.fc.weight.dtype
    block = torch.full((S, N, B), drafter.cfg.mask_token_id, dtype=torch.long, device=tokens.device)
    block[..., 0] = tokens
    ctx_len = int(anchors.max()) + int(see_anchor)  # the last anchor sees positions < p (or <= p)
    ctx_len = min(kv[0][0].shape[2], -(-ctx_len // CTX_ROUND) * CTX_ROUND)  # few distinct shapes: the mask hides keys >= p
    h = drafter(None, target.embed(block).to(dev, dt), anchors.to(dev), backend=backend, see_anchor=see_anchor,
                ctx_kv=[(k[:, :, :ctx_len], v[:, :, :ctx_len]) for k, v in kv])  # [S, N, B, H]
    if not bool(torch.isfinite(h).all()):
        bad = int(anchors.reshape(-1)[~torch.isfinite(h).reshape(S * N, -1).all(-1).to(anchors.device)][0])
        raise NumericsError(f"the drafter's hidden states are not finite at the anchor at position {bad} (dtype {dt}): "
                            "with float16 this is usually overflow; evaluate in bfloat16 or float32 (device.dtype=...)")
    return h[:, :, 1:].to(target.dtype)


def _cat(parts: list[Tensor | None]) -> Tensor | None:
    return None if not parts or parts[0] is None else torch.cat(parts)


@torch.no_grad()
def draft_anchors(drafter: DFlashDrafter, target: Target, s: Sequence, anchors: Tensor, opt: ReplayOptions) -> Drafts:
    """Proposals at the given anchors (sorted positions, [A]), opt.chunk per drafter pass (`Drafts`)."""
    B, T, d2 = drafter.cfg.block_size, s.T, drafter.cfg.dflash2
    k = torch.arange(1, B, device=s.ids.device)
    cols: dict[str, list] = {"tokens": [], "unary": [], "topk": [], "nll": [], "conf": []}
    for a in anchors.split(opt.chunk) if len(anchors) else ():  # no anchor: a 1-token reference (EOS first)
        N = a.shape[0]
        h = drafter_hidden(drafter, target, s.ids[a][None], a[None], s.kv, opt.backend, opt.see_anchor)[0]  # [N, B-1, H]
        logits = target.lm_head(h.reshape(N * (B - 1), -1))  # [N*(B-1), V]; 2-D: a 3-D strided input takes a slow bmm path
        p = propose_logits(drafter, logits.view(N, B - 1, -1), h, s.ids[a])
        cols["tokens"].append(p.tokens)
        cols["unary"].append(None if d2 is None else p.unary)
        cols["topk"].append(p.topk)
        if opt.scores:
            z = logits.float() if d2 is None else transform(logits, d2)
            lse = z.logsumexp(-1)  # [N*(B-1)]: log p = logit - lse, no second [.., V] tensor
            ref = s.ids[(a[:, None] + k).clamp(max=T - 1)].reshape(-1, 1).to(z.device)  # [N*(B-1), 1]
            cols["conf"].append((z.max(-1).values - lse).exp().view(N, B - 1))
            cols["nll"].append((lse - z.gather(-1, ref)[:, 0]).view(N, B - 1))
    if not cols["tokens"]:
        empty = torch.empty((0, B - 1), device=target.device)
        return Drafts(empty.long(), empty.long() if d2 else None, empty.long()[..., None] if d2 else None,
                      empty if opt.scores else None, empty if opt.scores else None)
    return Drafts(*(_cat(cols[n]) for n in ("tokens", "unary", "topk", "nll", "conf")))


def draft_every_anchor(drafter: DFlashDrafter, target: Target, seq: Tensor, taps: Tensor, first_anchor: int,
                       backend: str = "sdpa", anchors_per_chunk: int = 32, see_anchor: bool = False, scores: bool = False
                       ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """`draft_anchors` at every anchor first_anchor .. T-2 of seq [T] (row i for the anchor first_anchor + i)
    -> proposals, nll, conf."""
    s = Sequence(seq, first_anchor, drafter.context_kv(taps[None].to(drafter.fc.weight.device, drafter.fc.weight.dtype)))
    opt = ReplayOptions(chunk=anchors_per_chunk, backend=backend, scores=scores, see_anchor=see_anchor)
    d = draft_anchors(drafter, target, s, torch.arange(first_anchor, s.T - 1, device=seq.device), opt)
    return d.tokens, d.nll, d.conf


def lazy_greedy(target: Target, h: Tensor, labels: Tensor) -> list[list[int]]:
    """h [S, B-1, H] slot hidden states, labels [S, B-1] (the reference after each anchor, -1 past its end)
    -> per row the greedy proposal over the slots `verify` reads: the LM head runs on slot groups of
    HEAD_GROUPS, each only for the rows whose earlier slots all equal their labels."""
    S, K, H = h.shape
    out = torch.zeros((S, K), dtype=torch.long, device=h.device)
    length = torch.zeros(S, dtype=torch.long, device=h.device)  # slots computed per row
    alive, lo = torch.ones(S, dtype=torch.bool, device=h.device), 0
    for size in HEAD_GROUPS:
        rows = alive.nonzero()[:, 0]
        if lo >= K or not len(rows):
            break
        hi = min(lo + size, K)
        g = target.lm_head(h[rows, lo:hi].reshape(-1, H)).argmax(-1).view(len(rows), hi - lo)  # [R, hi-lo]
        out[rows, lo:hi], length[rows] = g, hi
        go = (g == labels[rows, lo:hi]).all(-1) & (labels[rows, hi] >= 0 if hi < K else False)
        alive[rows] = go
        lo = hi
    return [o[:n].tolist() for o, n in zip(out, length.tolist())]


def lazy_proposals(drafter: DFlashDrafter, target: Target, h: Tensor, labels: Tensor, anchors: Tensor
                   ) -> list[tuple[list[int], list[int] | None]]:
    """`lazy_greedy` for any drafter: per row (proposal, unary argmax or None) over the slots a walk reads.
    DFlash2: a group runs for the rows whose walk prefix or unary prefix still equals the labels."""
    d2 = drafter.cfg.dflash2
    if d2 is None:
        return [(p, None) for p in lazy_greedy(target, h, labels)]
    sel, (S, K, H) = drafter.candidate_selector, h.shape
    out, uni = (torch.zeros((S, K), dtype=torch.long, device=h.device) for _ in range(2))
    length = torch.zeros(S, dtype=torch.long, device=h.device)
    walk_ok = torch.ones(S, dtype=torch.bool, device=h.device)
    uni_ok, lo = walk_ok.clone(), 0
    for size in HEAD_GROUPS:
        rows = (walk_ok | uni_ok).nonzero()[:, 0]
        if lo >= K or not len(rows):
            break
        hi = min(lo + size, K)
        logits = target.lm_head(h[rows, lo:hi].reshape(-1, H)).view(len(rows), hi - lo, -1)
        c = unary_candidates(sel, d2, logits, h[rows, lo:hi])
        prev = anchors[rows] if lo == 0 else out[rows, lo - 1]
        w, u = walk(sel, c, prev), c.ids[..., 0]  # [R, hi-lo]
        out[rows, lo:hi], uni[rows, lo:hi], length[rows] = w, u, hi
        lab, more = labels[rows, lo:hi], (labels[rows, hi] >= 0 if hi < K else torch.zeros_like(rows, dtype=torch.bool))
        walk_ok[rows] = walk_ok[rows] & (w == lab).all(-1) & more
        uni_ok[rows] = uni_ok[rows] & (u == lab).all(-1) & more
        lo = hi
    return [(o[:n].tolist(), v[:n].tolist()) for o, v, n in zip(out, uni, length.tolist())]
