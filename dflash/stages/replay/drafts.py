"""The drafter's side of the offline replay (dflash/stages/replay/loop.py walks the loop over what this drafts).

- `prepare`: a prompt + reference's context K/V, once per sequence (`ReplaySeq`); every block reads a prefix.
- `drafter_hidden`: one drafter pass over one block per row (context lengths rounded to CTX_ROUND).
- `draft_many` (`draft_anchors` for one sequence): the proposals at given anchors (`Drafts`), opt.chunk
  anchors per drafter pass, whole sequences packed into one pass while they fit (a pass launches the same
  kernels for one row or many: on a GPU a pass's cost is mostly its launches); through
  dflash.models.drafter.dflash2's proposal rule: the argmax for DFlash; for DFlash2 the selector's walk, beside
  the unary argmax and the unary top-k from the same pass (no second replay); DSpark's Markov rollout; and with
  `scores` the NLL of the reference token and the top-1 probability (of the transformed unary logits for DFlash2).
  At the anchors `full` marks (the teacher-forced ones) every slot goes through the LM head (`propose_rows`); at
  the others only the slots a walk reads (`lazy_heads`), for DFlash and DFlash2.
- `propose_rows`: one LM-head pass over the block rows both slot conventions read, the proposal rule for the
  drafter's convention and, with `ReplayOptions.other`, for the other one. For DFlash and DFlash2 the head never
  holds the full logits (dflash/models/drafter/head.py: the canonical top k over chunks of the vocabulary,
  HEAD_BYTES of logits at a time); DSpark's rollout adds its Markov bias to whole rows, so it reads them whole.
- `lazy_heads` (`lazy_proposals` as lists, for the visited mode): the LM head only on the slot groups of
  HEAD_GROUPS that a walk still reads, per row: a group runs while the drafted prefix (or, for DFlash2, the
  unary prefix, whose own walk the replay also follows) equals the reference; one head call per group over all
  the rows. The DFlash2 walk in a group starts from the token it chose before the group, so its proposals
  equal the full walk's on every slot it computes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.models.drafter.dflash2 import candidates, propose_from, propose_tops, top_k, transform, walk
from dflash.models.drafter.head import HEAD_BYTES, MIN_COLS, Head, head_of, select
from dflash.models.drafter.model import DFlashDrafter, DrafterConfig
from dflash.models.target.model import Target
from dflash.util.errors import NumericsError

CTX_ROUND = (
    64  # context lengths of a drafter pass rounded up to this: attention kernels see a few shapes, not one per step
)
KV = list[tuple[Tensor, Tensor]]  # per drafter layer: context keys, values [S, Hkv, T, D]
HEAD_GROUPS = (1, 2, 4, 8)  # LM-head slot groups of `lazy_heads`: slots 1, 2-3, 4-7, 8-15
PASS_BYTES = (
    1 << 27
)  # auto anchors per pass on CUDA: about this many bytes of one layer's activations (B x (hidden + intermediate))


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
    drafter: DFlashDrafter,
    target: Target,
    tokens: Tensor,
    anchors: Tensor,
    kv: KV,
    backend: str,
    see_anchor: bool,
    ctx_len: int | None = None,
    check: bool = True,
) -> Tensor:
    """The drafter over one block per row: anchor tokens [S, N] at positions anchors [S, N], context kv
    (rows match S) -> the final states of every block row [S, N, B, H] in the target's dtype (B = the drafter's rows:
    rows offset.. are its proposals, the other convention's start one row earlier or later). ctx_len: the context
    read (default: past the last anchor, rounded up to CTX_ROUND: a host read of the anchors); check: refuse
    non-finite states now (False: the caller checks later, `refuse_non_finite`)."""
    S, N = tokens.shape
    B, dev, dt = drafter.cfg.block_size, drafter.fc.weight.device, drafter.fc.weight.dtype
    block = torch.full((S, N, B), drafter.cfg.mask_token_id, dtype=torch.long, device=tokens.device)
    block[..., 0] = tokens
    if ctx_len is None:
        ctx_len = int(anchors.max()) + int(see_anchor)  # the last anchor sees positions < p (or <= p)
    ctx_len = min(kv[0][0].shape[2], -(-ctx_len // CTX_ROUND) * CTX_ROUND)  # few shapes: the mask hides keys >= p
    h = drafter(
        None,
        drafter.embed(target.embed, block).to(dev, dt),
        anchors.to(dev),
        backend=backend,
        see_anchor=see_anchor,
        ctx_kv=[(k[:, :, :ctx_len], v[:, :, :ctx_len]) for k, v in kv],
    )  # [S, N, B, H]
    if check:
        refuse_non_finite(anchors, finite_rows(h), dt)
    return h.to(target.dtype)


def finite_rows(h: Tensor) -> Tensor:
    """[S, N, B, H] -> bool [S, N]: the blocks whose every state is finite."""
    return torch.isfinite(h).flatten(2).all(-1)


def refuse_non_finite(anchors: Tensor, ok: Tensor, dtype: torch.dtype) -> None:
    """anchors and ok (`finite_rows`) of the same shape: a NumericsError naming the first anchor whose drafter states
    are not finite (one host read)."""
    if not bool(ok.all()):
        bad = int(anchors.reshape(-1)[~ok.reshape(-1).to(anchors.device)][0])
        raise NumericsError(
            f"the drafter's hidden states are not finite at the anchor at position {bad} (dtype {dtype}): "
            "with float16 this is usually overflow; evaluate in bfloat16 or float32 (device.dtype=...)"
        )


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


def drafter_head(drafter: DFlashDrafter, target: Target) -> Head:
    """The head the drafter drafts from (head.head_of): the target's LM head, read in chunks of its weight."""
    return head_of(drafter, target.lm_head, target.model.get_output_embeddings())


