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
- `all`: batched drafter passes over *every* anchor position of a group of prompts (`draft_many`), so every
  proposal the loop could see exists, and teacher-forced accuracy comes from the same drafts.
- `visited` (`replay_visited`): only the anchors the loop visits (one in τ), drafted in
  lockstep over a group of prompts, with the LM head only over the slots the walk reads.
Teacher-forced accuracy (slot k right whatever the earlier slots) counts every `tf_stride`-th anchor
(P, P+s, ...): all of them at stride 1; a systematic sample, unbiased for the per-slot accuracy and
with its SE over prompts, at stride s > 1. With `scores` also the drafter's NLL of each reference token
and its top-1 probability there (a log-sum-exp over the vocabulary at every slot, ~30% more on CPU).

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
    lazy_greedy,
    lazy_proposals,
    padded_kv,
    prepare,
)

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


def replay_all(
    drafter: DFlashDrafter, target: Target, seqs: list[ReplaySeq], opt: ReplayOptions
) -> list[tuple[Counters, list[Block]]]:
    """The `all` mode over a group of prompts: draft every anchor of every prompt (`draft_many`), then walk each."""
    drafts = draft_many(drafter, target, seqs, [torch.arange(s.first, s.T - 1, device=s.ids.device) for s in seqs], opt)
    ids, drafts = _to_host(seqs, drafts)
    return [_walk_all(drafter, s, i, d, opt) for s, i, d in zip(seqs, ids, drafts)]


def _walk_all(
    drafter: DFlashDrafter, s: ReplaySeq, ids: Tensor, d: Drafts, opt: ReplayOptions
) -> tuple[Counters, list[Block]]:
    """One prompt's walk over its drafts at every anchor (DFlash2: also the unary argmax's walk), teacher-forced at the
    stride; ids and d on the host (`_to_host`)."""
    seq, B = ids.tolist(), drafter.cfg.block_size
    c, blocks = replay(seq, s.first, d.tokens.tolist(), B, selector=d.unary is not None)
    if d.unary is not None:
        unary = d.unary.tolist()
        cu, _ = replay(seq, s.first, unary, B)
        c.unary_steps, c.unary_committed = cu.steps, cu.committed
        for b in blocks:
            b.unary = unary[b.anchor_pos - s.first]
    _teacher_forced(s, ids, _stride(d, opt.tf_stride), c, opt.tf_stride)
    return c, blocks


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
            idx, anc = (
                torch.tensor([i for i, _ in part], device=dev),
                torch.tensor([p for _, p in part], device=dev),
            )  # [R]
            L = int(anc.max()) + int(opt.see_anchor)
            L = min(kv[0][0].shape[2], -(-L // CTX_ROUND) * CTX_ROUND)  # as drafter_hidden rounds it: few shapes
            every = idx.tolist() == list(range(len(seqs)))
            rows = (
                kv if every else [(k[:, :, :L].index_select(0, idx), v[:, :, :L].index_select(0, idx)) for k, v in kv]
            )
            h = drafter_hidden(
                drafter, target, ext[idx, anc][:, None], anc[:, None], rows, opt.backend, opt.see_anchor
            )[:, 0]
            labels = ext[idx[:, None], anc[:, None] + torch.arange(1, B, device=dev)]  # [R, B-1]
            drafted.update(zip(part, lazy_proposals(drafter, target, h, labels, ext[idx, anc])))
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
