"""Benchmark: every cost ratio of the evaluator, measured in one run. Prints figures only.

    dflash-bench [--sweep 2] [--sweep-profile] [--online 12] [--online-eager] [--skip generation,scale]
                           [--scale qwen3_8b] [--scale-prompts N] [overrides...]

Sections (each a ratio of two times or sizes measured here, in this run):
1. `sweep`: one evaluation as a new process runs it (target loaded from its converted copy,
   references cached, features computed) against N checkpoints in one process as `-m drafter.step=..`
   runs them (the target loaded once, the features computed once); then a new process whose
   features are on disk, against the first run's feature time; then one more checkpoint with the
   target loaded and the features in memory: the warm cost per checkpoint (`--sweep-profile`: where its
   host seconds go, cProfile). Checkpoints: the N latest steps of `drafter.run_dir` (the same one N
   times for other drafter kinds). Features are computed in a fresh feature cache (the converted
   target and the references are shared).
2. `replay`: the replay stage in each mode (`replay.anchors` all | visited, `replay.tf_stride`) on the same
   features, interleaved, best of 3: seconds, the ratio to `all`, and that the loop's counters agree.
3. `online`: the online draft-verify loop (speculative.py) against target-only decoding on the
   same prompts, batch 1 (speed.bench_online; on CUDA also against transformers' static compiled
   `generate`), and the warm per-checkpoint cost of section 1 against the online loop's time.
4. `generation`: local references' engine against transformers' `generate` (default cache; static
   compiled on CUDA), batch 1 and 12 (speed.bench_generation).
5. `scale`: with a VL shape (`--scale qwen3_6_27b`: dflash/bench/scale.py) every stage of a whole evaluation of a
   random Qwen3.6-27B-shaped checkpoint on each of `--scale-devices`, its ratios and the field's protocol projected;
   otherwise a random target of another shape (`--scale qwen3_8b`, created once under
   `<cache_dir>/bench/`, not committed): the feature pass's peak RSS against the weights' bytes (a
   child process reading the safetensors memory-mapped) and its time on the same token counts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from dflash.bench import scale as bench_scale
from dflash.bench.speed import bench_generation, bench_online, format_generation, format_online
from dflash.config import schema as config_mod
from dflash.config.compose import compose
from dflash.evaluation import pipeline
from dflash.models.drafter.files import list_steps
from dflash.models.target import model as target_mod
from dflash.result import EvalResult
from dflash.stages import features
from dflash.util.errors import UserError, exit_code
from dflash.util.files import atomic_dir, find_path
from dflash.util.memo import PROCESS
from dflash.util.progress import configure, log

SHAPES = {  # random targets for `scale`: transformers config class and fields
    "qwen3_8b": (
        "Qwen3Config",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1e6,
            tie_word_embeddings=False,
        ),
    ),
}


def fresh_process(cfg: config_mod.EvalConfig | None = None) -> None:
    """Forget what this process holds (loaded target, in-memory features), as a new process would;
    with `cfg`, also the features on disk."""
    PROCESS.clear()
    if cfg is not None:
        shutil.rmtree(Path(cfg.cache_dir, "features"), ignore_errors=True)


def timed_run(cfg: config_mod.EvalConfig) -> tuple[float, EvalResult]:
    t = time.perf_counter()
    res = pipeline.run(cfg)
    return time.perf_counter() - t, res


def evaluate_processes(
    cfg: config_mod.EvalConfig, overrides: list[str], jobs: list[config_mod.EvalConfig]
) -> tuple[float, float]:
    """Wall seconds of `dflash-eval` (run as `python -m dflash`) on the first checkpoint and of `-m` over all of them,
    as a user runs them (imports, MLflow logging to a temporary store included), each with no features cached."""
    steps = ",".join(str(j.drafter.step) for j in jobs)
    times = []
    with tempfile.TemporaryDirectory(prefix="dflash-bench-store-") as store:
        env = {**os.environ, "DFLASH_CACHE_DIR": cfg.cache_dir, "MLFLOW_TRACKING_URI": f"sqlite:///{store}/mlflow.db"}
        for flag, step in (([], jobs[0].drafter.step), (["-m"], steps)):
            shutil.rmtree(Path(cfg.cache_dir, "features"), ignore_errors=True)
            cmd = [
                sys.executable,
                "-m",
                "dflash",
                *flag,
                *overrides,
                f"drafter.step={step}",
                f"hydra.run.dir={store}/run",
                f"hydra.sweep.dir={store}/multi",
            ]
            t = time.perf_counter()
            subprocess.run(cmd, cwd=store, env=env, check=True, capture_output=True)
            times.append(time.perf_counter() - t)
    return times[0], times[1]


def checkpoints(cfg: config_mod.EvalConfig, n: int) -> list[config_mod.EvalConfig]:
    d = cfg.drafter
    steps = list_steps(find_path(d.run_dir))[-n:] if d.kind == "training" and d.run_dir else []
    if len(steps) < n:
        return [cfg] * n
    return [replace(cfg, drafter=replace(d, step=s)) for s in steps]


def warm_profile(cfg: config_mod.EvalConfig, top: int = 30) -> list[str]:
    """One more warm run under cProfile: host time by function, cumulative. On a GPU the waits for the device show
    in the calls that synchronise (`.cpu()`, `.tolist()`, `.item()`), so the profile says host- or device-bound."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    pipeline.run(cfg)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(top)
    return [
        line.replace(str(Path(__file__).resolve().parents[2]) + "/", "")
        for line in out.getvalue().splitlines()
        if line.strip()
    ]


