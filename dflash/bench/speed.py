"""Generation speed, measured in one run: the engine (decode.py) against transformers' `generate`,
and the online DFlash loop against target-only decoding. Returns plain dataclasses; prints nothing.

    bench_generation(target, prompts, max_new_tokens, batches=(1, 12))   -> GenerationBench
    bench_online(target, drafter, prompts, max_new_tokens)                -> OnlineBench
    format_generation(g), format_online(o)                                -> report lines

Methods: `hf_dynamic` = `generate(do_sample=False)` with its default cache; `hf_static` = the same
with `cache_implementation="static"` (transformers compiles its decoding step on CUDA); `engine` =
`generator.Generator` (CUDA graphs; `engine+inductor` with compile=True); `dflash` = the online loop
(`speculative.OnlineDecoder`) at batch 1, whose baseline `target_only` is the engine at batch 1.
Every method runs once untimed (compilation, capture, allocator warm-up: `setup_s`, reported
apart), then once timed over the same prompts. Tokens are counted up to and including EOS.
Batch 1 runs the prompts one after another; batch b splits them into batches of similar length.
`same_as_hf` is the fraction of completions identical to `hf_dynamic`'s at the same batch size
(float32: all of them; bfloat16: rounding differs between kernels, so some drift apart).

The online loop's time per step is split into its draft and verify passes (CUDA events over
repeated replays at one position) and the rest (host: reading the step's result, acceptance,
rollback), so the speed at another acceptance length τ follows: τ / (time per step). What is
undefined (τ and the time per step with no verify step, a speed over no time) is None, printed "-".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dflash.models.drafter.model import DFlashDrafter
from dflash.models.engine.generator import Generator, length_batches
from dflash.models.target.model import Target
from dflash.online.speculative import OnlineDecoder
from dflash.stages.metrics import ratio
from dflash.util.progress import log


@dataclass
class Rate:
    method: str
    batch: int
    tokens: int  # generated, up to and including EOS
    seconds: float  # the timed run
    setup_s: float = 0.0  # one-time cost: compile, capture, first-call overhead

    @property
    def tok_s(self) -> float | None:
        return ratio(self.tokens, self.seconds)  # None: nothing timed


@dataclass
class GenerationBench:
    device: str
    dtype: str
    prompts: int
    max_new_tokens: int
    rates: list[Rate] = field(default_factory=list)
    same_as_hf: dict[str, float] = field(default_factory=dict)  # "method@batch" -> fraction identical to hf_dynamic
    setup_detail: dict[str, dict[str, float]] = field(default_factory=dict)  # "method@batch" -> Engine.setup_s

    def rate(self, method: str, batch: int) -> Rate | None:
        return next((r for r in self.rates if r.method == method and r.batch == batch), None)


@dataclass
class OnlineBench:
    device: str
    dtype: str
    prompts: int
    max_new_tokens: int
    tau: float | None  # committed tokens per verify step, bonus included; None: no verify step
    same_as_target_only: float = 0.0  # fraction of prompts whose DFlash output equals target-only decoding's
    rates: list[Rate] = field(default_factory=list)  # target_only, dflash (, hf_static) at batch 1
    step_ms: dict[str, float | None] = field(
        default_factory=dict
    )  # target_step, draft, verify, dflash_step, host; None: no step
    setup_detail: dict[str, float] = field(default_factory=dict)

    def rate(self, method: str) -> Rate | None:
        return next((r for r in self.rates if r.method == method), None)

    def predicted_tok_s(self, tau: float) -> float | None:
        """DFlash tokens/s at acceptance length tau, from the measured time per step (None: no step was timed)."""
        step = self.step_ms["dflash_step"]
        return None if step is None else ratio(tau * 1e3, step)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], list[list[int]]]) -> tuple[list[list[int]], float]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def _cut(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@torch.no_grad()
def hf_generate(
    target: Target, prompts: list[list[int]], max_new_tokens: int, batch: int, static: bool
) -> list[list[int]]:
    """transformers' greedy `generate` over left-padded batches (longest batch first, so a static
    cache sized once serves them all)."""
    eos, dev = target.eos_ids, target.device
    out: list[list[int]] = [[] for _ in prompts]
    for rows in reversed(length_batches(prompts, batch)):
        P = max(len(prompts[i]) for i in rows)
        ids = torch.zeros(len(rows), P, dtype=torch.long)
        mask = torch.zeros(len(rows), P, dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, P - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, P - len(prompts[i]) :] = 1
        kw = {"cache_implementation": "static"} if static else {}
        gen = target.model.generate(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else 0,
            **kw,
        )
        for r, i in enumerate(rows):
            out[i] = _cut(gen[r, P:].tolist(), set(eos))
    return out


def _engine_generate(gen: Generator, prompts: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in prompts]
    for rows in length_batches(prompts, gen.eng.batch):
        for i, comp in zip(rows, gen([prompts[i] for i in rows])):
            out[i] = comp
    return out


@torch.no_grad()
def bench_generation(
    target: Target,
    prompts: list[list[int]],
    max_new_tokens: int,
    batches: Sequence[int] = (1, 12),
    compile: bool | None = None,
    hf: bool = True,
) -> GenerationBench:
    """References' speed: engine vs transformers' generate (dynamic and static cache) at each batch
    size. compile: None runs the engine both with and without inductor, True/False one of them."""
    dev = target.device
    res = GenerationBench(str(dev), str(target.dtype).replace("torch.", ""), len(prompts), max_new_tokens)
    variants = [False, True] if compile is None else [compile]
    if dev.type != "cuda":
        variants = [False]  # no graphs to compile on CPU
    for b in batches:
        outs: dict[str, list[list[int]]] = {}
        methods: list[tuple[str, Callable[[], Callable[[], list[list[int]]]]]] = []
        if hf:
            methods.append(
                ("hf_dynamic", lambda: (lambda: hf_generate(target, prompts, max_new_tokens, b, static=False)))
            )
            if dev.type == "cuda":
                methods.append(
                    ("hf_static", lambda: (lambda: hf_generate(target, prompts, max_new_tokens, b, static=True)))
                )
        for comp in variants:

            def make(comp=comp):
                g = Generator(target, b, max(len(p) for p in prompts), max_new_tokens, compile=comp)
                res.setup_detail[f"{'engine+inductor' if comp else 'engine'}@{b}"] = dict(g.eng.setup_s)
                return lambda: _engine_generate(g, prompts)

            methods.append(("engine+inductor" if comp else "engine", make))
        for name, make in methods:
            log.info("bench_generation: %s, batch %d", name, b)
            t0 = time.perf_counter()
            run = make()
            _, first = _timed(dev, run)  # warm-up: compiles, captures
            built = time.perf_counter() - t0 - first
            if name == "hf_static":  # not steady after one call (H200: 249 tok/s timed after one, 303 after two)
                _timed(dev, run)
            outs[name], secs = _timed(dev, run)
            res.rates.append(
                Rate(name, b, sum(len(o) for o in outs[name]), secs, setup_s=built + max(first - secs, 0.0))
            )
        if "hf_dynamic" in outs:
            for name, o in outs.items():
                if name != "hf_dynamic":
                    res.same_as_hf[f"{name}@{b}"] = sum(x == y for x, y in zip(o, outs["hf_dynamic"])) / len(prompts)
    return res


def _event_ms(fn: Callable[[], None], n: int, device: torch.device) -> float:
    """Mean milliseconds of fn over n calls (CUDA events on CUDA, the host clock elsewhere)."""
    fn()
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / n
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) * 1e3 / n


@torch.no_grad()
def bench_online(
    target: Target,
    drafter: DFlashDrafter,
    prompts: list[list[int]],
    max_new_tokens: int,
    compile: bool = True,
    hf_static: bool = True,
    backend: str = "sdpa",
) -> OnlineBench:
    """Batch 1, prompt after prompt: DFlash online vs target-only decoding on the same engine (and
    transformers' static compiled generate on CUDA); the DFlash step split into draft and verify.
    compile: inductor before capture (CUDA only; ~80 s once for SmolLM2's shape on an H200)."""
    dev = target.device
    max_len = max(len(p) for p in prompts) + max_new_tokens
    res = OnlineBench(str(dev), str(target.dtype).replace("torch.", ""), len(prompts), max_new_tokens, tau=None)

    t0 = time.perf_counter()
    gen = Generator(target, 1, max(len(p) for p in prompts), max_new_tokens, compile=compile)
    run = lambda: [gen([p])[0] for p in prompts]  # noqa: E731
    _, first = _timed(dev, run)
    setup = time.perf_counter() - t0 - first
    base, secs = _timed(dev, run)
    res.rates.append(Rate("target_only", 1, sum(map(len, base)), secs, setup_s=setup + max(first - secs, 0.0)))
    res.setup_detail.update({f"target_only_{k}": v for k, v in gen.eng.setup_s.items()})

    t0 = time.perf_counter()
    dec = OnlineDecoder(target, drafter, max_len, backend, compile=compile)
    setup = time.perf_counter() - t0
    for p in prompts[:1]:
        dec.generate(p, max_new_tokens)  # warm-up
    _sync(dev)
    outs = []
    t0 = time.perf_counter()
    for p in prompts:
        outs.append(dec.generate(p, max_new_tokens))
    _sync(dev)
    secs = time.perf_counter() - t0
    tokens, steps = sum(len(o.tokens) for o in outs), sum(o.counters.steps for o in outs)
    res.tau = ratio(sum(o.counters.committed for o in outs), steps)
    res.rates.append(Rate("dflash", 1, tokens, secs, setup_s=setup))
    res.setup_detail.update({f"dflash_{k}": v for k, v in dec.eng.setup_s.items()})
    res.same_as_target_only = sum(o.tokens == b for o, b in zip(outs, base)) / len(prompts)

    pos = len(prompts[-1]) + 1  # time the passes alone, at one position (replays do not move it)
    dec.pos.fill_(pos)
    draft = res.step_ms["draft"] = _event_ms(lambda: dec.draft(view=pos), 50, dev)
    verify = res.step_ms["verify"] = _event_ms(lambda: dec.verify(view=pos + dec.W), 50, dev)
    step = res.step_ms["dflash_step"] = ratio(secs * 1e3, steps)
    res.step_ms["host"] = None if step is None else step - draft - verify
    t = res.rate("target_only")
    res.step_ms["target_step"] = ratio(t.seconds * 1e3, t.tokens)

    if hf_static and dev.type == "cuda":
        run = lambda: hf_generate(target, prompts, max_new_tokens, 1, static=True)  # noqa: E731
        _, first = _timed(dev, run)
        _timed(dev, run)  # not steady after one call (H200: 249 tok/s timed after one, 303 after two)
        out, secs = _timed(dev, run)
        res.rates.append(Rate("hf_static", 1, sum(map(len, out)), secs, setup_s=max(first - secs, 0.0)))
    return res


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)  # undefined (nothing timed, no verify step): "-", never 0


def _x(a: float | None, b: float | None) -> str:
    """a / b as a speed-up, "-" where either is undefined."""
    return _f(None if a is None or b is None else ratio(a, b), ".2f")


def format_generation(g: GenerationBench) -> str:
    lines = [f"generation ({g.device}, {g.dtype}, {g.prompts} prompts, {g.max_new_tokens} new tokens at most):"]
    for r in g.rates:
        same = g.same_as_hf.get(f"{r.method}@{r.batch}")
        hf_s = g.rate("hf_static", r.batch)
        vs = f", {_x(r.tok_s, hf_s.tok_s)}x hf_static" if hf_s and r.method != "hf_static" and hf_s.tok_s else ""
        lines.append(
            f"  {r.method:<16} batch {r.batch:>3}: {_f(r.tok_s, '.1f'):>9} tok/s ({r.tokens} tokens in {r.seconds:.2f} "
            f"s{vs})"
            f", setup {r.setup_s:.1f} s" + (f", same as hf_dynamic {same:.0%}" if same is not None else "")
        )
    return "\n".join(lines)


def format_online(o: OnlineBench, taus: Sequence[float] = (1.8, 3.0)) -> str:
    t, d, h = o.rate("target_only"), o.rate("dflash"), o.rate("hf_static")
    s = {k: _f(v, ".3f") for k, v in o.step_ms.items()}
    lines = [
        f"online, batch 1 ({o.device}, {o.dtype}, {o.prompts} prompts, {o.max_new_tokens} new tokens at most):",
        f"  target-only {_f(t.tok_s, '.1f')} tok/s, DFlash {_f(d.tok_s, '.1f')} tok/s at τ {_f(o.tau, '.2f')} (same "
        f"output: "
        f"{o.same_as_target_only:.0%} of prompts): {_x(d.tok_s, t.tok_s)}x target-only"
        + (f", {_x(d.tok_s, h.tok_s)}x hf_static ({_f(h.tok_s, '.1f')} tok/s, setup {h.setup_s:.1f} s)" if h else ""),
        f"  per step: target-only {s['target_step']} ms; DFlash {s['dflash_step']} ms = draft {s['draft']} + verify "
        f"{s['verify']} + host {s['host']}; setup: engine {t.setup_s:.1f} s, DFlash {d.setup_s:.1f} s",
        "  predicted from the time per step: "
        + ", ".join(
            f"τ {x}: {_f(o.predicted_tok_s(x), '.0f')} tok/s ({_x(o.predicted_tok_s(x), t.tok_s)}x target-only"
            + (f", {_x(o.predicted_tok_s(x), h.tok_s)}x hf_static)" if h else ")")
            for x in taus
        ),
    ]
    return "\n".join(lines)
