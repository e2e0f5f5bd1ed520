"""The exact offline replay of DFlash's greedy draft-verify loop (DFLASH.md §2), in two modes.

Under greedy decoding the output equals the reference, and the drafter's proposal for an anchor
at position p depends only on (p, the token at p, the taps of positions < p): all fixed by the
reference. So the loop is index walking over proposals (`verify` is its one rule):

    pos = P                          # first anchor: the token the prefill produced
    while pos < T - 1:               # T = len(prompt + reference)
        a = longest prefix of proposal[pos] equal to reference[pos+1 : pos+B]
        commit = min(a + 1, T - 1 - pos)      # accepted + bonus, capped where the reference ends
        pos += commit

`ReplayOptions.anchors` says which proposals are drafted (both give the same walk, counter for counter):
- `all`: one batched drafter pass over *every* anchor position (`draft_anchors`), so every proposal the
  loop could see exists, and teacher-forced accuracy comes from the same drafts.
- `visited` (`replay_visited`): only the anchors the loop visits (one in τ), drafted in
  lockstep over a group of prompts, with the LM head only over the slots the walk reads.
Teacher-forced accuracy (slot k right whatever the earlier slots) counts every `tf_stride`-th anchor
(P, P+s, ...): all of them at stride 1; a systematic sample, unbiased for the per-slot accuracy and
with its SE over prompts, at stride s > 1. With `scores` also the drafter's NLL of each reference token
and its top-1 probability there (a log-sum-exp over the vocabulary at every slot, ~30% more on CPU).

The drafter's context keys and values depend on the taps alone (`DFlashDrafter.context_kv`): they are
computed once per sequence (`ReplaySeq`) and every block reads a prefix. No cache is rolled back here:
the features come from one forward over prompt + reference, so a hybrid target's Gated DeltaNet state
(Qwen3.5 / 3.6) only ever advances over committed tokens; the online loop (online/speculative.py) is
what must roll it back after a cut block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.models.drafter import DFlashDrafter
from dflash.models.target import Target
from dflash.stages.metrics import Counters, count_step
from dflash.util.errors import NumericsError

ANCHOR_MODES = ("all", "visited")
CTX_ROUND = 64  # context lengths of a drafter pass rounded up to this: attention kernels see a few shapes, not one per step
KV = list[tuple[Tensor, Tensor]]  # per drafter layer: context keys, values [S, Hkv, T, D]


@dataclass(frozen=True)
class ReplayOptions:
    anchors: str = "all"  # ANCHOR_MODES: which anchors are drafted
    tf_stride: int = 1  # teacher-forced statistics at every tf_stride-th anchor
    chunk: int = 32  # anchors per drafter pass (all), prompts per lockstep pass (visited)
    backend: str = "sdpa"
    scores: bool = False  # NLL of the reference token and top-1 probability at the teacher-forced anchors
    see_anchor: bool = False  # the leak probe: a block also sees its anchor's own feature


@dataclass
class Block:
    anchor_pos: int
    proposal: list[int]  # drafted slots 1..B-1 (`visited`: up to the slots the walk read)
    accepted: int


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


@torch.no_grad()
def prepare(drafter: DFlashDrafter, target: Target, prompt_ids: list[int], completion_ids: list[int], taps: Tensor) -> ReplaySeq:
    """taps [T, n*H] of prompt + reference -> a ReplaySeq (the taps are not kept)."""
    dev, dt = drafter.fc.weight.device, drafter.fc.weight.dtype  # with the target's last layers
    ids = torch.tensor(prompt_ids + completion_ids, device=target.device)
    return ReplaySeq(ids, len(prompt_ids), drafter.context_kv(taps[None].to(dev, dt)))


def verify(seq: list[int], pos: int, proposal: list[int], block_size: int) -> tuple[int, int]:
    """The verify rule at the anchor `pos`: -> (accepted drafted tokens, committed tokens)."""
    labels = seq[pos + 1 : pos + block_size]
    a = 0
    while a < len(labels) and a < len(proposal) and proposal[a] == labels[a]:
        a += 1
    return a, min(a + 1, len(seq) - 1 - pos)


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
    h = drafter(None, drafter.embed(target.embed, block).to(dev, dt), anchors.to(dev), backend=backend, see_anchor=see_anchor,
                ctx_kv=[(k[:, :, :ctx_len], v[:, :, :ctx_len]) for k, v in kv])  # [S, N, B, H]
    if not bool(torch.isfinite(h).all()):
        bad = int(anchors.reshape(-1)[~torch.isfinite(h).reshape(S * N, -1).all(-1).to(anchors.device)][0])
        raise NumericsError(f"the drafter's hidden states are not finite at the anchor at position {bad} (dtype {dt}): "
                            "with float16 this is usually overflow; evaluate in bfloat16 or float32 (device.dtype=...)")
    return h[:, :, 1:].to(target.dtype)


@torch.no_grad()
def draft_anchors(drafter: DFlashDrafter, target: Target, s: ReplaySeq, anchors: Tensor, opt: ReplayOptions
                  ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Greedy proposals at the given anchors (sorted positions, [A]), opt.chunk per drafter pass ->
    proposals [A, B-1]; with opt.scores also nll [A, B-1] (-log p of the reference token at slot k;
    slots past the end hold the last token's) and conf [A, B-1] (the top-1 probability), else None."""
    B, T = drafter.cfg.block_size, s.T
    k = torch.arange(1, B, device=s.ids.device)
    props, nlls, confs = [], [], []
    for a in anchors.split(opt.chunk) if len(anchors) else ():  # no anchor: a 1-token reference (EOS first)
        N = a.shape[0]
        h = drafter_hidden(drafter, target, s.ids[a][None], a[None], s.kv, opt.backend, opt.see_anchor)
        logits = drafter.logits(target.lm_head, h.reshape(N * (B - 1), -1))  # [N*(B-1), V]; 2-D: a 3-D strided input takes a slow bmm path
        if not opt.scores:
            props.append(logits.argmax(-1).view(N, B - 1))
            continue
        logits = logits.float()
        lse = logits.logsumexp(-1)  # [N*(B-1)]: log p = logit - lse, no second [.., V] tensor
        ref = s.ids[(a[:, None] + k).clamp(max=T - 1)].reshape(-1, 1).to(logits.device)  # [N*(B-1), 1]
        top = logits.max(-1)
        props.append(top.indices.view(N, B - 1))
        confs.append((top.values - lse).exp().view(N, B - 1))
        nlls.append((lse - logits.gather(-1, ref)[:, 0]).view(N, B - 1))
    if not props:
        empty = torch.empty((0, B - 1), device=target.device)
        return empty.long(), (empty if opt.scores else None), (empty if opt.scores else None)
    return torch.cat(props), (torch.cat(nlls) if opt.scores else None), (torch.cat(confs) if opt.scores else None)


