"""The online DFlash loop (greedy, batch 1): draft with the drafter, verify with the target.

This is what the offline replay (replay.py) reproduces without running it; tests hold the two
equal step by step, and benchmarks use it for wall-clock speedup against target-only decoding.

State per step: the target's KV cache holds positions < anchor; `feats` holds the taps of every
committed position < anchor. The verify pass runs the target on [anchor, d_1 .. d_{B-1}] at
positions anchor .. anchor+B-1; the anchor's and the accepted tokens' taps come from that pass,
the cache is cropped back to them, and the bonus token becomes the next anchor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dflash.drafter import DFlashDrafter
from dflash.metrics import Counters
from dflash.replay import Block
from dflash.target import Target, crop_cache, forward, new_cache, tap


@dataclass
class SpecOutput:
    tokens: list[int]  # generated tokens (EOS included when reached)
    counters: Counters
    blocks: list[Block] = field(default_factory=list)


@torch.no_grad()
def speculative_generate(target: Target, drafter: DFlashDrafter, prompt: list[int], max_new_tokens: int, backend: str = "sdpa") -> SpecOutput:
    t0 = time.perf_counter()
    cfg = drafter.cfg
    B, eos = cfg.block_size, set(target.eos_ids)
    dev = target.device
    ddev, ddt = drafter.fc.weight.device, drafter.fc.weight.dtype
    cache = new_cache(target)
    out = forward(target, torch.tensor([prompt], device=dev), cache, hidden_states=True)
    feats = tap(out.hidden_states, cfg.target_layer_ids)[0]  # [P, n*H] committed positions
    seq = list(prompt) + [int(out.logits[0, -1].argmax())]
    gen = seq[len(prompt) :]
    c = Counters(block_size=B, prompts=1, new_tokens=1)
    blocks = []
    while len(gen) < max_new_tokens and gen[-1] not in eos:
        pos = len(seq) - 1  # anchor position; cache and feats cover positions < pos
        block = torch.tensor([[seq[pos]] + [cfg.mask_token_id] * (B - 1)], device=dev)
        emb = target.embed(block)[None].to(ddev, ddt)  # [1, 1, B, H]
        h = drafter(feats[None].to(ddev, ddt), emb, torch.tensor([[pos]], device=ddev), backend=backend)
        draft = target.lm_head(h[0, 0, 1:].to(target.dtype)).argmax(-1).tolist()  # [B-1]
        out = forward(target, torch.tensor([[seq[pos]] + draft], device=dev), cache, hidden_states=True)
        choice = out.logits[0].argmax(-1).tolist()  # [B] the target's token after each slot
        a = 0
        while a < B - 1 and draft[a] == choice[a]:
            a += 1
        commit = draft[:a] + [choice[a]]
        for i, t in enumerate(commit):  # stop at EOS or the token limit
            if t in eos or len(gen) + i + 1 >= max_new_tokens:
                commit = commit[: i + 1]
                break
        feats = torch.cat([feats, tap(out.hidden_states, cfg.target_layer_ids)[0, : a + 1]])
        crop_cache(cache, pos + a + 1)  # keep the anchor and the accepted drafts
        acc = min(a, len(commit))
        c.steps += 1
        c.drafted += B - 1
        c.accepted += acc
        c.committed += len(commit)
        c.new_tokens += len(commit)
        for k in range(acc):
            c.accepted_at_pos[k] += 1
        c.commit_hist[len(commit)] += 1
        blocks.append(Block(pos, draft, acc))
        seq += commit
        gen += commit
    c.wall_s = time.perf_counter() - t0
    return SpecOutput(gen, c, blocks)
