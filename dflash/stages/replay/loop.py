"""The exact offline replay of DFlash's greedy draft-verify loop (docs/family.md §2), in two modes.

Under greedy decoding the output equals the reference, and the drafter's proposal for an anchor
at position p depends only on (p, the token at p, the taps of positions < p): all fixed by the
reference. So the loop is index walking over proposals (`verify` is its one rule):

    pos = P                          # first anchor: the token the prefill produced
    while pos < T - 1:               # T = len(prompt + reference)
        a = longest prefix of proposal[pos] equal to reference[pos+1 : pos+1+K]   # K drafts
        commit = min(a + 1, T - 1 - pos)      # accepted + bonus, capped where the reference ends
        pos += commit

`ReplayOptions.anchors` says which proposals are drafted (both give the same walk, counter for counter):
- `all` (`replay_all`): batched drafter passes over *every* anchor position of a group of prompts
  (`draft_many`); the LM head over every slot at the teacher-forced anchors and, at the others, only over
  the slots a walk reads (rounds over slot groups while the prefix matches the reference: `lazy_heads`).
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
DSpark drafters (dflash/models/drafter/dspark.py): the proposal is the Markov rollout, the unary walk its base
argmax (the block without the Markov head); with a confidence head, one more walk per `ReplayOptions.thresholds`
t verifies only the drafts before the first slot whose confidence is below t (`verified`; `Counters.thr_*`), and
the teacher-forced anchors count the head's calibration (`calibrate`). Every drafter's replay also walks the
other slot convention (`ReplayOptions.other`: the same drafter passes read one row earlier or later;
`Counters.other_*`), what the convention check compares. A verify step runs `Counters.block_size` tokens: the
anchor and the drafter's K proposals (DSpark's anchor convention: K = its rows, else rows - 1).
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
from dflash.stages.metrics import CAL_BINS, Counters, count_step
from dflash.stages.replay.drafts import (  # noqa: F401  (re-exported: the replay's drafter side)
    CTX_ROUND,
    FIELDS,
    HEAD_BYTES,
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
    other_offset,
    padded_kv,
    prepare,
    propose_rows,
    refuse_non_finite,
)

ANCHOR_MODES = ("all", "visited")


@dataclass
class Block:
    anchor_pos: int
    proposal: list[int]  # the drafted tokens (`visited`: up to the slots the walk read)
    accepted: int
    unary: list[int] | None = (
        None  # DFlash2 / DSpark: the unary argmax at the same slots (samples.html marks where the walk differs)
    )
    accept_p: list[float] | None = None  # DSpark's confidence head: each drafted slot's predicted acceptance


def verify(seq: list[int], pos: int, proposal: list[int], width: int) -> tuple[int, int]:
    """The verify rule at the anchor `pos` over `width` tokens (the anchor and up to width - 1 drafts): -> (accepted
    drafted tokens, committed tokens)."""
    labels = seq[pos + 1 : pos + width]
    a = 0
    while a < len(labels) and a < len(proposal) and proposal[a] == labels[a]:
        a += 1
    return a, min(a + 1, len(seq) - 1 - pos)


def replay(
    seq: list[int], first_anchor: int, proposals: list[list[int]], block_size: int, selector: bool = False, **kw
) -> tuple[Counters, list[Block]]:
    """Walk the draft-verify loop over precomputed proposals (row i: the anchor first_anchor + i) with verify steps of
    `block_size` tokens (the anchor and up to block_size - 1 drafts); a shorter proposal verifies only its drafts
    (`drafted` counts them). `kw`: further Counters fields."""
    c = Counters(block_size=block_size, prompts=1, new_tokens=1, selector=selector, **kw)
    width = block_size
    blocks, pos = [], first_anchor
    while pos < len(seq) - 1:
        prop = proposals[pos - first_anchor]
        a, commit = verify(seq, pos, prop, width)
        count_step(c, a, commit, len(prop))
        blocks.append(Block(pos, list(prop), a))
        pos += commit
    return c, blocks


def verified(accept_p: Tensor, t: float) -> Tensor:
    """DSpark's threshold rule (DeepSpec's evaluator, llama.cpp's --spec-draft-conf-min): accept_p [A, K] -> the drafts
    each step verifies [A]: those before the first slot whose confidence is below t (K if none; 0 allowed)."""
    below = accept_p < t  # t <= 0: never
    K = accept_p.shape[-1]
    return torch.where(below.any(-1), below.to(torch.uint8).argmax(-1), K)


def add_walk(c: Counters, i: int, w: Counters) -> None:
    """Threshold i's walk `w` into c's thr_* counters."""
    c.thr_steps[i] += w.steps
    c.thr_committed[i] += w.committed
    c.thr_accepted[i] += w.accepted
    c.thr_drafted[i] += w.drafted


def counter_fields(drafter: DFlashDrafter, opt: ReplayOptions) -> dict:
    """What this drafter's replay walks beside the proposal, as Counters fields (block_size = the verify width)."""
    cfg, ds = drafter.cfg, drafter.cfg.dspark
    conf = ds is not None and ds.confidence
    return dict(
        block_size=cfg.width,
        selector=cfg.dflash2 is not None,
        markov=ds is not None,
        confidence=conf,
        thresholds=list(opt.thresholds) if conf else [],
        other_width=cfg.block_size - other_offset(cfg) + 1 if opt.other else 0,
    )