def sweep(
    cfg: config_mod.EvalConfig, n: int, overrides: list[str], profile: bool = False
) -> tuple[str, EvalResult, float]:
    jobs = checkpoints(cfg, n)
    fresh_process(cfg)
    w1, r1 = timed_run(jobs[0])
    f1 = r1.timings["features"]
    fresh_process(cfg)  # the sweep computes them again, once
    t = time.perf_counter()
    for job in jobs:
        pipeline.run(job)
    wn = time.perf_counter() - t
    fresh_process()
    w3, r3 = timed_run(jobs[0])  # a new process: features from disk
    warm, rw = min(
        (timed_run(jobs[-1]) for _ in range(3)), key=lambda x: x[0]
    )  # target loaded, features in memory: best of 3
    names = ", ".join(j.drafter.name or pipeline.run_name(j.drafter) for j in jobs)
    procs = ""
    if cfg.drafter.kind == "training" and len({j.drafter.step for j in jobs}) == n:
        p1, pn = evaluate_processes(cfg, overrides, jobs)
        tracked = "MLflow included" if cfg.tracking.enabled else "tracking disabled"
        procs = (
            f"\n  as processes (dflash-eval, {tracked}): one run {p1:.1f} s, the -m sweep {pn:.1f} s: "
            f"{pn / p1:.2f}x one run"
        )
    lines = [
        f"sweep of {n} checkpoints ({names}) in one process vs one single run:",
        f"  single run {w1:.2f} s (features {f1:.2f} s, replay {r1.timings.get('replay', 0):.2f} s, "
        f"load target {r1.timings.get('load_target', 0):.2f} s); "
        f"sweep {wn:.2f} s: {wn / w1:.2f}x one run (target <= 1.3x for 2)" + procs,
        f"  a new process with features on disk: features {r3.timings['features']:.3f} s = "
        f"{r3.timings['features'] / f1:.1%} of the first run's "
        f"(target <= 20%), run {w3:.2f} s",
        f"  warm per checkpoint (target loaded, features in memory; best of 3): {warm:.3f} s ("
        + ", ".join(f"{k} {v:.3f}" for k, v in rw.timings.items())
        + f"; outside the stages {warm - sum(rw.timings.values()):.3f})",
        sweep_bound(rw.timings, w1, n),
        f"  τ {r1.metrics['acceptance_length']:.3f}, {int(r1.metrics['new_tokens'])} new tokens over "
        f"{int(r1.metrics['prompts'])} prompts",
    ]
    if profile:
        lines += [
            "  profile of one more warm run (cProfile, host seconds; --sweep-profile):",
            *("    " + x for x in warm_profile(jobs[-1])),
        ]
    return "\n".join(lines), r1, warm


def sweep_bound(warm: dict[str, float], one: float, n: int) -> str:
    """What bounds a sweep's ratio to one run: every checkpoint after the first pays at least its drafter's load and
    its replay (the drafter's own arithmetic: its passes and its LM head), measured in this run."""
    per = warm.get("load_drafter", 0.0) + warm.get("replay", 0.0)
    return (
        f"  bound: each further checkpoint pays its drafter's load and replay, {per:.3f} s = {per / one:.1%} of one "
        f"run (the replay {warm.get('replay', 0.0):.3f} s: the drafter's passes and its LM head), so {n} checkpoints "
        f"cost at least {1 + (n - 1) * per / one:.2f}x one run"
    )


