"""DFlash2's parts (docs/family.md §8; config: dflash/models/drafter/dflash2_config.py): block convolutions, unary
logits,
selector walk.

- `BlockConv` (`layers.{i}.attention_conv` / `.mlp_conv`): a grouped, dynamic, depthwise convolution along
  the B slots of each proposal block, causal (a slot sees itself and the T-1 slots before it; nothing
  before the block's first slot). One projection of the sublayer's normed input x (hidden -> 2·T·G, read
  as [side, tap, group], side slowest) gives per-slot coefficients δ; side 0 convolves x before the
  sublayer, side 1 its output before the residual add: y_i = Σ_t (base[side, t] + δ_i[side, t, g]) ⊙ z_{i-t}.
  It runs on the flattened [S, N·B, H] layout of dflash/models/drafter/model.py, within each block; the
  context's keys and values never pass through it (as SGLang, whose context K/V come from `fc` alone).
  Identity: base[:, 0] = 1, other taps 0, zero projection (how SpecForge starts training).
- `unary_logits`: the drafter's logits on slots 1..B-1 (`DFlashDrafter.logits`: the target's LM head unless
  it has its own, times logit_scale), top-k (k = selector_top_k) taken on the raw logits in the canonical
  order (value desc, id asc: dflash/models/drafter/head.py, which computes it in chunks of the vocabulary),
  then in float32 × output_multiplier and c·tanh(x/c) (SGLang's order: both are monotone).
- `CandidateSelector` + `walk`: from the anchor, slot by slot, candidate j of the unary top-k scores
  unary[j] + <predecessor_codebook[prev] ⊙ (hidden_projection h_p), successor_codebook[cand_j]> and
  the best one (the first in top-k order on ties: argmax) is the draft and the next slot's prev. The
  bilinear term is computed in float32 as an elementwise product summed over the rank (the same for
  any batch of rows, so the offline replay's and the online loop's walks agree bit for bit).
  A zero successor codebook walks the unary argmax (DFlash).
`propose` is the one proposal rule both loops call: the walk for DFlash2, the Markov rollout for DSpark
(dflash/models/drafter/dspark.py), the argmax for DFlash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.models.drafter.dflash2_config import DFlash2Config
from dflash.models.drafter.dspark import rollout
from dflash.models.drafter.head import canonical_topk, head_of, select


class BlockConv(nn.Module):
    def __init__(self, hidden: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size, self.groups = taps, group_size, hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))  # [side, tap, channel]
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)

    def identity_(self) -> "BlockConv":
        """The exact no-op: identity base, zero projection."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()
        return self

    def _convolve(self, z: Tensor, delta: Tensor, side: int, B: int) -> Tensor:
        """z [S, Q, H] (Q = N·B slots), delta [S, Q, T, G] -> [S, Q, H], causal within each block of B slots."""
        S, Q, H = z.shape
        G, gs = self.groups, self.group_size
        zb = z.view(S, Q // B, B, G, gs)
        db = delta.view(S, Q // B, B, self.taps, G)
        base = self.base_kernel[side].view(self.taps, G, gs)
        out = (base[0] + db[:, :, :, 0, :, None]) * zb
        for t in range(1, self.taps):
            shifted = F.pad(
                zb[:, :, : B - t], (0, 0, 0, 0, t, 0)
            )  # slot i reads z_{i-t}, 0 before the block's first slot
            out = out + (base[t] + db[:, :, :, t, :, None]) * shifted
        return out.reshape(S, Q, H)

    def prepare(self, x: Tensor, B: int) -> tuple[Tensor, Tensor]:
        """x [S, Q, H] the normed sublayer input -> (its side-0 convolution, the side-1 coefficients [S, Q, T, G])."""
        S, Q, _ = x.shape
        delta = self.kernel_projection(x).view(S, Q, 2, self.taps, self.groups)
        return self._convolve(x, delta[:, :, 0], 0, B), delta[:, :, 1]

    def finish(self, y: Tensor, delta: Tensor, B: int) -> Tensor:
        """y [S, Q, H] the sublayer's output -> its side-1 convolution."""
        return self._convolve(y, delta, 1, B)


class CandidateSelector(nn.Module):
    def __init__(self, hidden: int, vocab: int, rank: int):
        super().__init__()
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))

    def transition(self, proj: Tensor, prev: Tensor, cand: Tensor) -> Tensor:
        """proj [..., r] (float32), prev [...], cand [..., k] -> the bilinear scores [..., k] in float32."""
        ctx = self.predecessor_codebook[prev].float() * proj  # [..., r]
        return (self.successor_codebook[cand].float() * ctx.unsqueeze(-2)).sum(-1)


@dataclass(frozen=True)
class Candidates:
    """The unary view of R blocks' K = B-1 draft slots."""

    ids: Tensor  # [R, K, k] unary top-k token ids, best first
    scores: Tensor  # [R, K, k] their transformed unary logits (float32)
    proj: Tensor  # [R, K, r] hidden_projection of each slot's final state (float32)


def transform(logits: Tensor, d2: DFlash2Config) -> Tensor:
    """Raw logits -> float32, × output_multiplier, then soft-capped (SGLang's unary transform)."""
    x = logits.float()
    if d2.output_multiplier != 1.0:
        x = x * d2.output_multiplier
    if d2.final_logit_softcapping is not None:
        c = d2.final_logit_softcapping
        x = torch.tanh(x / c) * c
    return x


