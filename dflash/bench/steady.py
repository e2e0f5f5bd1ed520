"""The scale bench's stages again in the same process, and what bounds them (dflash/bench/scale.py's child runs these).

The first evaluation in a process pays for kernels compiled and autotuned (fla's Triton kernels, the
engine's capture); every later one runs warm. `steady(cfg, taps)` runs the references stage again (a new
engine regenerating every reference: `references.refresh`) and the features stage again (their memory memo
and disk cache emptied), both timed as the pipeline times them; the features twice, one sequence per target
pass and batched (`features.batch_tokens`), each after one untimed pass at its batching (a batch's new shapes compile
and autotune fla's kernels anew), so one run says which the device prefers. `against_floors` holds
each steady time against its floor on the same device (dflash/bench/floors.py): the feature pass against its linear
layers' arithmetic at the GEMM rate, a decode step of the references against one read of the weights at
the copy rate. `profiles` (`--scale-profile`) gives the top ops of a steady feature pass and of a few
decode steps. Times are reported, never asserted.
"""

from __future__ import annotations

import shutil
from collections import Counter, deque
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from dflash.bench.floors import floors, top_ops
from dflash.config.schema import BATCH_TOKENS_CUDA, EvalConfig
from dflash.evaluation import pipeline
from dflash.models.engine.generator import decode_steps
from dflash.stages.features import FeatureStats, iter_features
from dflash.stages.references.turns import turn_of
from dflash.util.memo import PROCESS


def sequences(prep: pipeline.Prepared) -> list[list[int]]:
    """What the feature pass runs over: every prompt + its reference."""
    return [x + r for x, r in zip(prep.ids, prep.refs)]


def steady(cfg: EvalConfig, taps: list[int]) -> tuple[dict[str, Any], pipeline.Prepared]:
    """The references and features stages again in this process, kernels now compiled and autotuned: a new engine
    regenerating every reference (`references.refresh`), the features computed again with their memory memo and
    disk cache emptied (as the first run found them), with the configured `features.batch_tokens` (resolved for the
    device)
    and then the other batching (`_other_batching`). -> their timings, and what they prepared."""
    timings: dict[str, float] = {}
    prep = pipeline.prepare_run(pipeline.plan(replace(cfg, references=replace(cfg.references, refresh=True))), timings)
    bt = cfg.features.batch(prep.target.device.type == "cuda")
    stats, other = _features_again(cfg, prep, taps, bt), _other_batching(bt)
    alt = _features_again(cfg, prep, taps, other)
    return dict(
        references=timings["references"],
        references_setup=timings.get("references_setup"),
        generated=prep.ref_stats.generated,
        features=stats.seconds,
        feature_tokens=stats.computed_tokens,
        batch_tokens=bt,
        features_other=alt.seconds,
        batch_tokens_other=other,
    ), prep


def _other_batching(batch_tokens: int | None) -> int | None:
    """The feature pass's other batching, timed beside the configured one: batched if it runs one sequence per pass,
    else not."""
    return BATCH_TOKENS_CUDA if batch_tokens is None else None


def _features_again(
    cfg: EvalConfig, prep: pipeline.Prepared, taps: list[int], batch_tokens: int | None
) -> FeatureStats:
    """The features stage again with its memory memo and disk cache emptied (as the first run found them), timed after
    one
    untimed pass at this batching (its shapes' kernels compiled and autotuned, as in any later evaluation)."""
    for _ in range(2):
        PROCESS.memo("features").clear()
        shutil.rmtree(Path(cfg.cache_dir, "features"), ignore_errors=True)
        stats = FeatureStats()
        kw = {**vars(cfg.features), "batch_tokens": batch_tokens}
        deque(iter_features(prep.target, sequences(prep), [taps], cfg.cache_dir, stats=stats, **kw), maxlen=0)
    return stats


def at_threads(cfg: EvalConfig, prep: pipeline.Prepared, taps: list[int], n: int) -> dict[str, float]:
    """The steady features (the configured batching) and the default replay again with n CPU threads: with the run's
    own thread count, two points of t(n) = serial + parallel / n (`threads_rows`)."""
    was = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        features = _features_again(cfg, prep, taps, cfg.features.batch(prep.target.device.type == "cuda")).seconds
        replay = pipeline.run(cfg).timings["replay"]
    finally:
        torch.set_num_threads(was)
    return dict(threads=n, features=features, replay=replay)


def amdahl(n1: int, t1: float, n2: int, t2: float, n: int) -> float:
    """t(n) = s + p / n through (n1, t1) and (n2, t2), at n (s and p clamped at 0)."""
    p = max(0.0, (t1 - t2) / (1 / n1 - 1 / n2))
    return max(0.0, t1 - p / n1) + p / n


def floors_of(prep: pipeline.Prepared, taps: list[int], tokens: int) -> dict[str, Any]:
    """bench_floors.floors for the prepared target: the arithmetic of the layers a feature pass runs (0 to the deepest
    tap) over `tokens`, one read of all its weights."""
    ran = torch.nn.ModuleList(prep.target.model.get_decoder().layers[: max(taps) + 1])
    return dict(floors(prep.target.model, ran, tokens), layers=len(ran))


def reference_steps(prep: pipeline.Prepared, batch: int, max_new_tokens: int) -> int:
    """Decode steps the references stage runs at most: per round of turns, a step per new token of each batch."""
    return sum(decode_steps(n, batch, max_new_tokens) for n in Counter(turn_of(p) for p in prep.prompts).values())