def new_counters(drafter: DFlashDrafter, opt: ReplayOptions) -> Counters:
    """One prompt's empty counters for this drafter's replay."""
    return Counters(prompts=1, new_tokens=1, **counter_fields(drafter, opt))


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
    accept_p: Tensor | None = None,
) -> None:
    """Add slot-k accuracy over the anchors of `proposals` (row i: the anchor first_anchor + i*stride) to c,
    with `nll`/`conf` (draft_anchors') the reference token's NLL and the top-1 probability, with
    `unary` [A, K] (DFlash2, DSpark) the unary top-1 hits, with `topk` [A, K, k] (DFlash2) the reference token's
    top-k presence, and with `accept_p` [A, K] (DSpark) the confidence head's calibration: per slot k the predicted
    Π_{i<=k} accept_p_i against whether drafts 1..k all equal the reference. One masked comparison over all anchors,
    on the proposals' device."""
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
    if unary is not None:
        c.tf_unary_correct = add(c.tf_unary_correct, ((unary.to(dev).reshape(-1, K) == label) & valid).sum(0))
    if topk is not None:
        c.tf_topk_hit = add(
            c.tf_topk_hit, ((topk.to(dev).reshape(-1, K, topk.shape[-1]) == label[..., None]).any(-1) & valid).sum(0)
        )
    if nll is not None and conf is not None:
        for name, x in (("tf_nll", nll), ("tf_conf", conf)):
            x = torch.as_tensor(x, dtype=torch.float64, device=dev).reshape(-1, K)
            setattr(c, name, add(getattr(c, name), torch.where(valid, x, 0.0).sum(0)))
    if accept_p is not None and c.confidence:
        calibrate(c, torch.as_tensor(accept_p, device=dev).reshape(-1, K), hit, valid)


def calibrate(c: Counters, accept_p: Tensor, hit: Tensor, valid: Tensor) -> None:
    """The confidence head's calibration counters from A anchors' [A, K] confidences, teacher-forced hits and labels."""
    pred = accept_p.double().cumprod(-1)  # predicted: slots 1..k all accepted
    won = hit.long().cumprod(-1).bool()  # realised: drafts 1..k all equal the reference
    y = won.double()
    zero = torch.zeros((), dtype=torch.float64, device=pred.device)

    def add(acc: list, v: Tensor) -> list:
        return [a + b for a, b in zip(acc, v.tolist())]

    c.cal_total = add(c.cal_total, valid.sum(0))
    c.cal_hit = add(c.cal_hit, (won & valid).sum(0))
    c.cal_pred = add(c.cal_pred, torch.where(valid, pred, zero).sum(0))
    c.cal_sq = add(c.cal_sq, torch.where(valid, (pred - y) ** 2, zero).sum(0))
    b = (pred[valid] * CAL_BINS).long().clamp(0, CAL_BINS - 1)
    c.bin_total = add(c.bin_total, torch.bincount(b, minlength=CAL_BINS))
    c.bin_pred = add(c.bin_pred, torch.bincount(b, pred[valid], minlength=CAL_BINS))
    c.bin_hit = add(c.bin_hit, torch.bincount(b, y[valid], minlength=CAL_BINS).round().long())