def replay(seq: list[int], first_anchor: int, proposals: list[list[int]], block_size: int) -> tuple[Counters, list[Block]]:
    """Walk the draft-verify loop over precomputed proposals (row i: the anchor first_anchor + i)."""
    c = Counters(block_size=block_size, prompts=1, new_tokens=1)
    blocks, pos = [], first_anchor
    while pos < len(seq) - 1:
        prop = proposals[pos - first_anchor]
        a, commit = verify(seq, pos, prop, block_size)
        count_step(c, a, commit)
        blocks.append(Block(pos, list(prop), a))
        pos += commit
    return c, blocks


def teacher_forced(
    seq: list[int] | Tensor, first_anchor: int, proposals: list[list[int]] | Tensor, c: Counters,
    nll: list[list[float]] | Tensor | None = None, conf: list[list[float]] | Tensor | None = None, stride: int = 1,
) -> None:
    """Add slot-k accuracy over the anchors of `proposals` (row i: the anchor first_anchor + i*stride) to c,
    and with `nll`/`conf` (draft_anchors') the reference token's NLL and the top-1 probability.
    One masked comparison over all anchors, on the proposals' device."""
    props = torch.as_tensor(proposals, dtype=torch.long)
    K = c.block_size - 1
    if props.numel() == 0:
        return
    props = props.reshape(-1, K)  # [A, K]
    s = torch.as_tensor(seq, dtype=torch.long, device=props.device)
    T, dev = s.shape[0], props.device
    pos = first_anchor + stride * torch.arange(props.shape[0], device=dev)[:, None] + torch.arange(1, K + 1, device=dev)  # [A, K]
    valid = pos < T  # slot k has a label
    hit = (props == s[pos.clamp(max=T - 1)]) & valid

    def add(acc: list, v: Tensor) -> list:  # counters stay plain Python numbers
        return [a + b for a, b in zip(acc, v.tolist())]

    c.tf_total, c.tf_correct = add(c.tf_total, valid.sum(0)), add(c.tf_correct, hit.sum(0))
    if nll is not None and conf is not None:
        for name, x in (("tf_nll", nll), ("tf_conf", conf)):
            x = torch.as_tensor(x, dtype=torch.float64, device=dev).reshape(-1, K)
            setattr(c, name, add(getattr(c, name), torch.where(valid, x, 0.0).sum(0)))


def replay_all(drafter: DFlashDrafter, target: Target, s: ReplaySeq, opt: ReplayOptions) -> tuple[Counters, list[Block]]:
    """The `all` mode on one sequence: draft every anchor, walk, teacher-forced at the stride."""
    props, nll, conf = draft_anchors(drafter, target, s, torch.arange(s.first, s.T - 1, device=s.ids.device), opt)
    seq = s.ids.tolist()
    c, blocks = replay(seq, s.first, props.tolist(), drafter.cfg.block_size)
    st = opt.tf_stride
    teacher_forced(seq, s.first, props[::st], c, None if nll is None else nll[::st], None if conf is None else conf[::st], stride=st)
    return c, blocks


