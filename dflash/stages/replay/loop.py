"""The exact offline replay of DFlash's greedy draft-verify loop (docs/family.md §2), in two modes.

Under greedy decoding the output equals the reference, and the drafter's proposal for an anchor
at position p depends only on (p, the token at p, the taps of positions < p): all fixed by the
reference. So the loop is index walking over proposals (`verify` is its one rule):

    pos = P                          # first anchor: the token the prefill produced
    while pos < T - 1:               # T = len(prompt + reference)
        a = longest prefix of proposal[pos] equal to reference[pos+1 : pos+B]
        commit = min(a + 1, T - 1 - pos)      # accepted + bonus, capped where the reference ends
        pos += commit

`ReplayOptions.anchors` says which proposals are drafted (both give the same walk, counter for counter):
- `all` (`replay_all`): batched drafter passes over *every* anchor position of a group of prompts
  (`draft_many`); the LM head over every slot at the teacher-forced anchors and, at the others, only over
  the slots a walk reads (rounds over slot groups while the prefix matches the reference: `lazy_heads`).
  A(p), the accepted prefix at every anchor, then fixes the walk, which runs on the device for all prompts
  at once (dflash/stages/replay/walk.py: pointer doubling, no step-by-step host loop).
- `visited` (`replay_visited`): only the anchors the loop visits (one in τ), drafted in lockstep over a
  group of prompts (one drafter pass per step over every prompt's anchor, one host read of its proposals),
  with the LM head only over the slots the walk reads.
Teacher-forced accuracy (slot k right whatever the earlier slots) counts every `tf_stride`-th anchor
(P, P+s, ...): all of them at stride 1; a systematic sample, unbiased for the per-slot accuracy and
with its SE over prompts, at stride s > 1. With `scores` also the drafter's NLL of each reference token
and its top-1 probability there (a log-sum-exp over the vocabulary at every slot, computed chunk by chunk
beside the top k: dflash/models/drafter/head.py).

DFlash2 drafters (dflash/models/drafter/dflash2.py): the proposal is the selector's walk; the same drafter
passes also give the unary argmax, whose own walk over the same reference is counted beside
(`Counters.unary_steps` / `unary_committed`: the unary τ), and the unary top-k (teacher-forced: the
unary top-1 hits and the top-k recall). The `visited` mode follows both walks in one lockstep.
The drafter's side (context K/V, drafter passes, the lazy LM head) is dflash/stages/replay/drafts.py.

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

from dflash.models.drafter.model import DFlashDrafter
from dflash.models.target.model import Target
from dflash.stages.metrics import Counters, count_step
from dflash.stages.replay.drafts import (  # noqa: F401  (re-exported: the replay's drafter side)
    CTX_ROUND,
    HEAD_GROUPS,
    KV,
    Drafts,
    ReplayOptions,
    ReplaySeq,
    auto_chunk,
    draft_anchors,
    draft_many,
    drafter_hidden,
    finite_rows,
    lazy_greedy,
    lazy_proposals,
    padded_kv,
    prepare,
    reference_after,
    refuse_non_finite,
)
from dflash.stages.replay.walk import accepted_lengths, walk

ANCHOR_MODES = ("all", "visited")


@dataclass
class Block:
    anchor_pos: int
    proposal: list[int]  # drafted slots 1..B-1 (`visited`: up to the slots the walk read)
    accepted: int
    unary: list[int] | None = (
        None  # DFlash2: the unary argmax at the same slots (samples.html marks where the walk differs)
    )


def verify(seq: list[int], pos: int, proposal: list[int], block_size: int) -> tuple[int, int]:
    """The verify rule at the anchor `pos`: -> (accepted drafted tokens, committed tokens)."""
    labels = seq[pos + 1 : pos + block_size]
    a = 0
    while a < len(labels) and a < len(proposal) and proposal[a] == labels[a]:
        a += 1
    return a, min(a + 1, len(seq) - 1 - pos)


def replay(
    seq: list[int], first_anchor: int, proposals: list[list[int]], block_size: int, selector: bool = False
) -> tuple[Counters, list[Block]]:
    """Walk the draft-verify loop over precomputed proposals (row i: the anchor first_anchor + i)."""
    c = Counters(block_size=block_size, prompts=1, new_tokens=1, selector=selector)
    blocks, pos = [], first_anchor
    while pos < len(seq) - 1:
        prop = proposals[pos - first_anchor]
        a, commit = verify(seq, pos, prop, block_size)
        count_step(c, a, commit)
        blocks.append(Block(pos, list(prop), a))
        pos += commit
    return c, blocks


def teacher_forced(
    seq: list[int] | Tensor,
    first_anchor: int,
    proposals: list[list[int]] | Tensor,
    c: Counters,
    nll: list[list[float]] | Tensor | None = None,
    conf: list[list[float]] | Tensor | None = None,
    stride: int = 1,
    unary: Tensor | None = None,
    topk: Tensor | None = None,
) -> None:
    """Add slot-k accuracy over the anchors of `proposals` (row i: the anchor first_anchor + i*stride) to c,
    with `nll`/`conf` (draft_anchors') the reference token's NLL and the top-1 probability, and with
    `unary` [A, K] / `topk` [A, K, k] (DFlash2) the unary top-1 hits and the reference token's top-k
    presence. One masked comparison over all anchors, on the proposals' device."""
    props = torch.as_tensor(proposals, dtype=torch.long)
    K = c.block_size - 1
    if props.numel() == 0:
        return
    props = props.reshape(-1, K)  # [A, K]
    s = torch.as_tensor(seq, dtype=torch.long, device=props.device)
    T, dev = s.shape[0], props.device
    pos = (
        first_anchor + stride * torch.arange(props.shape[0], device=dev)[:, None] + torch.arange(1, K + 1, device=dev)
    )  # [A, K]
    valid = pos < T  # slot k has a label
    label = s[pos.clamp(max=T - 1)]
    hit = (props == label) & valid

    def add(acc: list, v: Tensor) -> list:  # counters stay plain Python numbers
        return [a + b for a, b in zip(acc, v.tolist())]

    c.tf_total, c.tf_correct = add(c.tf_total, valid.sum(0)), add(c.tf_correct, hit.sum(0))
    if unary is not None and topk is not None:
        c.tf_unary_correct = add(c.tf_unary_correct, ((unary.to(dev).reshape(-1, K) == label) & valid).sum(0))
        c.tf_topk_hit = add(
            c.tf_topk_hit, ((topk.to(dev).reshape(-1, K, topk.shape[-1]) == label[..., None]).any(-1) & valid).sum(0)
        )
    if nll is not None and conf is not None:
        for name, x in (("tf_nll", nll), ("tf_conf", conf)):
            x = torch.as_tensor(x, dtype=torch.float64, device=dev).reshape(-1, K)
            setattr(c, name, add(getattr(c, name), torch.where(valid, x, 0.0).sum(0)))


def _teacher_forced(s: ReplaySeq, ids: Tensor, d: Drafts, c: Counters, stride: int) -> None:
    """teacher_forced over drafts made at every stride-th anchor from s.first (ids: s's ids where d is)."""
    teacher_forced(ids, s.first, d.tokens, c, d.nll, d.conf, stride=stride, unary=d.unary, topk=d.topk)


def _to_host(seqs: list[ReplaySeq], drafts: list[Drafts]) -> tuple[list[Tensor], list[Drafts]]:
    """Every prompt's ids and drafts on the CPU in one copy per field, for the walks (host-side Python): on a GPU,
    one synchronisation per field for the group instead of one per prompt and field."""

    def host(xs: list[Tensor]) -> list[Tensor]:  # a prompt with no anchor keeps its own (empty) shape
        full = [x for x in xs if len(x)]
        parts = iter(torch.cat(full).cpu().split([len(x) for x in full]) if full else ())
        return [next(parts) if len(x) else x.cpu() for x in xs]

    names = ("tokens", "unary", "topk", "nll", "conf")
    cols = [[getattr(d, n) for d in drafts] for n in names]
    cols = [host(c) if c[0] is not None else c for c in cols]
    return host([s.ids for s in seqs]), [Drafts(*row) for row in zip(*cols)]


def _stride(d: Drafts, st: int) -> Drafts:
    return Drafts(*(None if x is None else x[::st] for x in (d.tokens, d.unary, d.topk, d.nll, d.conf)))


def _grid(s: ReplaySeq, st: int) -> Tensor:
    """bool [T-1-P]: the teacher-forced anchors (every st-th from P) among all of s's anchors."""
    return torch.arange(max(0, s.T - 1 - s.first), device=s.ids.device) % st == 0


@torch.no_grad()
def replay_all(
    drafter: DFlashDrafter, target: Target, seqs: list[ReplaySeq], opt: ReplayOptions
) -> list[tuple[Counters, list[Block]]]:
    """The `all` mode over a group of prompts: draft every anchor of every prompt (`draft_many`: every slot through
    the LM head at the teacher-forced anchors, only the slots a walk reads at the others), then walk every prompt at
    once on the device (`walk.walk` over the accepted lengths; DFlash2: the unary argmax's walk too)."""
    B, sel, dev = drafter.cfg.block_size, drafter.cfg.dflash2 is not None, seqs[0].ids.device
    K, anchors = B - 1, [torch.arange(s.first, s.T - 1, device=dev) for s in seqs]
    drafts = draft_many(drafter, target, seqs, anchors, opt, full=[_grid(s, opt.tf_stride) for s in seqs])
    labels = [reference_after(s, a, K)[0] for s, a in zip(seqs, anchors)]
    first, T = (torch.tensor([getattr(s, n) for s in seqs], device=dev) for n in ("first", "T"))

    def lengths(props: list[Tensor]) -> Tensor:  # [S, Tmax]: a(p) at anchor position p
        acc = torch.zeros(len(seqs), max(s.T for s in seqs), dtype=torch.long, device=dev)
        for i, (s, x, lab) in enumerate(zip(seqs, props, labels)):
            acc[i, s.first : s.T - 1] = accepted_lengths(x.to(dev), lab)
        return acc

    w = walk(lengths([d.tokens for d in drafts]), first, T, K)
    outs = w.counters(B, selector=sel)
    if sel:
        u = walk(lengths([d.unary for d in drafts]), first, T, K)
        for c, steps, committed in zip(outs, u.steps.tolist(), u.committed.tolist()):
            c.unary_steps, c.unary_committed = steps, committed
    for s, d, c in zip(seqs, drafts, outs):
        _teacher_forced(s, s.ids, _stride(d, opt.tf_stride), c, opt.tf_stride)
    return list(zip(outs, _blocks(seqs, drafts, labels, w.visited)))


def _blocks(seqs: list[ReplaySeq], drafts: list[Drafts], labels: list[Tensor], visited: Tensor) -> list[list[Block]]:
    """The walk's verify steps per prompt, from one host copy for the group: anchor, proposal (the slots drafted),
    accepted, and the unary argmax (DFlash2)."""
    dev, K = visited.device, labels[0].shape[1]
    first = torch.tensor([s.first for s in seqs], device=dev)
    offset = torch.tensor([0] + [len(x) for x in labels], device=dev).cumsum(0)[:-1]  # each prompt's first draft row
    i, p = visited.nonzero().unbind(1)  # [n]: the verify steps, prompt by prompt, in anchor order
    row = offset[i] + p - first[i]
    tok = torch.cat([d.tokens.to(dev) for d in drafts])[row]  # [n, K]
    cols = [i[:, None], p[:, None], accepted_lengths(tok, torch.cat(labels)[row])[:, None], tok]
    uni = drafts[0].unary is not None
    cols += [torch.cat([d.unary.to(dev) for d in drafts])[row]] if uni else []
    out: list[list[Block]] = [[] for _ in seqs]
    for r in torch.cat(cols, 1).tolist():
        out[r[0]].append(Block(r[1], _drafted(r[3 : 3 + K]), r[2], _drafted(r[3 + K :]) if uni else None))
    return out


def _drafted(prop: list[int]) -> list[int]:
    """A proposal without the slots the lazy head left undrafted (-1: a tail)."""
    return prop[: prop.index(-1)] if -1 in prop else prop


@torch.no_grad()
def replay_visited(
    drafter: DFlashDrafter, target: Target, seqs: list[ReplaySeq], opt: ReplayOptions
) -> list[tuple[Counters, list[Block]]]:
    """The `visited` mode over a group of prompts: the teacher-forced anchors (stride) drafted per sequence,
    then the loop walked in lockstep: each pass drafts the current anchor of every prompt whose anchor is
    not among those (opt.chunk rows per pass), with `lazy_proposals`' LM head. DFlash2: the unary argmax's
    own walk goes along in the same lockstep, its anchors drafted in the same passes."""
    B, dev, sel = drafter.cfg.block_size, seqs[0].ids.device, drafter.cfg.dflash2 is not None
    outs, known = [], []  # per prompt: (counters, blocks); {anchor: (proposal, unary)}
    tfs = [torch.arange(s.first, s.T - 1, opt.tf_stride, device=dev) for s in seqs]
    host_ids, drafts = _to_host(seqs, draft_many(drafter, target, seqs, tfs, opt))
    for s, i, tf, d in zip(seqs, host_ids, tfs, drafts):
        c = Counters(block_size=B, prompts=1, new_tokens=1, selector=sel)
        _teacher_forced(s, i, d, c, opt.tf_stride)
        known.append(
            dict(
                zip(
                    range(s.first, s.T - 1, opt.tf_stride),
                    zip(d.tokens.tolist(), d.unary.tolist() if sel else [None] * len(tf)),
                )
            )
        )
        outs.append((c, []))
    kv, ids = padded_kv(seqs), [i.tolist() for i in host_ids]
    pos = [s.first for s in seqs]
    upos = [s.first if sel else s.T for s in seqs]  # the unary walk (DFlash2); done from the start for DFlash
    ucount = [Counters(block_size=B) for _ in seqs]
    finite: list[tuple[Tensor, Tensor]] = []  # per pass: anchors, their states finite (read once, at the end)
    ext = torch.full(
        (len(seqs), max(s.T for s in seqs) + B), -1, dtype=torch.long, device=dev
    )  # [S, Tmax+B]: -1 past each end
    for i, s in enumerate(seqs):
        ext[i, : s.T] = s.ids
    while True:
        need = sorted({(i, p) for i, s in enumerate(seqs) for p in (pos[i], upos[i]) if p < s.T - 1})
        if not need:
            break
        todo, drafted = [(i, p) for i, p in need if p not in known[i]], {}
        for part in (todo[j : j + opt.chunk] for j in range(0, len(todo), opt.chunk)):
            rows_i, rows_p = [i for i, _ in part], [p for _, p in part]  # on the host: no read of the device
            idx, anc = torch.tensor(rows_i, device=dev), torch.tensor(rows_p, device=dev)  # [R]
            L = min(kv[0][0].shape[2], -(-(max(rows_p) + int(opt.see_anchor)) // CTX_ROUND) * CTX_ROUND)
            sub = (
                kv
                if rows_i == list(range(len(seqs)))
                else [(k[:, :, :L].index_select(0, idx), v[:, :, :L].index_select(0, idx)) for k, v in kv]
            )
            h = drafter_hidden(
                drafter, target, ext[idx, anc][:, None], anc[:, None], sub, opt.backend, opt.see_anchor, L, False
            )  # [R, 1, B-1, H]
            finite.append((anc, finite_rows(h)[:, 0]))
            labels = ext[idx[:, None], anc[:, None] + torch.arange(1, B, device=dev)]  # [R, B-1]
            drafted.update(zip(part, lazy_proposals(drafter, target, h[:, 0], labels, ext[idx, anc])))
        for i, s in enumerate(seqs):
            if pos[i] < s.T - 1:
                prop, unary = known[i].get(pos[i]) or drafted[(i, pos[i])]
                a, commit = verify(ids[i], pos[i], prop, B)
                count_step(outs[i][0], a, commit)
                outs[i][1].append(Block(pos[i], prop, a, unary))
                pos[i] += commit
            if upos[i] < s.T - 1:
                a, commit = verify(ids[i], upos[i], (known[i].get(upos[i]) or drafted[(i, upos[i])])[1], B)
                count_step(ucount[i], a, commit)
                upos[i] += commit
    if finite:
        refuse_non_finite(*(torch.cat(x) for x in zip(*finite)), drafter.fc.weight.dtype)
    for (c, _), cu in zip(outs, ucount):
        c.unary_steps, c.unary_committed = cu.steps, cu.committed
    return outs


def replay_group(
    drafter: DFlashDrafter, target: Target, seqs: list[ReplaySeq], opt: ReplayOptions
) -> list[tuple[Counters, list[Block]]]:
    """Replay a group of prompts in opt.anchors' mode -> per prompt (counters, blocks); the same walk in both."""
    if opt.anchors not in ANCHOR_MODES:
        raise ValueError(f"replay anchors={opt.anchors!r}: use one of {ANCHOR_MODES}")
    if opt.anchors == "all":
        return replay_all(drafter, target, seqs, opt)
    return replay_visited(drafter, target, seqs, opt)