def online(cfg: config_mod.EvalConfig, res: EvalResult, warm: float, n: int, eager: bool = False) -> str:
    fresh_process()
    t = cfg.target
    target, drafter = pipeline.load_models(
        cfg, target_mod.inspect_target(t.kind, t.path, cfg.cache_dir, t.max_context), {}
    )
    prompts = [r.prompt_ids for r in res.prompts[:n]]
    compiled = (
        target.device.type == "cuda" and not eager
    )  # eager: CUDA graphs alone, no inductor compile, no static-generate baseline
    o = bench_online(
        target,
        drafter.model,
        prompts,
        cfg.prompts.max_new_tokens,
        compile=compiled,
        hf_static=compiled,
        backend=cfg.attention.drafter,
    )
    spec = o.rate("dflash")
    share = len(prompts) / len(res.prompts)  # the offline run covered every prompt
    return format_online(o) + (
        f"\n  offline evaluation per checkpoint (warm, {len(res.prompts)} prompts) {warm:.2f} s vs the online loop on "
        f"the same prompts "
        f"{spec.seconds / share:.2f} s{' (scaled from ' + str(len(prompts)) + ' prompts)' if share < 1 else ''}: "
        f"{spec.seconds / share / warm:.1f}x cheaper (target >= 5x on CPU, >= 50x on GPU)"
    )


def generation(cfg: config_mod.EvalConfig, res: EvalResult) -> str:
    fresh_process()
    t = cfg.target
    target, _ = pipeline.load_models(cfg, target_mod.inspect_target(t.kind, t.path, cfg.cache_dir, t.max_context), {})
    g = bench_generation(target, [r.prompt_ids for r in res.prompts], cfg.prompts.max_new_tokens, batches=(1, 12))
    return format_generation(g)


REPLAY_MODES = (
    ("all", 1),
    ("all", 4),
    ("visited", 1),
    ("visited", 4),
    ("visited", 16),
)  # (replay.anchors, replay.tf_stride)


def replay_modes(cfg: config_mod.EvalConfig, rounds: int = 3) -> str:
    """The replay stage in each mode of REPLAY_MODES on the same references and features (in memory),
    interleaved `rounds` times (best of): seconds, the ratio to `all`, whether the loop's counters agree, and what a
    stride costs the teacher-forced accuracy (its SE over prompts at the first and the last slot)."""
    best, loops, se = {}, {}, {}
    for _ in range(rounds):
        for anchors, stride in REPLAY_MODES:
            res = pipeline.run(replace(cfg, replay=replace(cfg.replay, anchors=anchors, tf_stride=stride)))
            best[anchors, stride] = min(best.get((anchors, stride), float("inf")), res.timings["replay"])
            t = res.total
            loops[anchors, stride] = (t.steps, t.committed, t.committed_uncapped, t.accepted_at_pos, t.commit_hist)
            se[anchors, stride] = res.curves["accuracy_se"]
    base, n = best["all", 1], int(res.metrics["new_tokens"])
    lines = [
        f"replay modes ({int(res.metrics['prompts'])} prompts, {n} new tokens, τ "
        f"{res.metrics['acceptance_length']:.3f}; best of {rounds}):"
    ]
    for (anchors, stride), sec in best.items():
        same = (
            "same loop counters as all"
            if loops[anchors, stride] == loops["all", 1]
            else "LOOP COUNTERS DIFFER FROM all"
        )
        e = se[anchors, stride]
        lines.append(
            f"  replay.anchors={anchors} replay.tf_stride={stride}: {sec:.2f} s, {n / sec:.0f} tok/s, "
            f"{sec / base:.2f}x all ({same}); accuracy SE at slot 1 {_fmt(e[0])}, slot {len(e)} {_fmt(e[-1])}"
        )
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def random_target(shape: str, cache_dir: str, tokenizer) -> Path:
    """A random-weight target of `shape` saved once (bf16 safetensors) under <cache_dir>/bench/."""
    import transformers

    folder = Path(cache_dir, "bench", shape)
    if (folder / "config.json").is_file():
        return folder
    cls, fields = SHAPES[shape]
    config = getattr(transformers, cls)(**fields)
    log.info("scale: creating a random %s target under %s (once)", shape, folder)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with atomic_dir(folder) as tmp:  # follows the umask: the bench folder sits in the shared cache
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    del model
    return folder