def decode_loop(target: Any, prompts: list[list[int]], steps: int) -> Callable[[], None] | None:
    """`steps` greedy decode steps of the references engine run eagerly (the ops its CUDA graph replays), after a
    prefill of `prompts` and one warm step; None where the engine does not take the target."""
    from dflash.models.engine.decode import Engine, unsupported

    if unsupported(target.config) is not None:
        return None
    eng = Engine(target, len(prompts), max(map(len, prompts)) + steps + 2, graphs=False)
    state = dict(tok=eng.prefill(prompts)[0], at=eng.length)

    @torch.no_grad()
    def step() -> None:
        at = state["at"]
        h, _ = eng.forward(state["tok"][:, None], eng.positions[at : at + 1], view=at + 1)  # [b, 1, H]
        state.update(tok=eng.greedy(h[:, -1]), at=at + 1)

    def run() -> None:
        for _ in range(steps):
            step()

    step()
    return run


def profiles(cfg: EvalConfig, prep: pipeline.Prepared, taps: list[int], steps: int = 8) -> dict[str, str]:
    """`--scale-profile`: the top ops of a steady feature pass (nothing cached or kept) and of `steps` decode steps."""
    t, fc = prep.target, cfg.features

    def feature_pass(bt: int | None) -> Callable[[], Any]:
        return lambda: deque(
            iter_features(
                t, sequences(prep), [taps], cfg.cache_dir, cache=False, chunk_tokens=fc.chunk_tokens, batch_tokens=bt
            ),
            maxlen=0,
        )

    bt = fc.batch(t.device.type == "cuda")
    other = _other_batching(bt)
    out = {
        "feature pass": top_ops(feature_pass(bt), t.device),
        f"feature pass with features.batch_tokens={other}": top_ops(feature_pass(other), t.device),
    }
    loop = decode_loop(t, prep.ids[: cfg.references.batch_size], steps)
    if loop is not None:
        out[f"{steps} decode steps (eager) at batch {min(cfg.references.batch_size, len(prep.ids))}"] = top_ops(
            loop, t.device
        )
    return out


def per_step(references: float, setup: float | None, steps: int) -> float:
    """Seconds per decode step of a references stage, its engine's set-up apart (prefill included)."""
    return (references - (setup or 0.0)) / max(1, steps)


def steady_rows(r: dict[str, Any], stage: str) -> list[tuple[str, float | None, str]]:
    """The table's rows of `stage` (references or features) run again in the process (`steady`), under its first
    use's."""
    s, t, n = r.get("steady"), r["timings"], r.get("reference_steps", 0)
    if s is None:
        return []
    if stage == "features":

        def how(bt: int | None) -> str:
            return "one sequence per pass" if bt is None else f"batched, features.batch_tokens={bt}"

        rows = [
            (
                f"features, steady (caches emptied, kernels warm; {how(s.get('batch_tokens'))})",
                s["features"],
                f"{s['feature_tokens'] / s['features']:.1f} tok/s",
            )
        ]
        if s.get("features_other") is not None:
            rows.append(
                (
                    f"features, steady, {how(s['batch_tokens_other'])}",
                    s["features_other"],
                    f"{s['feature_tokens'] / s['features_other']:.1f} tok/s = "
                    f"{s['features_other'] / s['features']:.2f}x the row above",
                )
            )
        return rows
    first = per_step(t["references"], t.get("references_setup"), n)
    return [
        (
            "references, steady (again: a new engine, kernels warm)",
            s["references"],
            f"{per_step(s['references'], s['references_setup'], n) * 1e3:.2f} ms per step after set-up "
            f"({first * 1e3:.2f} ms at first "
            f"use; {n} steps, prefill included)",
        ),
        ("  of which engine set-up", s["references_setup"], ""),
    ]


def against_floors(r: dict[str, Any]) -> list[str]:
    """Each steady stage against its floor on this device (dflash/bench/floors.py), then the profiles' tables."""
    f, s = r.get("floors"), r.get("steady")
    if f is None or s is None:
        return []
    step = per_step(s["references"], s["references_setup"], r["reference_steps"])
    M, K, N = f["gemm_shape"]
    lines = [
        f"  floors on {r['device']}: bf16 GEMM [{M} x {K}] @ [{K} x {N}] {f['gemm_tflops']:.1f} TFLOP/s; copy "
        f"{f['copy_gbps']:.1f} GB/s "
        "(read + written)",
        f"  features steady / arithmetic floor = {s['features']:.3f} / {f['arithmetic_s']:.3f} s = "
        f"{s['features'] / f['arithmetic_s']:.1f}x "
        f"(2 x the linear weights of layers 0..{f['layers'] - 1} x {s['feature_tokens']} tokens = "
        f"{f['forward_flops'] / 1e12:.3g} TFLOP)",
        f"  references per step / weight-read floor = {step * 1e3:.2f} / {f['weight_read_s'] * 1e3:.2f} ms = "
        f"{step / f['weight_read_s']:.1f}x "
        f"({f['weight_bytes'] / 1e9:.3g} GB of weights read once per step)",
    ]
    unit = "self CUDA time" if r["device"].startswith("cuda") else "self CPU time"
    for name, table in r.get("profiles", {}).items():
        lines.append(f"  profile, {name}, steady (top ops by {unit}):")
        lines += [f"    {x}" for x in table.splitlines()]
    return lines
