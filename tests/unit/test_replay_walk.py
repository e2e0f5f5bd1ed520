"""The device walk (dflash/stages/replay/walk.py) equals the replay's loop (loop.replay: verify + count_step) on
random accepted lengths, counter for counter and anchor for anchor, several prompts at once."""

from __future__ import annotations

import random

import torch
from conftest import loop_counters

from dflash.stages.replay.loop import replay
from dflash.stages.replay.walk import accepted_lengths, walk


def test_walk_equals_the_loop():
    rng = random.Random(0)
    for K in (1, 5, 15):
        S, Tmax = 7, 300
        T = [rng.randrange(1, Tmax + 1) for _ in range(S)]
        P = [rng.randrange(0, t) for t in T]
        seqs = [[rng.randrange(3, 50) for _ in range(t)] for t in T]
        props = []  # per prompt, per anchor: a proposal accepted for a random length
        for seq, p0, t in zip(seqs, P, T):
            rows = []
            for p in range(p0, t - 1):
                m = rng.choice([0, 0, 1, rng.randrange(K + 1)])
                lab = seq[p + 1 : p + 1 + K] + [-1] * K
                rows.append([lab[j] if j < m else (lab[j] + 1 if lab[j] >= 0 else 7) for j in range(K)])
            props.append(rows)
        acc = torch.zeros(S, Tmax, dtype=torch.long)
        for i, (seq, p0, t, rows) in enumerate(zip(seqs, P, T, props)):
            if rows:
                at = torch.arange(p0, t - 1)[:, None] + torch.arange(1, K + 1)
                lab = torch.where(at < t, torch.tensor(seq)[at.clamp(max=t - 1)], -1)
                acc[i, p0 : t - 1] = accepted_lengths(torch.tensor(rows), lab)
        w = walk(acc, torch.tensor(P), torch.tensor(T), K)
        for i, c in enumerate(w.counters(K + 1)):
            ref, blocks = replay(seqs[i], P[i], props[i], K + 1)
            assert loop_counters(c) == loop_counters(ref), (K, i)
            assert w.visited[i].nonzero()[:, 0].tolist() == [b.anchor_pos for b in blocks]