def scale_child(where: str, lengths: list[int], device: str) -> None:
    """In a child process: the random target (CPU: the saved folder, memory-mapped; CUDA: built on
    the device from its shape), the feature pass over sequences of `lengths`; prints JSON."""
    import transformers

    configure(False)
    if device == "cpu":
        t = target_mod.load_target("hf", where, dtype="bfloat16", device=device)
        weights = sum(p.stat().st_size for p in Path(where).glob("*.safetensors"))
    else:
        cls, fields = SHAPES[where]
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(
                getattr(transformers, cls)(**fields), dtype=torch.bfloat16
            ).eval()
        t = target_mod.Target(
            model=model, tokenizer=None, identity=f"random-{where}", source=where, max_context=1 << 20
        )
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
    L = t.num_layers
    taps = [round(1 + i * (L - 4) / 4) for i in range(5)]
    ids = [torch.randint(0, t.vocab_size, (n,)).tolist() for n in lengths]
    for f in features.iter_features(t, ids[:1], [taps], cache=False):  # warm-up (kernels, allocator)
        f.taps(taps)
    if device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for f in features.iter_features(t, ids, [taps], cache=False):
        f.taps(taps)
    if device != "cpu":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "weights": weights,
                "seconds": secs,
                "tokens": sum(lengths),
                "taps": taps,
            }
        )
    )