def _teacher_forced(s: ReplaySeq, ids: Tensor, d: Drafts, c: Counters, stride: int) -> None:
    """teacher_forced over drafts made at every stride-th anchor from s.first (ids: s's ids where d is)."""
    teacher_forced(
        ids, s.first, d.tokens, c, d.nll, d.conf, stride=stride, unary=d.unary, topk=d.topk, accept_p=d.accept_p
    )


def _to_host(seqs: list[ReplaySeq], drafts: list[Drafts]) -> tuple[list[Tensor], list[Drafts]]:
    """Every prompt's ids and drafts on the CPU in one copy per field, for the walks (host-side Python): on a GPU,
    one synchronisation per field for the group instead of one per prompt and field."""

    def host(xs: list[Tensor]) -> list[Tensor]:  # a prompt with no anchor keeps its own (empty) shape
        full = [x for x in xs if len(x)]
        parts = iter(torch.cat(full).cpu().split([len(x) for x in full]) if full else ())
        return [next(parts) if len(x) else x.cpu() for x in xs]

    cols = [[getattr(d, n) for d in drafts] for n in FIELDS]
    cols = [host(c) if c[0] is not None else c for c in cols]
    return host([s.ids for s in seqs]), [Drafts(*row) for row in zip(*cols)]


def _stride(d: Drafts, st: int) -> Drafts:
    return Drafts(*(None if x is None else x[::st] for x in (getattr(d, n) for n in FIELDS)))


def replay_all(
    drafter: DFlashDrafter, target: Target, seqs: list[ReplaySeq], opt: ReplayOptions
) -> list[tuple[Counters, list[Block]]]:
    """The `all` mode over a group of prompts: draft every anchor of every prompt (`draft_many`: every slot through
    the LM head at the teacher-forced anchors, only the slots a walk reads at the others), then walk each."""
    anchors = [torch.arange(s.first, s.T - 1, device=s.ids.device) for s in seqs]
    grid = [torch.arange(len(a), device=a.device) % opt.tf_stride == 0 for a in anchors]  # the teacher-forced ones
    drafts = draft_many(drafter, target, seqs, anchors, opt, full=grid)
    ids, drafts = _to_host(seqs, drafts)
    return [_walk_all(drafter, s, i, d, opt) for s, i, d in zip(seqs, ids, drafts)]


def _walk_all(
    drafter: DFlashDrafter, s: ReplaySeq, ids: Tensor, d: Drafts, opt: ReplayOptions
) -> tuple[Counters, list[Block]]:
    """One prompt's walks over its drafts at every anchor, teacher-forced at the stride; ids and d on the host
    (`_to_host`). Beside the proposal's walk: the unary argmax's (DFlash2, DSpark), one per confidence threshold
    (DSpark: the proposal cut at `verified`), the other slot convention's (opt.other)."""
    seq, fields = ids.tolist(), counter_fields(drafter, opt)
    c, blocks = replay(seq, s.first, d.tokens.tolist(), **fields)
    for b in blocks:
        b.proposal = _drafted(b.proposal)
    if d.unary is not None:
        unary = d.unary.tolist()
        cu, _ = replay(seq, s.first, unary, c.block_size)
        c.unary_steps, c.unary_committed = cu.steps, cu.committed
        for b in blocks:
            b.unary = _drafted(unary[b.anchor_pos - s.first])
    if d.accept_p is not None and c.confidence:
        conf = d.accept_p.tolist()
        for b in blocks:
            b.accept_p = conf[b.anchor_pos - s.first]
        toks = d.tokens.tolist()
        for i, t in enumerate(c.thresholds):
            cut = [p[:n] for p, n in zip(toks, verified(d.accept_p, t).tolist())]
            add_walk(c, i, replay(seq, s.first, cut, c.block_size)[0])
    if d.other is not None and c.other_width:
        co, _ = replay(seq, s.first, d.other.tolist(), c.other_width)
        c.other_steps, c.other_committed = co.steps, co.committed
    _teacher_forced(s, ids, _stride(d, opt.tf_stride), c, opt.tf_stride)
    return c, blocks


