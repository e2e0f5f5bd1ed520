"""Decoding prompts in batches on the static-cache engine (dflash/models/engine/decode.py): `Generator`.

`Generator` decodes up to `batch` prompts at a time, greedy or position-keyed sampled
(dflash/models/target/sampling.py), stopping each row at EOS. Its step is one captured function (a CUDA
graph on CUDA). Finished rows stay in their batch, masked: they feed a pad token and record
nothing. A step's time hardly depends on the rows (measured: the engine's batch-1 and
batch-12 rates in docs/results-full.md), so dropping finished rows would save little; a batch stops once
every row has finished (checked every `Generator.period` steps, the only host synchronisation of
the loop).

`generate` runs every prompt through one Generator in batches of similar lengths
(`length_batches`, the one batching rule of local generation); `choose_compile` is
`references.compile`'s rule (auto: compile when the decode steps pay for it).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from dflash.models.engine.decode import Engine
from dflash.models.target.model import Target
from dflash.models.target.sampling import Sampling, pick, row_keys
from dflash.util.progress import Progress, log

COMPILE_CHOICES = ("auto", "true", "false")


class Generator:
    """Greedy decoding of up to `batch` prompts at a time on one engine, EOS per row.

    The step is one captured function: forward of the last tokens, argmax, record, mark rows that
    reached EOS, feed the next tokens, advance the write position; the host only replays it and
    looks at `done` every `period` steps."""

    def __init__(
        self,
        target: Target,
        batch: int,
        max_prompt: int,
        max_new_tokens: int,
        eos_ids: Sequence[int] | None = None,
        graphs: bool | None = None,
        compile: bool = False,
        period: int = 8,
        sampling: Sampling = Sampling(),
    ):
        self.max_new = max_new_tokens
        self.sampling = sampling  # temperature 0: argmax; else position-keyed Gumbel-max (sampling.py)
        self.eng = eng = Engine(
            target, batch, _round_up(max_prompt + max_new_tokens, 64), graphs=graphs, compile=compile
        )
        dev = eng.device
        self.period = period if eng.graphs else 1
        self.eos = torch.tensor(list(target.eos_ids if eos_ids is None else eos_ids), dtype=torch.long, device=dev)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=dev)  # [b, 1] next input
        self.write = torch.zeros(1, dtype=torch.long, device=dev)  # [1] its cache position
        self.t = torch.zeros(1, dtype=torch.long, device=dev)  # [1] its index in hist
        self.done = torch.zeros(batch, dtype=torch.bool, device=dev)  # [b]
        self.hist = torch.full(
            (batch, max(max_new_tokens, 8)), -1, dtype=torch.long, device=dev
        )  # [b, new] -1: nothing
        self.keys = torch.zeros(batch, dtype=torch.long, device=dev)  # [b] row's noise key (seed, prompt)
        self.at = torch.zeros(batch, dtype=torch.long, device=dev)  # [b] absolute position of the next token
        self.step = eng.capture(self._step, "step")

    def close(self) -> None:
        """Drop the captured step (its CUDA graph and memory pool) and the engine's cache now: the step's bound
        method makes a reference cycle, which only Python's cyclic collector would free, after any number of
        engines' worth of GPU memory."""
        self.step = None  # type: ignore[assignment]
        self.eng = None  # type: ignore[assignment]

    def _step(self) -> None:
        h, _ = self.eng.forward(self.ids, self.write)  # [b, 1, H]
        nxt = (
            self.eng.greedy(h[:, -1])
            if self.sampling.greedy
            else pick(self.eng.head(h[:, -1]), self.sampling, self.keys, self.at)
        )  # [b]
        self.at += 1
        self.hist.index_copy_(1, self.t, torch.where(self.done, -1, nxt)[:, None])
        self.done |= torch.isin(nxt, self.eos)
        self.ids.copy_(torch.where(self.done, 0, nxt)[:, None])
        self.write += 1
        self.t += 1

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]], on_tokens: Callable[[int], None] | None = None) -> list[list[int]]:
        """Greedy completions of len(prompts) <= batch prompts (EOS included when reached). `on_tokens(n)`:
        n more tokens recorded, heard every `period` steps (where the loop looks at `done` anyway) and at the end."""
        if max(map(len, prompts)) + self.max_new > self.eng.max_len:
            raise ValueError(
                f"a {max(map(len, prompts))}-token prompt + {self.max_new} new tokens exceed the engine's "
                f"{self.eng.max_len} positions"
            )
        rows = list(prompts) + [[0]] * (self.eng.batch - len(prompts))
        self.keys.copy_(row_keys(rows, self.sampling.seed, self.keys.device))
        self.at.copy_(torch.tensor([len(r) for r in rows]))
        first, _ = self.eng.prefill(
            prompts, choose=None if self.sampling.greedy else lambda z: pick(z, self.sampling, self.keys, self.at)
        )
        self.at += 1
        P = self.eng.length
        real = torch.arange(self.eng.batch, device=first.device) < len(prompts)
        self.done.copy_(~real)
        self.hist.fill_(-1)
        self.hist[:, 0] = torch.where(real, first, -1)
        self.done |= torch.isin(first, self.eos)
        self.ids.copy_(torch.where(self.done, 0, first)[:, None])
        self.write.fill_(P)
        self.t.fill_(1)
        heard = 0

        def tell() -> None:  # the tokens recorded since the last call
            nonlocal heard
            n = int((self.hist[: len(prompts)] >= 0).sum())
            on_tokens(n - heard)  # type: ignore[misc]
            heard = n

        for s in range(1, self.max_new):
            if (s - 1) % self.period == 0:
                if on_tokens is not None:
                    tell()
                if bool(self.done.all()):
                    break
            self.step(view=P + s)
        if on_tokens is not None:
            tell()
        return [[t for t in row if t >= 0] for row in self.hist[: len(prompts), : self.max_new].tolist()]


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def decode_steps(prompts: int, batch: int, max_new_tokens: int) -> int:
    """Steps the engine runs at most: one per new token of each batch of `batch` rows."""
    return -(-prompts // max(1, min(batch, prompts))) * max_new_tokens if prompts else 0


def choose_compile(choice: bool | str, steps: int, min_steps: int) -> tuple[bool, str]:
    """`references.compile`: true / false as given; auto compiles (inductor before the CUDA graph
    capture) only when the engine will run at least `min_steps` decode steps, where the saving per
    step pays for the compile's set-up (break-even measured by `dflash-bench`). -> (compile, why)."""
    c = str(choice).lower()
    if c not in COMPILE_CHOICES:
        raise ValueError(f"compile={choice!r}: use auto, true or false")
    if c != "auto":
        return c == "true", f"references.compile={c}"
    yes = steps >= min_steps
    return yes, f"auto: {steps} decode steps {'>=' if yes else '<'} references.compile_min_steps={min_steps}"


@torch.no_grad()
def generate(
    target: Target,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch_size: int = 16,
    eos_ids: Sequence[int] | None = None,
    graphs: bool | None = None,
    compile: bool = False,
    generator: Generator | None = None,
) -> list[list[int]]:
    """Greedy completions on a static cache, batches of similar prompt lengths (EOS included when
    reached). One engine serves every batch; pass `generator` to reuse one across calls."""
    out: list[list[int]] = [[] for _ in prompts]
    if not prompts:
        return out
    b = min(batch_size, len(prompts))
    gen = generator or Generator(target, b, max(len(p) for p in prompts), max_new_tokens, eos_ids, graphs, compile)
    b = gen.eng.batch
    log.info(
        "generate: %d prompts, batches of %d, %d new tokens at most, %s",
        len(prompts),
        b,
        max_new_tokens,
        "CUDA graphs" + (" (compiled)" if gen.eng.compile else "") if gen.eng.graphs else "eager",
    )
    try:
        with Progress(
            "generate", total=len(prompts) * max_new_tokens, unit="tok"
        ) as bar:  # the budget; rows that stop early shrink it
            for rows in length_batches(prompts, b):
                for i, comp in zip(rows, gen([prompts[i] for i in rows], on_tokens=bar.update)):
                    out[i] = comp
                    bar.shrink_total(max_new_tokens - len(comp))
    finally:
        if generator is None:
            gen.close()
    return out


def length_batches(prompts: list[list[int]], batch: int) -> list[list[int]]:
    """Indices of the prompts in batches of `batch`, by length (shortest first): little padding per batch.
    The one batching rule of local generation (references, the engine, the speed benchmarks)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    return [order[b0 : b0 + batch] for b0 in range(0, len(order), batch)]
