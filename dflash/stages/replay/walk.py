"""The replay's walk over known accepted lengths, on the device, with no per-step synchronisation (the `all` mode).

Given every anchor's accepted prefix a(p) (the verify rule, loop.verify: it depends on p's proposal and the
reference only), the loop `pos -> pos + min(a(pos) + 1, T - 1 - pos)` from P visits {next^n(P)}. Pointer doubling
finds that set for all prompts at once in ceil(log2 T) gather / scatter rounds: with S_0 = {P}, next^1 = next,
S_{j+1} = S_j ∪ next^(2^j)(S_j) and next^(2^(j+1)) = next^(2^j) ∘ next^(2^j), S_j holds the first 2^j anchors
visited. Every counter of `metrics.count_step` is then a masked sum over the anchors (`WalkCounts.counters`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.stages.metrics import Counters


def accepted_lengths(tokens: Tensor, labels: Tensor) -> Tensor:
    """Proposals [A, K] (-1 where not drafted), labels [A, K] (the reference after each anchor, -1 past its end)
    -> a(p) [A]: the longest prefix of the proposal equal to the reference (loop.verify's `accepted`)."""
    hit = (tokens == labels) & (labels >= 0)
    return hit.long().cumprod(-1).sum(-1)


@dataclass(frozen=True)
class WalkCounts:
    """The loop's counters per prompt (metrics.Counters' loop fields) and the anchors it visits."""

    steps: Tensor  # [S]
    accepted: Tensor  # [S]
    committed: Tensor  # [S]
    committed_uncapped: Tensor  # [S]
    accepted_at_pos: Tensor  # [S, K]
    commit_hist: Tensor  # [S, K + 2]
    visited: Tensor  # [S, Tmax] bool: the anchors the walk verifies

    def counters(self, block_size: int, selector: bool = False) -> list[Counters]:
        """One Counters per prompt (one host copy of every field)."""
        cols = torch.cat(
            [
                torch.stack([self.steps, self.accepted, self.committed, self.committed_uncapped], 1),
                self.accepted_at_pos,
                self.commit_hist,
            ],
            1,
        ).tolist()
        K = block_size - 1
        return [
            Counters(
                block_size=block_size,
                steps=r[0],
                drafted=r[0] * K,
                accepted=r[1],
                committed=r[2],
                committed_uncapped=r[3],
                new_tokens=1 + r[2],  # the prefill's token and every committed one
                prompts=1,
                accepted_at_pos=r[4 : 4 + K],
                commit_hist=r[4 + K :],
                selector=selector,
            )
            for r in cols
        ]


def walk(accepted: Tensor, first: Tensor, T: Tensor, K: int) -> WalkCounts:
    """accepted [S, Tmax] (a(p) at anchor position p; any value where p < P or p >= T-1), first [S] (P), T [S]
    -> the walk's counters."""
    S, Tmax = accepted.shape
    dev = accepted.device
    p = torch.arange(Tmax, device=dev)[None].expand(S, Tmax)
    live = (p >= first[:, None]) & (p < (T - 1)[:, None])  # the anchors the loop may verify
    commit = torch.minimum(accepted + 1, (T - 1)[:, None] - p).clamp(min=0)
    nxt = torch.where(live, p + commit, p).clamp(max=Tmax - 1)  # [S, Tmax]: absorbing past the end
    seen = torch.zeros(S, Tmax, dtype=torch.bool, device=dev)
    seen[torch.arange(S, device=dev), first.clamp(max=Tmax - 1)] = True
    for _ in range(max(1, (Tmax - 1).bit_length())):  # {next^n(P): n < 2^j} -> {n < 2^(j+1)}
        seen = seen | (torch.zeros(S, Tmax, dtype=torch.long, device=dev).scatter_add_(1, nxt, seen.long()) > 0)
        nxt = nxt.gather(1, nxt)  # next^(2^(j+1))
    v = seen & live
    a, c = torch.where(v, accepted, 0), torch.where(v, commit, 0)
    hist = torch.zeros(S, K + 2, dtype=torch.long, device=dev).scatter_add_(1, c, v.long())  # [S, K+2]
    at = (a[..., None] > torch.arange(K, device=dev)).sum(1)  # [S, K]
    return WalkCounts(v.sum(1), a.sum(1), c.sum(1), torch.where(v, a + 1, 0).sum(1), at, hist, v)