def _drafted(prop: list[int]) -> list[int]:
    """A proposal without the slots the lazy head left undrafted (-1: a tail; `draft_many`)."""
    return prop[: prop.index(-1)] if -1 in prop else prop


@dataclass
class Found:
    """What the visited mode drafted at one anchor (lists on the host; None where not computed)."""

    tokens: list[int] | None = None  # the proposal (the lazy head's: up to the slots its walk reads)
    unary: list[int] | None = None
    accept_p: list[float] | None = None
    other: list[int] | None = None


def _found(d: Drafts, r: int) -> Found:
    col = lambda x: None if x is None else x[r].tolist()  # noqa: E731
    return Found(col(d.tokens), col(d.unary), col(d.accept_p), col(d.other))


def _visited_drafts(
    drafter: DFlashDrafter,
    target: Target,
    h: Tensor,
    tok: Tensor,
    labels: Tensor,
    other_labels: Tensor,
    need: list[set[str]],
    opt: ReplayOptions,
) -> list[Found]:
    """h [R, B, H] the block states of R anchors (tokens tok [R]), labels [R, K] / other_labels [R, K'] (the
    reference, -1 past its end), need: per row the walks that read it -> what each walk reads. DSpark: its rollout in
    full (the thresholds and the confidence need every slot); the others: the lazy LM head (`lazy_proposals`), the
    other convention's only on the rows its walk is at."""
    cfg, R = drafter.cfg, h.shape[0]
    out = [Found() for _ in range(R)]
    if cfg.dspark is not None:
        step = max(1, HEAD_BYTES // (cfg.block_size * target.vocab_size * target.dtype.itemsize))
        for r in range(0, R, step):
            p = propose_rows(drafter, target, h[r : r + step], tok[r : r + step], None, opt)
            d = Drafts(**{n: p[n] for n in FIELDS})
            out[r : r + step] = [_found(d, j) for j in range(len(d.tokens))]
        return out
    main = [r for r in range(R) if need[r] - {"other"}]
    if main:
        rows = torch.tensor(main, device=h.device)
        for r, (p, u) in zip(main, lazy_proposals(drafter, target, h[rows, cfg.offset :], labels[rows], tok[rows])):
            out[r].tokens, out[r].unary = p, u
    alt = [r for r in range(R) if "other" in need[r]]
    if alt:
        rows = torch.tensor(alt, device=h.device)
        off = other_offset(cfg)
        for r, (p, _) in zip(alt, lazy_proposals(drafter, target, h[rows, off:], other_labels[rows], tok[rows])):
            out[r].other = p
    return out


@torch.no_grad()
def replay_visited(
    drafter: DFlashDrafter, target: Target, seqs: list[ReplaySeq], opt: ReplayOptions
) -> list[tuple[Counters, list[Block]]]:
    """The `visited` mode over a group of prompts: the teacher-forced anchors (stride) drafted per sequence,
    then every walk (`_walk_all`'s) taken in lockstep: each pass drafts the current anchors of every walk of every
    prompt that are not among those (opt.chunk rows per pass), each walk reading what it needs (`_visited_drafts`)."""
    dev = seqs[0].ids.device
    template = new_counters(drafter, opt)
    W, W2 = template.block_size, template.other_width
    walks = ["main", *(["unary"] if template.selector or template.markov else [])]
    walks += [f"t{i}" for i in range(len(template.thresholds))] + (["other"] if W2 else [])
    outs, known = [], []  # per prompt: (counters, blocks); {anchor: Found}
    tfs = [torch.arange(s.first, s.T - 1, opt.tf_stride, device=dev) for s in seqs]
    host_ids, drafts = _to_host(seqs, draft_many(drafter, target, seqs, tfs, opt))
    for s, i, tf, d in zip(seqs, host_ids, tfs, drafts):
        c = new_counters(drafter, opt)
        _teacher_forced(s, i, d, c, opt.tf_stride)
        known.append({p: _found(d, r) for r, p in enumerate(range(s.first, s.T - 1, opt.tf_stride))})
        outs.append((c, []))
    kv, ids = padded_kv(seqs), [i.tolist() for i in host_ids]
    pos = {w: [s.first for s in seqs] for w in walks}
    wc = {w: [Counters(block_size=W2 if w == "other" else W) for _ in seqs] for w in walks if w != "main"}
    K, K2 = W - 1, max(W2 - 1, 1)
    ext = torch.full(
        (len(seqs), max(s.T for s in seqs) + max(K, K2) + 1), -1, dtype=torch.long, device=dev
    )  # [S, Tmax+...]: -1 past each end
    for i, s in enumerate(seqs):
        ext[i, : s.T] = s.ids
    finite: list[tuple[Tensor, Tensor]] = []  # per pass: anchors, their states finite (read once, at the end)
    while True:
        need: dict[tuple[int, int], set[str]] = {}
        for w in walks:
            for i, s in enumerate(seqs):
                if pos[w][i] < s.T - 1:
                    need.setdefault((i, pos[w][i]), set()).add(w)
        if not need:
            break
        todo, drafted = [(i, p) for i, p in sorted(need) if p not in known[i]], {}
        for part in (todo[j : j + opt.chunk] for j in range(0, len(todo), opt.chunk)):
            rows_i, rows_p = [i for i, _ in part], [p for _, p in part]  # on the host: no read of the device
            idx, anc = torch.tensor(rows_i, device=dev), torch.tensor(rows_p, device=dev)  # [R]
            L = min(kv[0][0].shape[2], -(-(max(rows_p) + int(opt.see_anchor)) // CTX_ROUND) * CTX_ROUND)
            rows = (
                kv
                if rows_i == list(range(len(seqs)))
                else [(k[:, :, :L].index_select(0, idx), v[:, :, :L].index_select(0, idx)) for k, v in kv]
            )
            tok = ext[idx, anc]
            h = drafter_hidden(
                drafter, target, tok[:, None], anc[:, None], rows, opt.backend, opt.see_anchor, L, False
            )  # [R, 1, B, H]
            finite.append((anc, finite_rows(h)[:, 0]))
            h = h[:, 0]
            labels = ext[idx[:, None], anc[:, None] + torch.arange(1, K + 1, device=dev)]  # [R, K]
            other_labels = ext[idx[:, None], anc[:, None] + torch.arange(1, K2 + 1, device=dev)]  # [R, K']
            found = _visited_drafts(drafter, target, h, tok, labels, other_labels, [need[q] for q in part], opt)
            drafted.update(zip(part, found))
        for i, s in enumerate(seqs):
            c, blocks = outs[i]
            for w in walks:
                p = pos[w][i]
                if p >= s.T - 1:
                    continue
                f = known[i].get(p) or drafted[(i, p)]
                if w == "other":
                    prop, width = f.other, W2
                elif w == "unary":
                    prop, width = f.unary, W
                elif w.startswith("t"):
                    n = int(verified(torch.tensor([f.accept_p]), template.thresholds[int(w[1:])])[0])
                    prop, width = f.tokens[:n], W
                else:
                    prop, width = f.tokens, W
                a, commit = verify(ids[i], p, prop, width)
                if w == "main":
                    count_step(c, a, commit)
                    blocks.append(Block(p, prop, a, f.unary, f.accept_p))
                else:
                    count_step(wc[w][i], a, commit, len(prop))
                pos[w][i] += commit
    if finite:
        refuse_non_finite(*(torch.cat(x) for x in zip(*finite)), drafter.fc.weight.dtype)
    for i, (c, _) in enumerate(outs):
        if "unary" in wc:
            c.unary_steps, c.unary_committed = wc["unary"][i].steps, wc["unary"][i].committed
        if "other" in wc:
            c.other_steps, c.other_committed = wc["other"][i].steps, wc["other"][i].committed
        for t in range(len(template.thresholds)):
            add_walk(c, t, wc[f"t{t}"][i])
    return outs


def replay_group(
    drafter: DFlashDrafter, target: Target, seqs: list[ReplaySeq], opt: ReplayOptions
) -> list[tuple[Counters, list[Block]]]:
    """Replay a group of prompts in opt.anchors' mode -> per prompt (counters, blocks); the same walks in both."""
    if opt.anchors not in ANCHOR_MODES:
        raise ValueError(f"replay anchors={opt.anchors!r}: use one of {ANCHOR_MODES}")
    if opt.anchors == "all":
        return replay_all(drafter, target, seqs, opt)
    return replay_visited(drafter, target, seqs, opt)