def propose_rows(
    drafter: DFlashDrafter, target: Target, h: Tensor, anchor_tok: Tensor, ref: Tensor | None, opt: ReplayOptions
) -> dict[str, Tensor | None]:
    """Block states h [R, B, H] (every row) -> the proposal columns of `Drafts`, every slot through the LM head (ref
    [R, K]: the reference after each anchor, with scores); with opt.other also the other convention's, from the same
    head pass over the rows both read."""
    R, B, H = h.shape
    cfg, d2 = drafter.cfg, drafter.cfg.dflash2
    off, alt = cfg.offset, other_offset(cfg)
    lo = min(off, alt) if opt.other else off  # the LM head over rows lo.. covers both conventions
    starts = (off - lo, alt - lo) if opt.other else (off - lo,)
    x = h[:, lo:].reshape(-1, H)  # 2-D into the head: a 3-D strided input takes a slow bmm path
    out: dict[str, Tensor | None] = dict.fromkeys(FIELDS)
    scored = opt.scores and ref is not None
    if cfg.dspark is not None:  # the Markov rollout biases whole rows: the full logits
        logits = drafter.logits(target.lm_head, x).view(R, B - lo, -1)
        p, *q = propose_from(drafter, logits, h[:, lo:], anchor_tok, starts)
        if scored:
            z = logits[:, off - lo :].reshape(R * cfg.proposals, -1)
            z = z.float() if d2 is None else transform(z, d2)
            lse = z.logsumexp(-1)  # [R*K]: log p = logit - lse, no second [.., V] tensor
            out["conf"] = (z.max(-1).values - lse).exp().view(R, -1)
            out["nll"] = (lse - z.gather(-1, ref.reshape(-1, 1).to(z.device))[:, 0]).view(R, -1)
    else:
        rows = None
        if scored:  # the reference on the proposal rows; -1 (no score read) on a row only the other convention reads
            rows = torch.cat([ref.new_full((R, off - lo), -1), ref.reshape(R, -1)], 1).reshape(-1)
        score = None if d2 is None else (lambda z: transform(z, d2))
        o = select(drafter_head(drafter, target), x, top_k(drafter), rows, score, budget=HEAD_BYTES)
        k = o.ids.shape[-1]
        p, *q = propose_tops(
            drafter, o.values.view(R, B - lo, k), o.ids.view(R, B - lo, k), h[:, lo:], anchor_tok, starts
        )  # one unary pass for both conventions
        if scored:
            out["nll"], out["conf"] = o.nll.view(R, -1)[:, off - lo :], o.conf.view(R, -1)[:, off - lo :]
    out.update(tokens=p.tokens, topk=p.topk, accept_p=p.accept_p)
    if d2 is not None or cfg.dspark is not None:
        out["unary"] = p.unary
    if q:
        out["other"] = q[0].tokens
    return out


def reference_after(ids: Tensor, anchors: Tensor, K: int) -> tuple[Tensor, Tensor]:
    """A sequence's ids [T], anchors [A] -> (the reference after each anchor [A, K], -1 past the sequence's end; the
    same with its last token there: the scores' reference)."""
    T = ids.shape[0]
    at = anchors[:, None] + torch.arange(1, K + 1, device=anchors.device)  # [A, K]
    ref = ids[at.clamp(max=T - 1)]
    return torch.where(at < T, ref, -1), ref