def candidates(selector: CandidateSelector, d2: DFlash2Config, values: Tensor, ids: Tensor, h: Tensor) -> Candidates:
    """The raw top k (values, ids [R, K, k], canonical order) and h [R, K, H] -> Candidates: the values transformed
    after selection (SGLang's order), the slots' selector projections."""
    proj = selector.hidden_projection(h.to(selector.hidden_projection.weight.dtype)).float()
    return Candidates(ids, transform(values, d2), proj)


def walk(selector: CandidateSelector, c: Candidates, prev: Tensor, lo: int = 0, hi: int | None = None) -> Tensor:
    """The greedy walk over slots lo..hi-1 (0-based: slot lo+1 of the block) given the token chosen before
    slot lo (`prev` [R]: the anchor when lo = 0) -> the drafted tokens [R, hi-lo]."""
    hi = c.ids.shape[1] if hi is None else hi
    out = []
    for p in range(lo, hi):
        score = c.scores[:, p] + selector.transition(c.proj[:, p], prev, c.ids[:, p])  # [R, k]
        prev = c.ids[:, p].gather(-1, score.argmax(-1, keepdim=True))[:, 0]
        out.append(prev)
    return torch.stack(out, 1) if out else c.ids.new_zeros((c.ids.shape[0], 0))


@dataclass(frozen=True)
class Proposal:
    """A drafter pass's proposals for R blocks."""

    tokens: Tensor  # [R, K] what is drafted: the walk (DFlash2, DSpark), the argmax (DFlash)
    unary: Tensor  # [R, K] the unary argmax (= tokens for DFlash; DSpark: the base logits' argmax, no Markov head)
    topk: Tensor | None  # [R, K, k] the unary top-k ids (DFlash2), else None
    accept_p: Tensor | None = None  # [R, K] float32: DSpark's confidence σ(logit) of each slot of the walk


def propose(drafter: nn.Module, head: Callable[[Tensor], Tensor], h: Tensor, anchor: Tensor) -> Proposal:
    """h [R, K, H] the proposal slots' final states (the target's dtype), anchor [R] -> Proposal. `head` is the
    target's LM head (an nn.Linear: computed in chunks of the vocabulary; any function: whole), which the drafter
    uses unless it has its own (times its logit_scale: head.head_of); the walk starts from the anchor. DSpark's
    rollout adds its Markov bias to the whole base row, so it reads the full logits."""
    R, K, H = h.shape
    if drafter.cfg.dspark is not None:
        return propose_logits(drafter, drafter.logits(head, h.reshape(R * K, H)).view(R, K, -1), h, anchor)
    out = select(head_of(drafter, head), h.reshape(R * K, H), top_k(drafter))  # 2-D: a 3-D input takes a slow bmm
    return propose_top(drafter, out.values.view(R, K, -1), out.ids.view(R, K, -1), h, anchor)


def top_k(drafter: nn.Module) -> int:
    """How many of the head's best ids the proposal rule reads per slot: 1 (DFlash), selector_top_k (DFlash2)."""
    d2 = drafter.cfg.dflash2
    return 1 if d2 is None else d2.selector_top_k


def propose_top(drafter: nn.Module, values: Tensor, ids: Tensor, h: Tensor, anchor: Tensor) -> Proposal:
    """`propose` from the head's canonical top k per slot (values, ids [R, K, k]: head.select)."""
    return propose_tops(drafter, values, ids, h, anchor, (0,))[0]


def propose_tops(
    drafter: nn.Module, values: Tensor, ids: Tensor, h: Tensor, anchor: Tensor, starts: tuple[int, ...]
) -> list[Proposal]:
    """`propose_top` over slots s.. for each s in `starts` (a walk from the anchor each; DFlash and DFlash2): the
    candidates (DFlash2's projection) computed once for all slots."""
    d2 = drafter.cfg.dflash2
    if d2 is None:
        return [Proposal(ids[:, s:, 0], ids[:, s:, 0], None) for s in starts]
    c, sel = candidates(drafter.candidate_selector, d2, values, ids, h), drafter.candidate_selector
    out = []
    for s in starts:
        cs = Candidates(c.ids[:, s:], c.scores[:, s:], c.proj[:, s:])
        out.append(Proposal(walk(sel, cs, anchor.to(c.ids.device)), cs.ids[..., 0], cs.ids))
    return out


def propose_logits(drafter: nn.Module, logits: Tensor, h: Tensor, anchor: Tensor) -> Proposal:
    """`propose` from the drafter's full raw logits [R, K, V] (`DFlashDrafter.logits`: target ids)."""
    return propose_from(drafter, logits, h, anchor, (0,))[0]


def propose_from(drafter: nn.Module, logits: Tensor, h: Tensor, anchor: Tensor, starts: tuple[int, ...]) -> list:
    """`propose_logits` over slots s.. of the same rows for each s in `starts` (a walk from the anchor each): the
    unary part (the canonical top k, DFlash2's projection) computed once for all rows, as it is row by row."""
    if drafter.cfg.dspark is not None:  # DSpark: the Markov walk (dflash/models/drafter/dspark.py)
        mapped = drafter.to_target if drafter.d2t is not None else None
        out = []
        for s in starts:
            tokens, conf = rollout(
                drafter.markov_head, drafter.confidence_head, logits[:, s:], h[:, s:], anchor, mapped
            )
            out.append(Proposal(tokens, logits[:, s:].argmax(-1), None, conf))
        return out
    return propose_tops(drafter, *canonical_topk(logits, top_k(drafter)), h, anchor, starts)
