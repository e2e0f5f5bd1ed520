"""The online DFlash loop (greedy, batch 1): draft with the drafter, verify with the target.

This is what the offline replay (replay.py) reproduces without running it; tests hold the two
equal step by step, and benchmarks use it for wall-clock speed-up against target-only decoding.

It runs on the static-cache engine (decode.py). State per step, anchor at position p: the
target's cache holds positions < p, the feature buffer the taps of every committed position < p.
- draft: the drafter reads the block [anchor, mask, ..., mask] at positions p .. p+B-1 and the
  features of positions < p (on CUDA the whole buffer, the rest hidden by the drafter's own mask
  t < p); its K proposals (rows 1..B-1; every row in DSpark's anchor convention) go to `out[:K]`
  (dflash.models.drafter.dflash2.propose: the greedy tokens, DFlash2's selector walk or DSpark's Markov rollout
  from the anchor, the rule the offline replay uses).
- verify: the target runs on [anchor, d_1 .. d_K] at positions p .. p+K; its greedy choice
  after each slot goes to `out[K:]`, the taps of all K+1 slots into the feature buffer (those past
  the accepted ones are hidden from the next draft and overwritten later).
- the host reads `out` (the step's one synchronisation), accepts the longest prefix of drafts that
  equals the target's choices (a tokens), commits them plus the bonus choice, and rolls the cache
  back to p + a + 1 positions: for attention a new write position; for Gated DeltaNet layers the
  saved state re-advanced over the kept tokens (Engine.rollback). The bonus token is the next anchor.
On CUDA draft and verify are each one CUDA graph (optionally compiled), captured once per
`OnlineDecoder` and replayed for every step of every prompt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dflash.models.drafter.dflash2 import propose
from dflash.models.drafter.model import DFlashDrafter
from dflash.models.engine.decode import Engine
from dflash.models.target.model import Target
from dflash.models.target.sampling import Sampling, pick, prompt_key
from dflash.stages.metrics import Counters, count_step
from dflash.stages.replay.loop import Block
from dflash.util.progress import Progress


@dataclass
class SpecOutput:
    tokens: list[int]  # generated tokens (EOS included when reached)
    counters: Counters
    blocks: list[Block] = field(default_factory=list)


class OnlineDecoder:
    """Target + drafter on one static engine for prompts of at most `max_len` positions in all
    (prompt + new tokens); draft and verify captured once. The drafter's block has B rows and K proposals (B - 1, or
    B in DSpark's anchor convention); a verify step runs the target on W = K + 1 tokens."""

    def __init__(
        self,
        target: Target,
        drafter: DFlashDrafter,
        max_len: int,
        backend: str = "sdpa",
        graphs: bool | None = None,
        compile: bool = False,
        sampling: Sampling = Sampling(),
    ):
        cfg = drafter.cfg
        self.target, self.drafter, self.backend = target, drafter, backend
        self.B, self.K, self.W = cfg.block_size, cfg.proposals, cfg.width  # drafter rows, drafts, verify width
        self.margin = max(self.B, self.W)  # positions past the committed ones a step writes or reads
        self.eng = eng = Engine(
            target, 1, max_len + self.margin, taps=cfg.target_layer_ids, graphs=graphs, compile=compile
        )
        dev, L, B, W = eng.device, eng.max_len, self.B, self.W
        ddev, ddt = drafter.fc.weight.device, drafter.fc.weight.dtype
        self.feats = torch.zeros(1, L, cfg.num_taps * target.hidden_size, dtype=ddt, device=ddev)  # [1, L, n*H]
        self.anchor = torch.zeros(1, dtype=torch.long, device=dev)  # [1] anchor token
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # [1] anchor position
        self.masks = torch.full((B - 1,), cfg.mask_token_id, dtype=torch.long, device=dev)
        self.slots = torch.arange(W, device=dev)
        self.sampling = (
            sampling  # T > 0: z-lab's rule; the target samples each verified slot (position-keyed, as the references)
        )
        self.key = torch.zeros(W, dtype=torch.long, device=dev)  # [W] the prompt's noise key, one per slot
        self.out = torch.zeros(2 * W - 1, dtype=torch.long, device=dev)  # [draft (K) | target's choices (K + 1)]
        self.eos = set(target.eos_ids)
        self.draft = eng.capture(self._draft, "draft")
        self.verify = eng.capture(self._verify, "verify")

    def _draft(self) -> None:
        ddev, ddt = self.feats.device, self.feats.dtype
        block = torch.cat([self.anchor, self.masks])  # [B]
        emb = self.drafter.embed(self.target.embed, block)[None, None].to(ddev, ddt)  # [1, 1, B, H]
        h = self.drafter(
            self.feats[:, : self.eng.view], emb, self.pos[None].to(ddev), backend=self.backend
        )  # [1, 1, B, H]
        self.out[: self.K] = propose(
            self.drafter, self.eng.head, h[0, :, self.drafter.cfg.offset :].to(self.target.dtype), self.anchor
        ).tokens[0]

    def _verify(self) -> None:
        write = self.pos + self.slots  # [W] cache positions p .. p+K
        ids = torch.cat([self.anchor, self.out[: self.K]])[None]  # [1, W]
        self.eng.save_state()
        h, taps = self.eng.forward(ids, write)  # [1, B, H], [1, B, n*H]
        if self.sampling.greedy:
            self.out[self.K :] = self.eng.greedy(h[0])
        else:  # slot i predicts the token at absolute position p + 1 + i
            self.out[self.K :] = pick(self.eng.head(h[0]), self.sampling, self.key, self.pos + 1 + self.slots)
        self.feats.index_copy_(1, write.to(self.feats.device), taps.to(self.feats.device, self.feats.dtype))

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int) -> SpecOutput:
        K, W, eng = self.K, self.W, self.eng
        if len(prompt) + max_new_tokens + self.margin > eng.max_len:
            raise ValueError(
                f"{len(prompt)} prompt + {max_new_tokens} new tokens exceed the decoder's {eng.max_len - self.margin} "
                "positions"
            )
        sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        self.key.fill_(prompt_key(prompt, self.sampling.seed))
        first, taps = eng.prefill(
            [prompt],
            choose=None
            if self.sampling.greedy
            else lambda z: pick(z, self.sampling, self.key[:1], torch.tensor([len(prompt)], device=z.device)),
        )
        P = len(prompt)
        self.feats[:, :P] = taps.to(self.feats.device, self.feats.dtype)
        gen = [int(first[0])]
        c = Counters(block_size=W, prompts=1, new_tokens=1)
        blocks = []
        pos = P  # anchor position: the cache and the features cover positions < pos
        self.anchor.fill_(gen[0])
        self.pos.fill_(pos)
        bar = Progress("online", total=max_new_tokens, unit="tok")
        bar.update(1)
        while len(gen) < max_new_tokens and gen[-1] not in self.eos:
            self.draft(view=pos)
            self.verify(view=pos + W)
            out = self.out.tolist()
            draft, choice = out[:K], out[K:]
            a = 0
            while a < K and draft[a] == choice[a]:
                a += 1
            commit = draft[:a] + [choice[a]]
            for i, t in enumerate(commit):  # stop at EOS or the token limit
                if t in self.eos or len(gen) + i + 1 >= max_new_tokens:
                    commit = commit[: i + 1]
                    break
            acc = min(a, len(commit))
            count_step(c, acc, len(commit))
            blocks.append(Block(pos, draft, acc))
            bar.update(len(commit), tau=f"{c.committed / c.steps:.2f}")
            kept = [gen[-1]] + draft[:a]  # the anchor and the accepted drafts
            gen += commit
            if len(gen) >= max_new_tokens or gen[-1] in self.eos:
                break
            if a < K:  # a cut block: recurrent state back to the kept tokens
                eng.rollback(pos, kept)
            pos += a + 1
            self.anchor.fill_(gen[-1])
            self.pos.fill_(pos)
        sync()
        c.wall_s = time.perf_counter() - t0
        bar.close()
        return SpecOutput(gen, c, blocks)


def speculative_generate(
    target: Target,
    drafter: DFlashDrafter,
    prompt: list[int],
    max_new_tokens: int,
    backend: str = "sdpa",
    graphs: bool | None = None,
    compile: bool = False,
    sampling: Sampling = Sampling(),
) -> SpecOutput:
    """One prompt through a fresh OnlineDecoder (several prompts: build one and call .generate)."""
    dec = OnlineDecoder(target, drafter, len(prompt) + max_new_tokens, backend, graphs, compile, sampling)
    return dec.generate(prompt, max_new_tokens)
