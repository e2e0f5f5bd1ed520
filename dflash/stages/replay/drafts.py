"""The drafter's side of the offline replay (dflash/stages/replay/loop.py walks the loop over what this drafts).

- `prepare`: a prompt + reference's context K/V, once per sequence (`ReplaySeq`); every block reads a prefix.
- `drafter_hidden`: one drafter pass over one block per row (context lengths rounded to CTX_ROUND).
- `draft_many` (`draft_anchors` for one sequence): the proposals at given anchors (`Drafts`), opt.chunk
  anchors per drafter pass, whole sequences packed into one pass while they fit (a pass launches the same
  kernels for one row or many: on a GPU a pass's cost is mostly its launches), the LM head over at most
  HEAD_BYTES of logits at a time; through dflash.models.drafter.dflash2's proposal rule: the argmax for DFlash;
  for DFlash2 the selector's walk, beside
  the unary argmax and the unary top-k from the same pass (no second replay), and with `scores` the
  NLL of the reference token and the top-1 probability (of the transformed unary logits for DFlash2).
- `propose_rows`: one LM-head pass over the block rows both slot conventions read, the proposal rule
  (`dflash2.propose_from`) for the drafter's convention and, with `ReplayOptions.other`, for the other one.
- `lazy_proposals` (the visited mode): the LM head only on the slot groups of HEAD_GROUPS that a walk
  still reads, per row: a group runs while the drafted prefix (or, for DFlash2, the unary prefix, whose
  own walk the replay also follows) equals the reference. The DFlash2 walk in a group starts from the
  token it chose before the group, so its proposals equal the full walk's on every slot it computes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.models.drafter.dflash2 import propose_from, transform, unary_candidates, walk
from dflash.models.drafter.model import DFlashDrafter, DrafterConfig
from dflash.models.target.model import Target
from dflash.util.errors import NumericsError

CTX_ROUND = (
    64  # context lengths of a drafter pass rounded up to this: attention kernels see a few shapes, not one per step
)
KV = list[tuple[Tensor, Tensor]]  # per drafter layer: context keys, values [S, Hkv, T, D]
HEAD_GROUPS = (1, 2, 4, 8)  # LM-head slot groups of the visited mode: slots 1, 2-3, 4-7, 8-15
PASS_BYTES = (
    1 << 27
)  # auto anchors per pass on CUDA: about this many bytes of one layer's activations (B x (hidden + intermediate))
HEAD_BYTES = 1 << 31  # the LM head's logits held at once (anchors x (B-1) x vocab)


def auto_chunk(cfg: DrafterConfig, device_type: str, elem: int) -> int:
    """Anchors per drafter pass (`anchors_per_chunk: null`): 32 on a CPU; on CUDA at least 256, more for a
    small drafter (PASS_BYTES), so that a pass holds several whole prompts."""
    if device_type != "cuda":
        return 32
    return max(256, PASS_BYTES // (cfg.block_size * (cfg.hidden_size + cfg.intermediate_size) * elem))


@dataclass(frozen=True)
class ReplayOptions:
    anchors: str = "all"  # ANCHOR_MODES: which anchors are drafted
    tf_stride: int = 1  # teacher-forced statistics at every tf_stride-th anchor
    chunk: int = 32  # anchors per drafter pass (all), prompts per lockstep pass (visited)
    backend: str = "sdpa"
    scores: bool = False  # NLL of the reference token and top-1 probability at the teacher-forced anchors
    see_anchor: bool = False  # the leak probe: a block also sees its anchor's own feature
    other: bool = True  # also the other slot convention's proposals (the convention check), from the same passes
    thresholds: tuple[float, ...] = ()  # DSpark with a confidence head: the walks verifying up to the first slot below


@dataclass
class ReplaySeq:
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
    """Proposals at A anchors (row i: the i-th anchor asked for); K = the drafter's proposals per step."""

    tokens: Tensor  # [A, K] what is drafted (the walk for DFlash2 and DSpark)
    unary: Tensor | None = None  # [A, K] DFlash2: the unary argmax; DSpark: the base argmax (no Markov head)
    topk: Tensor | None = None  # [A, K, k] DFlash2: the unary top-k ids
    nll: Tensor | None = None  # [A, K] with scores: -log p of the reference token (slots past the end: the last's)
    conf: Tensor | None = None  # [A, K] with scores: the top-1 probability
    accept_p: Tensor | None = None  # [A, K] DSpark's confidence head: σ(logit) of each slot of the walk (float32)
    other: Tensor | None = None  # [A, K'] with opt.other: the other slot convention's proposal (K' = K ± 1)