HEAD_GROUPS = (1, 2, 4, 8)  # LM-head slot groups of the visited mode: slots 1, 2-3, 4-7, 8-15


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
        g = drafter.logits(target.lm_head, h[rows, lo:hi].reshape(-1, H)).argmax(-1).view(len(rows), hi - lo)  # [R, hi-lo]
        out[rows, lo:hi], length[rows] = g, hi
        go = (g == labels[rows, lo:hi]).all(-1) & (labels[rows, hi] >= 0 if hi < K else False)
        alive[rows] = go
        lo = hi
    return [o[:n].tolist() for o, n in zip(out, length.tolist())]


def _padded(seqs: list[ReplaySeq]) -> KV:
    """The sequences' context K/V stacked, zero-padded to the longest: [S, Hkv, Tmax, D] per layer
    (padding is never visible: a block sees positions below its anchor)."""
    Tmax = max(s.T for s in seqs)
    out = []
    for layer in range(len(seqs[0].kv)):
        pair = [x.new_zeros((len(seqs), x.shape[1], Tmax, x.shape[3])) for x in seqs[0].kv[layer]]
        for i, s in enumerate(seqs):
            k, v = s.kv[layer]
            pair[0][i, :, : s.T], pair[1][i, :, : s.T] = k[0], v[0]
        out.append((pair[0], pair[1]))
    return out


@torch.no_grad()
def replay_visited(drafter: DFlashDrafter, target: Target, seqs: list[ReplaySeq], opt: ReplayOptions) -> list[tuple[Counters, list[Block]]]:
    """The `visited` mode over a group of prompts: the teacher-forced anchors (stride) drafted per sequence,
    then the loop walked in lockstep: each pass drafts the current anchor of every prompt whose anchor is
    not among those (opt.chunk prompts per pass), with `lazy_greedy`'s LM head."""
    B, dev = drafter.cfg.block_size, seqs[0].ids.device
    outs, known = [], []  # per prompt: (counters, blocks); {anchor: full proposal}
    for s in seqs:
        c = Counters(block_size=B, prompts=1, new_tokens=1)
        tf = torch.arange(s.first, s.T - 1, opt.tf_stride, device=dev)
        props, nll, conf = draft_anchors(drafter, target, s, tf, opt)
        teacher_forced(s.ids, s.first, props, c, nll, conf, stride=opt.tf_stride)
        known.append(dict(zip(tf.tolist(), props.tolist())))
        outs.append((c, []))
    kv, ids, pos = _padded(seqs), [s.ids.tolist() for s in seqs], [s.first for s in seqs]
    ext = torch.full((len(seqs), max(s.T for s in seqs) + B), -1, dtype=torch.long, device=dev)  # [S, Tmax+B]: -1 past each end
    for i, s in enumerate(seqs):
        ext[i, : s.T] = s.ids
    while active := [i for i, s in enumerate(seqs) if pos[i] < s.T - 1]:
        todo, drafted = [i for i in active if pos[i] not in known[i]], {}
        for part in (todo[j : j + opt.chunk] for j in range(0, len(todo), opt.chunk)):
            idx, anc = torch.tensor(part, device=dev), torch.tensor([pos[i] for i in part], device=dev)  # [R]
            L = int(anc.max()) + int(opt.see_anchor)
            L = min(kv[0][0].shape[2], -(-L // CTX_ROUND) * CTX_ROUND)  # as drafter_hidden rounds it: few shapes
            rows = kv if len(part) == len(seqs) else [(k[:, :, :L].index_select(0, idx), v[:, :, :L].index_select(0, idx)) for k, v in kv]
            h = drafter_hidden(drafter, target, ext[idx, anc][:, None], anc[:, None], rows, opt.backend, opt.see_anchor)[:, 0]
            labels = ext[idx[:, None], anc[:, None] + torch.arange(1, B, device=dev)]  # [R, B-1]
            drafted.update(zip(part, lazy_greedy(drafter, target, h, labels)))
        for i in active:
            prop = known[i][pos[i]] if pos[i] in known[i] else drafted[i]
            a, commit = verify(ids[i], pos[i], prop, B)
            count_step(outs[i][0], a, commit)
            outs[i][1].append(Block(pos[i], prop, a))
            pos[i] += commit
    return outs


def replay_group(drafter: DFlashDrafter, target: Target, seqs: list[ReplaySeq], opt: ReplayOptions) -> list[tuple[Counters, list[Block]]]:
    """Replay a group of prompts in opt.anchors' mode -> per prompt (counters, blocks); the same walk in both."""
    if opt.anchors not in ANCHOR_MODES:
        raise ValueError(f"replay anchors={opt.anchors!r}: use one of {ANCHOR_MODES}")
    if opt.anchors == "all":
        return [replay_all(drafter, target, s, opt) for s in seqs]
    return replay_visited(drafter, target, seqs, opt)