@torch.no_grad()
def draft_many(
    drafter: DFlashDrafter,
    target: Target,
    seqs: list[ReplaySeq],
    anchors: list[Tensor],
    opt: ReplayOptions,
    full: list[Tensor] | None = None,
) -> list[Drafts]:
    """Proposals at the given anchors of each sequence (sorted positions [A_i]) -> `Drafts` per sequence. `full`
    (bool [A_i] per sequence; default all): the anchors whose every slot goes through the LM head (the teacher-forced
    ones: top-k, scores); at the others (DFlash, DFlash2) only the slots a walk reads (`lazy_heads`: -1 in `tokens`,
    `unary` and `other` past them, -1 / NaN in `topk`, `nll`, `conf`)."""
    cfg = drafter.cfg
    B, K, K2 = cfg.block_size, cfg.proposals, cfg.block_size - other_offset(cfg)
    if cfg.dspark is not None:  # its rollout, thresholds and confidence read every slot
        full = None
    elem = 4 if opt.scores else target.dtype.itemsize  # DSpark's whole logits (float32 for the scores)
    per_call = max(  # anchors per LM-head call: DSpark's whole logits, else the chunked head's narrowest chunk
        1, HEAD_BYTES // (B * (target.vocab_size * elem if cfg.dspark else 4 * MIN_COLS))
    )
    cols: list[dict[str, list]] = [{n: [] for n in FIELDS} for _ in seqs]
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
        lab = [reference_after(seqs[i].ids, a, max(K, K2)) for (i, _, _), a in zip(spans, anc)]
        labels, ref = torch.stack([x for x, _ in lab])[real], torch.stack([r for _, r in lab])[real]  # [R, max(K, K2)]
        h, anc_tok = h[real.to(h.device)], tok[real]  # [R, B, H], [R]
        every = None if full is None else torch.cat([full[i][lo:e] for i, lo, e in spans])  # [R]
        out = _head_rows(drafter, target, h, anc_tok, labels, ref[:, :K], every, per_call, opt)
        sizes = n.tolist()
        for name in FIELDS:
            if out[name] is not None:
                for (i, _, _), x in zip(spans, out[name].split(sizes)):
                    cols[i][name].append(x)
    return [Drafts(*(_cat(c[n]) for n in FIELDS)) if c["tokens"] else no_drafts(cfg, opt, target.device) for c in cols]


def _head_rows(
    drafter: DFlashDrafter,
    target: Target,
    h: Tensor,
    anc_tok: Tensor,
    labels: Tensor,
    ref: Tensor,
    every: Tensor | None,
    per_call: int,
    opt: ReplayOptions,
) -> dict[str, Tensor | None]:
    """One pass's LM head: `propose_rows` (every slot) on the rows of `every` (all when None), in calls of per_call
    anchors; `lazy_heads` on the others (labels [R, max(K, K')]: the reference after each anchor, -1 past the end)."""

    def full_rows(x: Tensor, t: Tensor, r: Tensor) -> dict[str, Tensor | None]:
        parts = [
            propose_rows(drafter, target, x[i : i + per_call], t[i : i + per_call], r[i : i + per_call], opt)
            for i in range(0, x.shape[0], per_call)
        ]
        return {n: None if parts[0][n] is None else torch.cat([q[n] for q in parts]) for n in FIELDS}

    if every is None or bool(every.all()):
        return full_rows(h, anc_tok, ref)
    cfg, head, dev = drafter.cfg, drafter_head(drafter, target), labels.device
    R, K, K2, off, alt = (
        labels.shape[0],
        cfg.proposals,
        cfg.block_size - other_offset(cfg),
        cfg.offset,
        other_offset(cfg),
    )
    f, lz = every.nonzero()[:, 0], (~every).nonzero()[:, 0]  # one sync per pass
    hl = h[lz.to(h.device)]
    tok, uni, _ = lazy_heads(drafter, head, hl[:, off:], labels[lz, :K], anc_tok[lz])  # on labels' device
    nan = torch.full((R, K), float("nan"), device=dev)  # scores only where every slot went through the head
    d2 = cfg.dflash2 is not None
    out: dict[str, Tensor | None] = dict.fromkeys(FIELDS)
    out.update(
        tokens=labels.new_full((R, K), -1).index_put((lz,), tok),
        unary=labels.new_full((R, K), -1).index_put((lz,), uni) if uni is not None else None,
        topk=labels.new_full((R, K, top_k(drafter)), -1) if d2 else None,
        nll=nan if opt.scores else None,
        conf=nan.clone() if opt.scores else None,
    )
    if opt.other:
        o2, _, _ = lazy_heads(drafter, head, hl[:, alt:], labels[lz, :K2], anc_tok[lz], unary=False)
        out["other"] = labels.new_full((R, K2), -1).index_put((lz,), o2)
    if len(f):
        for n, x in full_rows(h[f.to(h.device)], anc_tok[f], ref[f]).items():
            if x is not None:
                out[n] = out[n].to(x.dtype).index_put((f,), x.to(dev))
    return out


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