def scale(cfg: config_mod.EvalConfig, res: EvalResult, shape: str, prompts: int | None = None) -> str:
    lengths = [len(r.prompt_ids) + len(r.reference) for r in res.prompts][:prompts]
    timed = sum(lengths) / sum(
        len(r.prompt_ids) + len(r.reference) for r in res.prompts
    )  # SmolLM2's feature time, scaled to these tokens
    device = "cuda" if torch.cuda.is_available() and cfg.device.name != "cpu" else "cpu"
    t = cfg.target
    tokenizer = target_mod.inspect_target(
        t.kind, t.path, cfg.cache_dir, t.max_context
    ).tokenizer  # saved beside the random weights
    where = str(random_target(shape, cfg.cache_dir, tokenizer)) if device == "cpu" else shape
    out = subprocess.run(
        [sys.executable, "-m", "dflash.bench", "--scale-child", where, device, json.dumps(lengths)],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        return f"scale: the child failed:\n{out.stderr[-2000:]}"
    r = json.loads(out.stdout.strip().splitlines()[-1])
    rss = (
        f", peak RSS {r['peak_rss'] / 1e9:.2f} GB = {r['peak_rss'] / r['weights']:.2f}x the weights (target <= 1.3x)"
        if device == "cpu"
        else ""
    )
    return (
        f"scale: random {shape} ({r['weights'] / 1e9:.2f} GB of bf16 weights, taps {r['taps']}), feature pass over "
        f"{r['tokens']} tokens "
        f"on {device}: {r['seconds']:.2f} s{rss}; SmolLM2 on the same tokens: {res.timings['features'] * timed:.2f} s "
        f"({r['seconds'] / max(res.timings['features'] * timed, 1e-9):.0f}x)"
    )


def vl_scale(cfg: config_mod.EvalConfig, a: argparse.Namespace) -> str:
    """The scale section for a VL shape (dflash.bench.scale): every stage on each device."""
    from transformers import AutoTokenizer

    t = cfg.target
    tok = (
        AutoTokenizer.from_pretrained(a.scale_tokenizer)
        if a.scale_tokenizer
        else target_mod.inspect_target(t.kind, t.path, cfg.cache_dir, t.max_context).tokenizer
    )
    devices = (a.scale_devices or ("cuda" if torch.cuda.is_available() else "cpu")).split(",")
    sizes = {
        d: tuple(int(x) for x in (a.scale_gpu if d.startswith("cuda") else a.scale_cpu).split("x")) for d in devices
    }
    extra = [
        o for o in a.overrides if o.startswith(("target.", "references.", "features.", "attention", "device.threads"))
    ]
    return bench_scale.report(
        a.scale,
        str(Path(cfg.cache_dir).resolve()),
        tok,
        devices,
        sizes,
        a.scale_engine,
        extra,
        a.scale_drafter,
        a.scale_profile,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", type=int, default=2, help="checkpoints in the sweep section")
    ap.add_argument("--online", type=int, default=12, help="prompts for the online loop")
    ap.add_argument(
        "--online-eager",
        action="store_true",
        help="CUDA: the online section without inductor (CUDA graphs alone) and without transformers' static compiled "
        "generate: no compile (minutes), for a short GPU call",
    )
    ap.add_argument(
        "--sweep-profile",
        action="store_true",
        help="sweep: also a cProfile of one more warm run (where its seconds go)",
    )
    ap.add_argument(
        "--skip", default="", help="comma-separated sections to skip: sweep, replay, online, generation, scale"
    )
    ap.add_argument(
        "--scale",
        default="qwen3_8b",
        choices=sorted(SHAPES) + sorted(bench_scale.SHAPES),
        help="the random target shape of the scale section",
    )
    ap.add_argument(
        "--scale-devices",
        default=None,
        help="VL shapes: devices to evaluate on, e.g. cuda,cpu (default: cuda if present, else cpu)",
    )
    ap.add_argument("--scale-gpu", default="12x256", help="VL shapes on CUDA: prompts x max_new_tokens")
    ap.add_argument("--scale-cpu", default="4x64", help="VL shapes on CPU: prompts x max_new_tokens")
    ap.add_argument(
        "--scale-engine",
        action="store_true",
        help="VL shapes on CUDA: also the references engine with and without inductor",
    )
    ap.add_argument(
        "--scale-tokenizer", default=None, help="VL shapes: a tokenizer folder (default: the configured target's)"
    )
    ap.add_argument(
        "--scale-drafter",
        default="dflash",
        choices=sorted(bench_scale.DRAFTERS),
        help="VL shapes: the 5-layer drafter=init evaluated (dflash2: SpecForge's 27B example, block 8, window 2048)",
    )
    ap.add_argument(
        "--scale-profile",
        action="store_true",
        help="VL shapes: also the top ops (torch.profiler) of a steady feature pass and of a few decode steps",
    )
    ap.add_argument("--scale-eval", help=argparse.SUPPRESS)
    ap.add_argument(
        "--scale-prompts",
        type=int,
        default=None,
        help="the first N prompts' tokens in the scale section (default: all)",
    )
    ap.add_argument("--scale-child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.scale_child:
        return scale_child(a.scale_child[0], json.loads(a.scale_child[2]), a.scale_child[1])
    if a.scale_eval:
        return bench_scale.scale_eval(json.loads(a.scale_eval))
    configure(True)
    cfg = compose(a.overrides)
    skip = set(filter(None, a.skip.split(",")))
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:  # a fresh feature cache; the rest shared
        real = Path(cfg.cache_dir).resolve()
        for sub in ("targets", "references", "bench"):
            (real / sub).mkdir(parents=True, exist_ok=True)
            os.symlink(real / sub, Path(tmp, sub))
        cfg = replace(cfg, cache_dir=tmp)
        vl = a.scale in bench_scale.SHAPES
        if vl and skip >= {"sweep", "online", "generation"}:  # the scale section alone: no SmolLM2 job needed
            print(vl_scale(cfg, a), flush=True)
            return
        res = pipeline.run(cfg)  # references generated and the target converted if this machine has not yet: not timed
        warm = sum(
            res.timings.get(k, 0.0) for k in ("load_drafter", "replay")
        )  # without --sweep: the warm cost, roughly
        report = [
            f"dflash.bench on {torch.get_num_threads()} CPU threads, torch {torch.__version__}, device "
            f"{cfg.device.name}"
        ]
        if "sweep" not in skip:
            text, res, warm = sweep(cfg, a.sweep, a.overrides, a.sweep_profile)
            report.append(text)
            print(text, flush=True)
        for name, fn in (
            ("replay", lambda: replay_modes(cfg)),
            ("online", lambda: online(cfg, res, warm, a.online, a.online_eager)),
            ("generation", lambda: generation(cfg, res)),
            ("scale", lambda: vl_scale(cfg, a) if vl else scale(cfg, res, a.scale, a.scale_prompts)),
        ):
            if name in skip:
                continue
            try:
                text = fn()
            except Exception as e:  # the other sections' figures still reach the summary
                log.exception("bench: section %s failed", name)
                text = f"{name}: failed: {type(e).__name__}: {e}"
            report.append(text)
            print(text, flush=True)
    print("\n== summary\n" + "\n".join(report))


def cli() -> None:
    """`dflash-bench` / `dflash-bench`: bad input prints its message and exits 2, no traceback."""
    try:
        main()
    except UserError as e:
        print(f"dflash-bench: error: {e}", file=sys.stderr)
        sys.exit(exit_code(e))
