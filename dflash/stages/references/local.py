"""Local references: the target's own completions, batched (dflash.stages.references.collect caches and checks them).

`greedy_generate` decodes prompts in batches of similar lengths (`generator.length_batches`) with left
padding: on CUDA the static-cache engine of dflash.models.engine.decode (CUDA graphs; inductor first when
`references.compile=auto` finds enough work: `generator.choose_compile`, its set-up reported apart), elsewhere
a dynamic KV cache that hands each row over as it stops. Greedy, or sampled at temperature > 0 with the
position-keyed sampler of dflash.models.target.sampling, so the output does not depend on the batch.
Progress counts tokens as they are decoded (every decode step on the dynamic cache, every few on the
engine), so a batch whose prompts all run long is never silent until it ends.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from dflash.config.schema import ReferencesConfig
from dflash.models.engine.generator import choose_compile, decode_steps, length_batches
from dflash.models.target.forward import forward, new_cache
from dflash.models.target.sampling import Sampling, pick, row_keys
from dflash.util.progress import Progress, log

COMPILE_MIN_STEPS = (
    ReferencesConfig.compile_min_steps
)  # references.compile=auto's threshold (the measured break-even: docs/results-full.md)


@torch.no_grad()
def greedy_generate(
    target: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    batch_size: int = 16,
    on_done: Callable[[int, list[int]], None] | None = None,
    compile: bool | str = False,
    compile_min_steps: int = COMPILE_MIN_STEPS,
    on_engine: Callable[[str, float | None], None] | None = None,
    sampling: Sampling = Sampling(),
) -> list[list[int]]:
    """Greedy completions (or sampled: `sampling`, position-keyed, so independent of the batch;
    EOS included when reached), batched with left padding. `on_done(i,
    completion)` runs as each prompt finishes: on CPU as each row stops, with CUDA's static-cache
    engine (generator.Generator, CUDA graphs; `compile`: inductor first, true / false / auto as
    generator.choose_compile rules) as each batch ends. `on_engine(label, setup seconds or None: no engine
    built)` hears how it runs, once, before the first token."""
    out: list[list[int]] = [[] for _ in prompts]
    if not prompts:
        return out
    finished = 0
    b = min(batch_size, len(prompts))
    comp, why = choose_compile(compile, decode_steps(len(prompts), b, max_new_tokens), compile_min_steps)
    t0 = time.perf_counter()
    engine = _static_engine(target, b, max(map(len, prompts)), max_new_tokens, comp, sampling)
    setup = time.perf_counter() - t0
    label = (
        f"static cache{', CUDA graphs' if engine.eng.graphs else ''}, {'compiled' if comp else 'not compiled'} ({why})"
        if engine
        else "dynamic cache"
    )
    if on_engine is not None:
        on_engine(label, setup if engine else None)
    log.info(
        "generate: %d prompts, batches of %d, %d new tokens at most, %s%s",
        len(prompts),
        b,
        max_new_tokens,
        label,
        f"; engine set-up {setup:.1f} s" if engine else "",
    )
    with Progress(
        "generate", total=len(prompts) * max_new_tokens, unit="tok"
    ) as bar:  # the budget; rows that stop early shrink it

        def tick(n: int) -> None:  # n more tokens decoded: every decode step (CPU) or every few (the engine)
            bar.update(n, prompts=f"{finished}/{len(prompts)} done")

        def finish(i: int, comp: list[int]) -> None:
            nonlocal finished
            out[i] = comp
            finished += 1
            bar.shrink_total(max_new_tokens - len(comp))
            if on_done is not None:
                on_done(i, comp)

        try:
            for rows in length_batches(prompts, engine.eng.batch if engine else batch_size):
                if engine is not None:
                    for i, comp in zip(rows, engine([prompts[i] for i in rows], on_tokens=tick)):
                        finish(i, comp)
                else:
                    _dynamic_batch(
                        target,
                        [prompts[i] for i in rows],
                        max_new_tokens,
                        lambda r, comp: finish(rows[r], comp),
                        sampling,
                        tick,
                    )
        finally:
            if engine is not None:
                # its GPU memory now, not at the next cyclic collection (a training run builds one per shard)
                engine.close()
    return out


def _static_engine(
    target: Any,
    batch: int,
    max_prompt: int,
    max_new_tokens: int,
    compile: bool = False,
    sampling: Sampling = Sampling(),
) -> Any:
    """generator.Generator (static cache, CUDA graphs) on CUDA where it supports the target, else None."""
    if target.device.type != "cuda":
        return None
    from dflash.models.engine.decode import unsupported
    from dflash.models.engine.generator import Generator

    return (
        Generator(target, batch, max_prompt, max_new_tokens, compile=compile, sampling=sampling)
        if unsupported(target.config) is None
        else None
    )


def _dynamic_batch(
    target: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    finish: Callable[[int, list[int]], None],
    sampling: Sampling = Sampling(),
    tick: Callable[[int], None] | None = None,
) -> None:
    """One left-padded batch on a dynamic KV cache; finish(row, completion) as each row stops; tick(n) after
    every decode step, n: the tokens it produced (rows still running)."""
    dev = target.device
    keys = row_keys(prompts, sampling.seed, dev)  # [b]
    at = torch.tensor([len(p) for p in prompts], device=dev)  # [b] absolute position of the next token
    eos = torch.tensor(target.eos_ids, device=dev)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else target.eos_ids[0]
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), pad, dtype=torch.long, device=dev)
    mask = torch.zeros((len(prompts), P), dtype=torch.long, device=dev)
    for r, p in enumerate(prompts):
        ids[r, P - len(p) :] = torch.tensor(p)
        mask[r, P - len(p) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, P]
    cache = new_cache(target)
    logits = forward(target, ids, cache, attention_mask=mask, position_ids=pos).logits[:, -1]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=dev)  # [b] row reached EOS
    reported = done.clone()  # [b] row handed to finish
    steps: list[torch.Tensor] = []
    for step in range(max_new_tokens):
        nxt = pick(logits, sampling, keys, at + step)  # [b]
        steps.append(torch.where(done, -1, nxt))
        if tick is not None:
            tick(int((~done).sum()))
        done |= torch.isin(nxt, eos)
        last = step == max_new_tokens - 1
        ready = ~reported if last else done & ~reported
        if bool(ready.any()):
            hist = torch.stack(steps, dim=1).tolist()  # [b, step + 1]
            for r in ready.nonzero().flatten().tolist():
                finish(r, [t for t in hist[r] if t >= 0])
            reported |= ready
            if last or bool(reported.all()):
                break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        pos = pos[:, -1:] + 1
        logits = forward(target, nxt[:, None], cache, attention_mask=mask, position_ids=pos).logits[:, -1]