def lazy_heads(
    drafter: DFlashDrafter, head: Head, h: Tensor, labels: Tensor, anchors: Tensor, unary: bool = True
) -> tuple[Tensor, Tensor | None, Tensor]:
    """h [S, K, H] the proposal slots' states, labels [S, K] (the reference after each anchor, -1 past its end),
    anchors [S] (the anchor tokens) -> the proposal over the slots a walk reads [S, K] (-1 past them), the unary
    argmax likewise (DFlash2 with `unary`; else None), and the slots computed per row [S]. The LM head runs on the
    slot groups of HEAD_GROUPS, each only for the rows whose earlier slots all equal their labels (DFlash2: the
    walk's or, with `unary`, the unary argmax's, both walks being followed); one head call per group over all the
    rows. A DFlash2 walk in a group starts from the token it chose before the group, so it equals the full walk on
    every slot it computes. Not for DSpark (its rollout: `propose_rows`)."""
    d2 = drafter.cfg.dflash2
    S, K, H = h.shape
    dev = labels.device
    out = torch.full((S, K), -1, dtype=torch.long, device=dev)
    uni = None if d2 is None or not unary else out.clone()
    length = torch.zeros(S, dtype=torch.long, device=dev)
    walk_ok = torch.ones(S, dtype=torch.bool, device=dev)
    uni_ok, lo = (walk_ok.clone() if uni is not None else torch.zeros_like(walk_ok)), 0
    for size in HEAD_GROUPS:
        rows = (walk_ok | uni_ok).nonzero()[:, 0]
        if lo >= K or not len(rows):
            break
        hi = min(lo + size, K)
        x = h[rows.to(h.device), lo:hi]  # [R, hi-lo, H]
        o = select(head, x.reshape(-1, H), top_k(drafter), budget=HEAD_BYTES)
        v, ids = o.values.view(len(rows), hi - lo, -1), o.ids.view(len(rows), hi - lo, -1).to(dev)
        lab = labels[rows, lo:hi]
        more = labels[rows, hi] >= 0 if hi < K else torch.zeros_like(rows, dtype=torch.bool)
        if d2 is None:
            w = ids[..., 0]
        else:
            c = candidates(drafter.candidate_selector, d2, v, ids, x)
            w = walk(drafter.candidate_selector, c, anchors[rows] if lo == 0 else out[rows, lo - 1])
            if uni is not None:
                u = ids[..., 0]
                uni[rows, lo:hi] = u
                uni_ok[rows] = uni_ok[rows] & (u == lab).all(-1) & more
        out[rows, lo:hi], length[rows] = w, hi
        walk_ok[rows] = walk_ok[rows] & (w == lab).all(-1) & more
        lo = hi
    return out, uni, length


def lazy_greedy(drafter: DFlashDrafter, target: Target, h: Tensor, labels: Tensor) -> list[list[int]]:
    """`lazy_heads` of a DFlash drafter as lists: per row the greedy proposal over the slots `verify` reads."""
    return [p for p, _ in lazy_proposals(drafter, target, h, labels, labels[:, 0])]


def lazy_proposals(
    drafter: DFlashDrafter, target: Target, h: Tensor, labels: Tensor, anchors: Tensor, unary: bool = True
) -> list[tuple[list[int], list[int] | None]]:
    """`lazy_heads` for DFlash and DFlash2 as lists (one host copy): per row (proposal, unary argmax or None) over
    the slots a walk reads."""
    out, uni, length = lazy_heads(drafter, drafter_head(drafter, target), h, labels, anchors, unary)
    both = torch.cat([out, length[:, None]] + ([] if uni is None else [uni]), 1).tolist()  # [S, K + 1 (+ K)]
    K = out.shape[1]
    return [(r[: r[K]], None if uni is None else r[K + 1 : K + 1 + r[K]]) for r in both]
