"""The drafter's LM head without its full logits: exact top-1, top-k and scores over chunks of the vocabulary.

    z = scale · (h @ W.T + b) [+ bias(rows)]     # [R, V']: never held whole; W's rows are read a chunk at a time

`Head` is what a drafter drafts from (`head_of`: the target's LM head or the drafter's own, times `logit_scale`;
a reduced draft vocabulary's rows carry their target ids, i + d2t[i]). `select(head, h, k)` returns the top k of
every row of z in the canonical order, and with `ref` what the replay's scores read (NLL of the reference token,
top-1 probability), holding at most `budget` bytes of logits at a time (`chunk_cols`).

The canonical order is (value descending, target id ascending): the first maximal id wins, as `torch.argmax`
and `torch.max(dim)` break ties (documented). `torch.topk`'s order among equal values is unspecified and differs
between devices (and from argmax: its first index on tied maxima need not be argmax's), so no chunked algorithm
could reproduce it; every loop (the replay's chunked path, the full-logit `canonical_topk`, the online loop)
selects in this order instead. It equals `torch.topk` wherever a row's k+1 largest values are distinct.

The chunked top k, exact (docs/how-it-works.md, "The drafter's LM head"):
- per chunk, `torch.topk` of k + EXTRA values (exact values; tied ids in any order). If the k-th value's tie run
  ends before the last of them, every id of value >= the k-th is among them, so the chunk's canonical top k is;
  otherwise (rare) that row's chunk is ranked by keys (a host check per chunk; under CUDA-graph capture, where no
  check can run, every chunk is ranked by keys).
- the candidates of all chunks ranked once by int64 keys `(signed magnitude of the float32 bits) << 32 | (2^32 - 1
  - id)`: unique per row, so `torch.topk` over keys has one answer, the canonical one; values decode bit for bit
  (-0.0 as +0.0, equal as floats). The top k of a union of per-chunk top k's is the union's top k.
- top-1 without a reduced vocabulary: each chunk's `max(-1)` (its first maximal id), then `argmax` over the chunks'
  maxima (the first chunk holding the row's max): no keys, no check.
- scores: per chunk the log-sum-exp, the max and the reference's score of score(z) in float32; the log-sum-exp
  over chunks equals the full row's to rounding, the other two bit for bit.
The chunk products are the BLAS's: a chunk of W's rows need not give the bits of the same columns of the full
product (CPU float32 at several threads; any row count change). Selection is exact given the logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LOW = (1 << 32) - 1  # a key's id field holds LOW - id: the lower id ranks first among equal values
MAG = 0x7FFFFFFF  # a float32's bits without its sign
EXTRA = 8  # candidates kept per chunk beyond k: a tie run at the k-th value up to this long needs no fallback
HEAD_BYTES = 1 << 28  # logits held at once (float32 bytes): a chunk's [R, C]
MIN_COLS = 1024  # the narrowest chunk (many rows): a chunk is still a large product

Score = Callable[[Tensor], Tensor]  # elementwise, [R, C] -> float32 [R, C] (monotone non-decreasing)


@dataclass(frozen=True)
class Head:
    """h [R, H] -> draft logits z [R, V'] = scale · (h @ W.T + b) over W's V' rows, row i at target id ids[i]."""

    whole: Callable[[Tensor], Tensor]  # h -> h @ W.T + b in one call (the module itself)
    weight: (
        Tensor | None
    )  # [V', H] W, read `chunk_cols` rows at a time; None: only `whole` (a head given as a function)
    bias: Tensor | None = None  # [V']
    scale: float = 1.0  # the drafter's logit_scale
    ids: Tensor | None = None  # [V'] the target id of row i (a reduced draft vocabulary: i + d2t[i]); None: i
    vocab: int | None = None  # the target's vocabulary (with `ids`: where the scattered logits would land)

    def chunks(self, h: Tensor, cols: int) -> Iterator[tuple[int, Tensor]]:
        """h [R, H] -> (lo, z[:, lo:lo+C]) over W's rows, C = cols: one call of `whole` where a chunk covers W."""
        V = None if self.weight is None else self.weight.shape[0]
        for lo in range(0, V or 1, cols):
            if V is None or (lo == 0 and cols >= V):
                z = self.whole(h)
            else:
                w, b = self.weight[lo : lo + cols], None if self.bias is None else self.bias[lo : lo + cols]
                z = F.linear(h, w, b)  # [R, C]
            if self.scale != 1.0:
                z = z * self.scale
            yield lo, z


def head_of(drafter: nn.Module, target_head: Callable[[Tensor], Tensor], linear: nn.Linear | None = None) -> Head:
    """The head `DFlashDrafter.logits` computes whole: the drafter's own `lm_head` when it has one, else the target's
    (`target_head`, computed in chunks of `linear`'s weight when given or when it is an nn.Linear itself), times
    `logit_scale`; a reduced draft vocabulary's rows at their target ids (d2t)."""
    own = getattr(drafter, "lm_head", None)
    lin = own if own is not None else linear if linear is not None else target_head
    d2t, cfg = getattr(drafter, "d2t", None), drafter.cfg
    ids = None if d2t is None else d2t + torch.arange(d2t.shape[0], device=d2t.device)
    return Head(
        whole=own if own is not None else target_head,
        weight=lin.weight if isinstance(lin, nn.Linear) else None,
        bias=lin.bias if isinstance(lin, nn.Linear) else None,
        scale=cfg.logit_scale,
        ids=ids,
        vocab=cfg.vocab_size if ids is not None else None,
    )


# --- the order ----------------------------------------------------------------------------------


def keys_of(values: Tensor, ids: Tensor) -> Tensor:
    """values [..., N] (any float dtype), ids [..., N] or [N] -> int64 keys: larger = earlier in (value desc, id asc).
    The float32 bits as a signed magnitude (-0.0 ranks as +0.0) in the high half, LOW - id in the low half; every
    NaN as the positive quiet one, above +inf (torch.topk and torch.argmax rank NaN first)."""
    x = values.float()
    b = torch.where(x.isnan(), float("nan"), x).view(torch.int32)
    m = (b & MAG).long()
    return (torch.where(b < 0, -m, m) << 32) | (LOW - ids)


def from_keys(keys: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """int64 keys [...] -> (values [...] in dtype, bit-exact; ids [...])."""
    s = keys >> 32  # arithmetic shift: the signed magnitude
    b = torch.where(s < 0, (-s) | (MAG + 1), s).int()  # MAG + 1: the sign bit (-0.0 comes back as +0.0)
    return b.view(torch.float32).to(dtype), LOW - (keys & LOW)


def canonical_topk(z: Tensor, k: int, ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Full logits z [..., V] -> their top k [..., k] in the canonical order (values in z's dtype, ids: `ids[j]`
    for column j, default j). Sync-free: keys over the whole row, one topk."""
    ids = torch.arange(z.shape[-1], device=z.device) if ids is None else ids
    return from_keys(keys_of(z, ids).topk(k, -1).values, z.dtype)


# --- selection over chunks ------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadOut:
    """What the replay and the online loop read of one LM-head pass over R slot states."""

    values: Tensor  # [R, k] the top k logits (z's dtype), canonical order: column 0 is the argmax
    ids: Tensor  # [R, k] their target ids
    lse: Tensor | None = None  # [R] float32 log-sum-exp of score(z) (with ref)
    ref_score: Tensor | None = None  # [R] score(z) at the reference token (-inf outside a reduced vocabulary)
    top_score: Tensor | None = None  # [R] max of score(z)

    @property
    def nll(self) -> Tensor:  # -log p(reference token)
        return self.lse - self.ref_score

    @property
    def conf(self) -> Tensor:  # the top-1 probability
        return (self.top_score - self.lse).exp()


def chunk_cols(rows: int, budget: int = HEAD_BYTES) -> int:
    """W's rows per chunk for R rows of h: about `budget` bytes of float32 logits, at least MIN_COLS."""
    return max(MIN_COLS, budget // (4 * max(rows, 1)))


def _capturing(z: Tensor) -> bool:
    return z.is_cuda and torch.cuda.is_current_stream_capturing()


def _by_keys(z: Tensor, ids: Tensor, k: int) -> tuple[Tensor, Tensor]:
    return from_keys(keys_of(z, ids).topk(k, -1).values, z.dtype)


def chunk_candidates(z: Tensor, ids: Tensor, k: int, extra: int = EXTRA) -> tuple[Tensor, Tensor]:
    """z [R, C] (column j: target id ids[j]) -> (values, ids) [R, min(k + extra, C)] holding the chunk's canonical
    top min(k, C): torch.topk's values are exact; where the k-th value's tie run reaches the last candidate, topk may
    have dropped a lower id of that value, and the row's chunk is ranked by keys instead."""
    C = z.shape[-1]
    kk = min(k + extra, C)
    if _capturing(z):  # no host check can run: every row by keys
        return _by_keys(z, ids, kk)
    v, j = z.topk(kk, -1)  # [R, kk]
    i = ids[j]
    if kk < C:
        cut = (v[:, kk - 1] == v[:, min(k, C) - 1]) | v[:, kk - 1].isnan()  # [R]
        if bool(cut.any()):
            r = cut.nonzero()[:, 0]
            cv, ci = _by_keys(z[r], ids, kk)
            v, i = v.index_put((r,), cv), i.index_put((r,), ci)
    return v, i


def select(
    head: Head,
    h: Tensor,
    k: int,
    ref: Tensor | None = None,
    score: Score | None = None,
    budget: int = HEAD_BYTES,
) -> HeadOut:
    """h [R, H] slot states -> the canonical top k of z = head(h) per row, in chunks of `budget` bytes.
    With ref [R] (target ids), also the log-sum-exp, the reference's score and the top score of score(z) in float32
    (score: elementwise; None: z.float()). k = 1 for the argmax (DFlash), selector_top_k for DFlash2's candidates."""
    rows = None if ref is None else ref.to(h.device) if head.ids is None else _rows_of(head, ref.to(h.device))
    ids = None if head.ids is None else head.ids.to(h.device)
    return top_of_chunks(head.chunks(h, chunk_cols(h.shape[0], budget)), k, ids, rows, score)


def top_of_chunks(
    chunks: Iterable[tuple[int, Tensor]],
    k: int,
    ids: Tensor | None = None,
    ref_rows: Tensor | None = None,
    score: Score | None = None,
) -> HeadOut:
    """(lo, z [R, C]) chunks covering W's rows in order (row j: target id ids[j], default j) -> `select`'s HeadOut,
    with ref_rows [R] the reference's row per row of z (-1: none; its score is then -inf)."""
    sc = (lambda x: x.float()) if score is None else score
    fast1 = k == 1 and ids is None  # each chunk's max: its first maximal id
    vals, cand, lses, tops, r = [], [], [], [], None
    for lo, z in chunks:
        R, C = z.shape
        if fast1:
            v, j = z.max(-1)
            vals.append(v[:, None])
            cand.append((j + lo)[:, None])
        else:
            v, i = chunk_candidates(
                z, torch.arange(lo, lo + C, device=z.device) if ids is None else ids[lo : lo + C], k
            )
            vals.append(v)
            cand.append(i)
        if ref_rows is not None:
            y = sc(z)  # [R, C] float32
            lses.append(y.logsumexp(-1))
            tops.append(y.max(-1).values)
            got = y.gather(-1, (ref_rows - lo).clamp(0, C - 1)[:, None])[:, 0]
            r = torch.where((ref_rows >= lo) & (ref_rows < lo + C), got, float("-inf") if r is None else r)
    v, i = torch.cat(vals, -1), torch.cat(cand, -1)  # [R, candidates]
    if fast1:
        j = v.argmax(-1, keepdim=True)  # the first chunk holding the row's max
        v, i = v.gather(-1, j), i.gather(-1, j)
    else:
        assert v.shape[-1] >= k, f"k={k} exceeds the head's {v.shape[-1]} rows"
        v, i = from_keys(keys_of(v, i).topk(k, -1).values, v.dtype)
    if ref_rows is None:
        return HeadOut(v, i)
    lse = lses[0] if len(lses) == 1 else torch.stack(lses, -1).logsumexp(-1)
    top = tops[0] if len(tops) == 1 else torch.stack(tops, -1).max(-1).values
    return HeadOut(v, i, lse, r, top)


def _rows_of(head: Head, ref: Tensor) -> Tensor:
    """Target ids [R] -> their rows of a reduced vocabulary's W (-1 where an id has none)."""
    assert head.ids is not None and head.vocab is not None
    inv = torch.full((max(head.vocab, int(head.ids.numel())),), -1, dtype=torch.long, device=ref.device)
    inv[head.ids.to(ref.device)] = torch.arange(head.ids.numel(), device=ref.device)
    return inv[ref.clamp(0, inv.numel() - 1)]
