"""Batches and anchors, each a function of (seed, step) only.

`Batcher.get(step)`: the sequences of one step, a slice of a permutation drawn per epoch (seeded by
seed and epoch), right-padded to `max_len` (a fixed shape: flex_attention compiles once).
`sample_anchors`: N anchors per sequence inside its response, positions P .. T-2 (P the first
response position, where the inference loop's first anchor sits; T-2 so slot 1 has a label), drawn
from a generator seeded by (seed, step). So a resumed run, or a variant trained alone, sees what an
uninterrupted lockstep run would have.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.util.errors import ConfigError


@dataclass
class Batch:
    ids: Tensor  # [S, L] right-padded
    seq_lens: Tensor  # [S]
    prompt_lens: Tensor  # [S]
    anchors: Tensor  # [S, N] sorted; padded blocks sit at the first response position
    block_valid: Tensor  # [S, N]

    def to(self, device: torch.device) -> "Batch":
        return Batch(
            self.ids.to(device),
            self.seq_lens.to(device),
            self.prompt_lens,
            self.anchors.to(device),
            self.block_valid.to(device),
        )


class Batcher:
    """Deterministic batches: step -> (epoch permutation seeded by seed+epoch)[slice]."""

    def __init__(self, seqs: list, batch_size: int, max_len: int, pad_id: int, seed: int):
        kept = [dataclasses.replace(s, ids=s.ids[:max_len]) for s in seqs if len(s.ids) - s.prompt_len >= 2]
        self.seqs = [s for s in kept if len(s.ids) - s.prompt_len >= 2]  # responses of 2+ tokens within max_len
        if not self.seqs:
            raise ConfigError("no training sequence has a response of 2 tokens or more within optim.max_seq_len")
        self.bs, self.max_len, self.pad, self.seed = min(batch_size, len(self.seqs)), max_len, pad_id, seed
        self.per_epoch = len(self.seqs) // self.bs

    def get(self, step: int) -> tuple[Tensor, Tensor, Tensor]:
        """-> ids [S, max_len], seq_lens [S], prompt_lens [S]."""
        epoch, i = divmod(step, self.per_epoch)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        idx = torch.randperm(len(self.seqs), generator=g)[i * self.bs : (i + 1) * self.bs].tolist()
        rows = [self.seqs[j] for j in idx]
        ids = torch.full((len(rows), self.max_len), self.pad, dtype=torch.long)
        for r, s in enumerate(rows):
            ids[r, : len(s.ids)] = torch.tensor(s.ids)
        return ids, torch.tensor([len(s.ids) for s in rows]), torch.tensor([s.prompt_len for s in rows])


def sample_anchors(prompt_lens: Tensor, seq_lens: Tensor, n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Anchors inside each response: positions P .. T-2 (slot 1 needs a label). -> anchors [S, n]
    (sorted; padded blocks sit at the first response position), block_valid [S, n]."""
    S = prompt_lens.shape[0]
    anchors = torch.zeros(S, n, dtype=torch.long)
    valid = torch.zeros(S, n, dtype=torch.bool)
    for s in range(S):
        lo, hi = int(prompt_lens[s]), int(seq_lens[s]) - 2
        count = hi - lo + 1
        if count <= 0:
            continue
        k = min(n, count)
        pick = lo + torch.randperm(count, generator=gen)[:k]
        anchors[s, :k] = pick.sort().values
        anchors[s, k:] = lo
        valid[s, :k] = True
    return anchors, valid


def step_batch(batcher: Batcher, step: int, seed: int, blocks_per_seq: int) -> Batch:
    """The sequences and anchors of `step` (on the CPU)."""
    ids, seq_lens, prompt_lens = batcher.get(step)
    g = torch.Generator().manual_seed(seed * 7919 + step)
    anchors, block_valid = sample_anchors(prompt_lens, seq_lens, blocks_per_seq, g)
    return Batch(ids, seq_lens, prompt_lens, anchors, block_valid)
