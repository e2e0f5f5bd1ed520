"""The exact offline replay of DFlash's greedy draft-verify loop (DFLASH.md §2).

Under greedy decoding the output equals the reference, and the drafter's proposal for an anchor
at position p depends only on (p, the token at p, the taps of positions < p): all fixed by the
reference. So one batched drafter pass over *every* anchor position gives every proposal the
loop could ever see; the loop itself is then index walking over those proposals:

    pos = P                          # first anchor: the token the prefill produced
    while pos < T - 1:               # T = len(prompt + reference)
        a = longest prefix of proposal[pos] equal to reference[pos+1 : pos+B]
        commit = min(a + 1, T - 1 - pos)      # accepted + bonus, capped where the reference ends
        pos += commit

No cache is rolled back here: the features come from one forward over prompt + reference, so a
hybrid target's Gated DeltaNet state (Qwen3.5 / 3.6) only ever advances over committed tokens;
the online loop (speculative.py) is what must roll it back after a cut block.

The same proposals give teacher-forced accuracy at every anchor for free, and the same logits the
drafter's NLL of each reference token and its top-1 probability (`scores`: a log-sum-exp over the
vocabulary at every slot, ~30% more replay time on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.models.drafter import DFlashDrafter
from dflash.models.target import Target
from dflash.stages.metrics import Counters, count_step
from dflash.util.errors import NumericsError


@dataclass
class Block:
    anchor_pos: int
    proposal: list[int]  # drafted slots 1..B-1
    accepted: int


@torch.no_grad()
def draft_every_anchor(
    drafter: DFlashDrafter,
    target: Target,
    seq: Tensor,  # [T] prompt + reference
    taps: Tensor,  # [T, n*H] taps of seq
    first_anchor: int,
    backend: str = "sdpa",
    anchors_per_chunk: int = 32,
    see_anchor: bool = False,
    scores: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """-> proposals [A, B-1] (greedy, row i for the anchor at first_anchor + i, A = T-1-first_anchor);
    with `scores` also nll [A, B-1] (-log p of the reference token at slot k; rows past the end hold
    the last token's) and conf [A, B-1] (the drafter's top-1 probability), else None, None."""
    B = drafter.cfg.block_size
    T = seq.shape[0]
    anchors = torch.arange(first_anchor, T - 1, device=seq.device)
    mask_id = drafter.cfg.mask_token_id
    dev, dt = drafter.fc.weight.device, drafter.fc.weight.dtype  # with the target's last layers
    k = torch.arange(1, B, device=seq.device)
    props, nlls, confs = [], [], []
    for a in anchors.split(anchors_per_chunk) if len(anchors) else ():  # no anchor: a 1-token reference (EOS first)
        N = a.shape[0]
        block = torch.full((N, B), mask_id, dtype=torch.long, device=seq.device)
        block[:, 0] = seq[a]
        ctx_len = int(a.max()) + int(see_anchor)  # the last anchor sees positions < p (or <= p)
        emb = target.embed(block)[None].to(dev, dt)  # [1, N, B, H]
        h = drafter(taps[None, :ctx_len].to(dev, dt), emb, a[None].to(dev), backend=backend, see_anchor=see_anchor)
        if not bool(torch.isfinite(h).all()):
            bad = int(a[~torch.isfinite(h[0]).all(-1).all(-1).to(a.device)][0])
            raise NumericsError(f"the drafter's hidden states are not finite at the anchor at position {bad} (dtype {dt}): "
                                "with float16 this is usually overflow; evaluate in bfloat16 or float32 (device.dtype=...)")
        h = h[0, :, 1:].reshape(N * (B - 1), -1).to(target.dtype)  # 2-D: a 3-D strided input takes a slow bmm path
        logits = target.lm_head(h)  # [N*(B-1), V]
        if not scores:
            props.append(logits.argmax(-1).view(N, B - 1))
            continue
        logits = logits.float()
        lse = logits.logsumexp(-1)  # [N*(B-1)]: log p = logit - lse, no second [.., V] tensor
        ref = seq[(a[:, None] + k).clamp(max=T - 1)].reshape(-1, 1).to(logits.device)  # [N*(B-1), 1]
        top = logits.max(-1)
        props.append(top.indices.view(N, B - 1))
        confs.append((top.values - lse).exp().view(N, B - 1))
        nlls.append((lse - logits.gather(-1, ref)[:, 0]).view(N, B - 1))
    if not props:
        empty = torch.empty((0, B - 1), device=dev)
        return empty.long(), (empty if scores else None), (empty if scores else None)
    return torch.cat(props), (torch.cat(nlls) if scores else None), (torch.cat(confs) if scores else None)


def replay(seq: list[int], first_anchor: int, proposals: list[list[int]], block_size: int) -> tuple[Counters, list[Block]]:
    """Walk the draft-verify loop over precomputed proposals; counters exclude wall time."""
    T = len(seq)
    c = Counters(block_size=block_size, prompts=1, new_tokens=1)
    blocks = []
    pos = first_anchor
    while pos < T - 1:
        prop = proposals[pos - first_anchor]
        labels = seq[pos + 1 : pos + block_size]
        a = 0
        while a < len(labels) and prop[a] == labels[a]:
            a += 1
        commit = min(a + 1, T - 1 - pos)
        count_step(c, a, commit)
        blocks.append(Block(pos, list(prop), a))
        pos += commit
    return c, blocks


def teacher_forced(
    seq: list[int] | Tensor, first_anchor: int, proposals: list[list[int]] | Tensor, c: Counters,
    nll: list[list[float]] | Tensor | None = None, conf: list[list[float]] | Tensor | None = None,
) -> None:
    """Add slot-k accuracy over every anchor to c (slot k right regardless of earlier slots), and
    with `nll`/`conf` (draft_every_anchor's) the reference token's NLL and the top-1 probability.
    One masked comparison over all anchors, on the proposals' device."""
    props = torch.as_tensor(proposals, dtype=torch.long)
    K = c.block_size - 1
    if props.numel() == 0:
        return
    props = props.reshape(-1, K)  # [A, K]
    s = torch.as_tensor(seq, dtype=torch.long, device=props.device)
    T = s.shape[0]
    pos = first_anchor + torch.arange(props.shape[0], device=props.device)[:, None] + torch.arange(1, K + 1, device=props.device)  # [A, K]
    valid = pos < T  # slot k has a label
    hit = (props == s[pos.clamp(max=T - 1)]) & valid

    def add(acc: list, v: Tensor) -> list:  # counters stay plain Python numbers
        return [a + b for a, b in zip(acc, v.tolist())]

    c.tf_total, c.tf_correct = add(c.tf_total, valid.sum(0)), add(c.tf_correct, hit.sum(0))
    if nll is not None and conf is not None:
        for name, x in (("tf_nll", nll), ("tf_conf", conf)):
            x = torch.as_tensor(x, dtype=torch.float64, device=props.device).reshape(-1, K)
            setattr(c, name, add(getattr(c, name), torch.where(valid, x, 0.0).sum(0)))


def evaluate_sequence(
    drafter: DFlashDrafter,
    target: Target,
    prompt_ids: list[int],
    completion_ids: list[int],
    taps: Tensor,
    backend: str = "sdpa",
    anchors_per_chunk: int = 32,
    see_anchor: bool = False,
    scores: bool = False,
) -> tuple[Counters, list[Block]]:
    seq = prompt_ids + completion_ids
    P = len(prompt_ids)
    props, nll, conf = draft_every_anchor(
        drafter, target, torch.tensor(seq, device=target.device), taps, P, backend, anchors_per_chunk, see_anchor, scores
    )
    c, blocks = replay(seq, P, props.tolist(), drafter.cfg.block_size)
    teacher_forced(seq, P, props, c, nll, conf)
    return c, blocks