FIELDS = tuple(f.name for f in dataclasses.fields(Drafts))


@torch.no_grad()
def prepare(
    drafter: DFlashDrafter, target: Target, prompt_ids: list[int], completion_ids: list[int], taps: Tensor
) -> ReplaySeq:
    """taps [T, n*H] of prompt + reference -> a ReplaySeq (the taps are not kept)."""
    dev, dt = drafter.fc.weight.device, drafter.fc.weight.dtype  # with the target's last layers
    ids = torch.tensor(prompt_ids + completion_ids, device=target.device)
    return ReplaySeq(ids, len(prompt_ids), drafter.context_kv(taps[None].to(dev, dt)))


def drafter_hidden(
    drafter: DFlashDrafter, target: Target, tokens: Tensor, anchors: Tensor, kv: KV, backend: str, see_anchor: bool
) -> Tensor:
    """The drafter over one block per row: anchor tokens [S, N] at positions anchors [S, N], context kv
    (rows match S) -> the final states of every block row [S, N, B, H] in the target's dtype (B = the drafter's rows:
    rows offset.. are its proposals, the other convention's start one row earlier or later)."""
    S, N = tokens.shape
    B, dev, dt = drafter.cfg.block_size, drafter.fc.weight.device, drafter.fc.weight.dtype
    block = torch.full((S, N, B), drafter.cfg.mask_token_id, dtype=torch.long, device=tokens.device)
    block[..., 0] = tokens
    ctx_len = int(anchors.max()) + int(see_anchor)  # the last anchor sees positions < p (or <= p)
    ctx_len = min(
        kv[0][0].shape[2], -(-ctx_len // CTX_ROUND) * CTX_ROUND
    )  # few distinct shapes: the mask hides keys >= p
    h = drafter(
        None,
        drafter.embed(target.embed, block).to(dev, dt),
        anchors.to(dev),
        backend=backend,
        see_anchor=see_anchor,
        ctx_kv=[(k[:, :, :ctx_len], v[:, :, :ctx_len]) for k, v in kv],
    )  # [S, N, B, H]
    if not bool(torch.isfinite(h).all()):
        bad = int(anchors.reshape(-1)[~torch.isfinite(h).reshape(S * N, -1).all(-1).to(anchors.device)][0])
        raise NumericsError(
            f"the drafter's hidden states are not finite at the anchor at position {bad} (dtype {dt}): "
            "with float16 this is usually overflow; evaluate in bfloat16 or float32 (device.dtype=...)"
        )
    return h.to(target.dtype)


def _cat(parts: list[Tensor | None]) -> Tensor | None:
    return None if not parts or parts[0] is None else torch.cat(parts)


def padded_kv(seqs: list[ReplaySeq]) -> KV:
    """The sequences' context K/V stacked, zero-padded to the longest: [S, Hkv, Tmax, D] per layer
    (padding is never visible: a block sees positions below its anchor)."""
    if len(seqs) == 1:
        return seqs[0].kv
    Tmax = max(s.T for s in seqs)
    out = []
    for layer in range(len(seqs[0].kv)):
        pair = [x.new_zeros((len(seqs), x.shape[1], Tmax, x.shape[3])) for x in seqs[0].kv[layer]]
        for i, s in enumerate(seqs):
            k, v = s.kv[layer]
            pair[0][i, :, : s.T], pair[1][i, :, : s.T] = k[0], v[0]
        out.append((pair[0], pair[1]))
    return out


def _passes(counts: list[int], chunk: int) -> list[list[tuple[int, int, int]]]:
    """Anchors per sequence -> drafter passes of (sequence, first, end) spans: whole sequences packed while
    (sequences x the longest) stays within chunk, a sequence longer than chunk split over passes of its own."""
    out: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    for i, n in enumerate(counts):
        if n == 0:
            continue
        if cur and (n > chunk or (len(cur) + 1) * max(n, *(e for _, _, e in cur)) > chunk):
            out.append(cur)
            cur = []
        if n > chunk:
            out += [[(i, lo, min(lo + chunk, n))] for lo in range(0, n, chunk)]
        else:
            cur.append((i, 0, n))
    return out + ([cur] if cur else [])


def other_offset(cfg: DrafterConfig) -> int:
    """The first proposal row of the other slot convention (1 - cfg.offset): its K' = rows - that proposals."""
    return 1 - cfg.offset


def propose_rows(
    drafter: DFlashDrafter, target: Target, h: Tensor, anchor_tok: Tensor, ref: Tensor | None, opt: ReplayOptions
) -> dict[str, Tensor | None]:
    """Block states h [R, B, H] (every row) -> the proposal columns of `Drafts` (ref [R, K]: the reference after each
    anchor, with scores); with opt.other also the other convention's, from the same logits."""
    R, B, H = h.shape
    cfg = drafter.cfg
    off, alt = cfg.offset, other_offset(cfg)
    lo = min(off, alt) if opt.other else off  # the LM head over rows lo.. covers both conventions
    logits = drafter.logits(target.lm_head, h[:, lo:].reshape(-1, H)).view(
        R, B - lo, -1
    )  # 2-D into the head: a 3-D strided input takes a slow bmm path
    main = logits[:, off - lo :]  # [R, K, V]
    K = main.shape[1]
    starts = (off - lo, alt - lo) if opt.other else (off - lo,)
    p, *q = propose_from(drafter, logits, h[:, lo:], anchor_tok, starts)  # one unary pass for both conventions
    out: dict[str, Tensor | None] = dict.fromkeys(FIELDS)
    out.update(tokens=p.tokens, topk=p.topk, accept_p=p.accept_p)
    if cfg.dflash2 is not None or cfg.dspark is not None:
        out["unary"] = p.unary
    if q:
        out["other"] = q[0].tokens
    d2 = cfg.dflash2
    if opt.scores and ref is not None:
        logits = main.reshape(R * K, -1)
        z = logits.float() if d2 is None else transform(logits, d2)
        lse = z.logsumexp(-1)  # [R*K]: log p = logit - lse, no second [.., V] tensor
        out["conf"] = (z.max(-1).values - lse).exp().view(R, K)
        out["nll"] = (lse - z.gather(-1, ref.reshape(-1, 1).to(z.device))[:, 0]).view(R, K)
    return out


@torch.no_grad()
def draft_many(
    drafter: DFlashDrafter, target: Target, seqs: list[ReplaySeq], anchors: list[Tensor], opt: ReplayOptions
) -> list[Drafts]:
    """Proposals at the given anchors of each sequence (sorted positions [A_i]) -> `Drafts` per sequence."""
    cfg = drafter.cfg
    B, K = cfg.block_size, cfg.proposals
    k = torch.arange(1, K + 1, device=seqs[0].ids.device) if seqs else None
    cols: list[dict[str, list]] = [{n: [] for n in FIELDS} for _ in seqs]
    head_rows = max(
        1, HEAD_BYTES // (B * target.vocab_size * (4 if opt.scores else target.dtype.itemsize))
    )  # anchors per LM-head call
    for spans in _passes([len(a) for a in anchors], opt.chunk):
        N = max(e - lo for _, lo, e in spans)
        anc = torch.stack(
            [torch.cat([a, a[:1].expand(N - len(a))]) for a in (anchors[i][lo:e] for i, lo, e in spans)]
        )  # [S, N], no sync
        tok = torch.stack([seqs[i].ids[a] for (i, _, _), a in zip(spans, anc)])  # [S, N]
        h = drafter_hidden(
            drafter, target, tok, anc, padded_kv([seqs[i] for i, _, _ in spans]), opt.backend, opt.see_anchor
        )
        n = torch.tensor([e - lo for _, lo, e in spans], device=anc.device)
        real = torch.arange(N, device=anc.device)[None] < n[:, None]  # [S, N]: the padding rows repeat a first anchor
        ref = None
        if opt.scores:  # the reference after each anchor (slots past the end: the last token)
            ref = torch.stack(
                [seqs[i].ids[(a[:, None] + k).clamp(max=seqs[i].T - 1)] for (i, _, _), a in zip(spans, anc)]
            )[real]
        h, anc_tok = h[real.to(h.device)], tok[real]  # [R, B, H], [R]
        parts = [
            propose_rows(
                drafter,
                target,
                h[r : r + head_rows],
                anc_tok[r : r + head_rows],
                None if ref is None else ref[r : r + head_rows],
                opt,
            )
            for r in range(0, h.shape[0], head_rows)
        ]
        sizes = n.tolist()
        for name in cols[0]:
            if parts[0][name] is None:
                continue
            for (i, _, _), x in zip(spans, torch.cat([q[name] for q in parts]).split(sizes)):
                cols[i][name].append(x)
    return [Drafts(*(_cat(c[n]) for n in FIELDS)) if c["tokens"] else no_drafts(cfg, opt, target.device) for c in cols]


def no_drafts(cfg: DrafterConfig, opt: ReplayOptions, device: torch.device) -> Drafts:
    """The Drafts of a sequence with no anchor: every column it would have, with no row."""
    K, unary = cfg.proposals, cfg.dflash2 is not None or cfg.dspark is not None
    empty = torch.empty((0, K), device=device)
    conf = cfg.dspark is not None and cfg.dspark.confidence
    return Drafts(
        empty.long(),
        empty.long() if unary else None,
        empty.long()[..., None] if cfg.dflash2 is not None else None,
        empty if opt.scores else None,
        empty if opt.scores else None,
        empty if conf else None,
        torch.empty((0, cfg.block_size - other_offset(cfg)), device=device).long() if opt.other else None,
    )


def draft_anchors(drafter: DFlashDrafter, target: Target, s: ReplaySeq, anchors: Tensor, opt: ReplayOptions) -> Drafts:
    """`draft_many` for one sequence."""
    return draft_many(drafter, target, [s], [anchors], opt)[0]


def lazy_greedy(drafter: DFlashDrafter, target: Target, h: Tensor, labels: Tensor) -> list[list[int]]:
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
        g = (
            drafter.logits(target.lm_head, h[rows, lo:hi].reshape(-1, H)).argmax(-1).view(len(rows), hi - lo)
        )  # [R, hi-lo]
        out[rows, lo:hi], length[rows] = g, hi
        go = (g == labels[rows, lo:hi]).all(-1) & (labels[rows, hi] >= 0 if hi < K else False)
        alive[rows] = go
        lo = hi
    return [o[:n].tolist() for o, n in zip(out, length.tolist())]


def lazy_proposals(
    drafter: DFlashDrafter, target: Target, h: Tensor, labels: Tensor, anchors: Tensor
) -> list[tuple[list[int], list[int] | None]]:
    """`lazy_greedy` for any drafter: per row (proposal, unary argmax or None) over the slots a walk reads.
    DFlash2: a group runs for the rows whose walk prefix or unary prefix still equals the labels."""
    d2 = drafter.cfg.dflash2
    if d2 is None:
        return [(p, None) for p in lazy_greedy(drafter, target, h, labels)]
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
        logits = drafter.logits(target.lm_head, h[rows, lo:hi].reshape(-1, H)).view(len(rows), hi - lo, -1)
        c = unary_candidates(sel, d2, logits, h[rows, lo:hi])
        prev = anchors[rows] if lo == 0 else out[rows, lo - 1]
        w, u = walk(sel, c, prev), c.ids[..., 0]  # [R, hi-lo]
        out[rows, lo:hi], uni[rows, lo:hi], length[rows] = w, u, hi
        lab, more = labels[rows, lo:hi], (labels[rows, hi] >= 0 if hi < K else torch.zeros_like(rows, dtype=torch.bool))
        walk_ok[rows] = walk_ok[rows] & (w == lab).all(-1) & more
        uni_ok[rows] = uni_ok[rows] & (u == lab).all(-1) & more
        lo = hi
    return [(o[:n].tolist(), v[:n].tolist()) for o, v, n in zip(out, uni, length.tolist())]
