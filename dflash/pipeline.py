"""The evaluation pipeline: config -> load -> references (in rounds for multi-turn prompts) -> features -> replay -> metrics.

`run(cfg)` takes the typed config (`dflash.config.schema.EvalConfig`) and returns an `EvalResult`: plain
typed data, no tracking. evaluate.py hands the result to dflash.tracking. Every stage announces
itself (dflash.util.progress) and is timed (`EvalResult.timings`, seconds) so the README can report
where time goes.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import torch

from dflash.config.schema import AttentionConfig, DeviceConfig, DrafterSchema, EvalConfig, PromptLookupConfig, TemplateConfig
from dflash.models.checkpoint import DrafterSource, LoadedDrafter, build_drafter, fit_drafter, read_drafter
from dflash.models.drafter import ATTENTION_BACKENDS, SLIDING_WINDOW
from dflash.models.drafter_config import DrafterConfig, effective_config
from dflash.models.formats import share_equal
from dflash.models.kernels import linear_attention_kernel
from dflash.models.target import Target, TargetInfo, inspect_target, load_target
from dflash.report.samples import sample_record
from dflash.stages.features import FeatureStats, iter_features
from dflash.stages.metrics import accuracy_se, position_curves, ratio, summarize
from dflash.stages.prompt_lookup import PromptLookup, lookup_replay, yardstick
from dflash.stages.prompts import Prompt, load_prompts, render, round_robin
from dflash.stages.references import ReferenceOptions, check_references, drop_references, get_references
from dflash.stages.replay import ReplayOptions, prepare, replay_group
from dflash.stages.result import EvalResult, PromptResult, RunInfo
from dflash.stages.served import served_metrics
from dflash.stages.turns import expand, references_in_rounds, turn_of
from dflash.util.errors import ConfigError, PromptError, ReferenceError
from dflash.util.progress import Progress, log


@contextmanager
def timed(timings: dict[str, float], stage: str) -> Iterator[None]:
    t = time.perf_counter()
    yield
    timings[stage] = timings.get(stage, 0.0) + time.perf_counter() - t


def resolve_device(dev: DeviceConfig, attention: AttentionConfig, target_dtype: str | None = None) -> tuple[str, str]:
    name = dev.name
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible; use device=cpu (or device=auto)")
    dtype = target_dtype or dev.dtype
    if dtype == "auto":
        dtype = "bfloat16" if name.startswith("cuda") else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"device.dtype={dtype!r}: use float32, bfloat16, float16 or auto")
    if attention.drafter not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention.drafter={attention.drafter!r}: use one of {ATTENTION_BACKENDS}")
    if attention.drafter == "flex" and not name.startswith("cuda"):
        raise ConfigError("attention=flex needs a CUDA device (flex_attention is compiled for GPU); on CPU use attention=sdpa or attention=eager")
    if dev.threads:
        torch.set_num_threads(int(dev.threads))
    return name, dtype


def job_device(name: str, job_num: int) -> str:
    """The GPU of sweep job `job_num`: one job per GPU, round robin (CPU stays CPU)."""
    n = torch.cuda.device_count() if name.startswith("cuda") or name == "auto" else 0
    return f"cuda:{job_num % n}" if n else name


def check_lengths(prompts: list[Prompt], ids: list[list[int]], max_new_tokens: int, max_context: int) -> None:
    for p, x in zip(prompts, ids):
        if len(x) + max_new_tokens > max_context:
            raise PromptError(
                f"prompt {p.id!r} has {len(x)} tokens; with prompts.max_new_tokens={max_new_tokens} that exceeds the target's "
                f"context of {max_context} tokens. Shorten the prompt, lower prompts.max_new_tokens, or drop it from the set"
            )


def read_drafter_conf(cfg: EvalConfig) -> DrafterSource:
    """The drafter read and checked without the target (dflash.models.checkpoint's phase 1)."""
    d, t = cfg.drafter, cfg.target
    if d.sliding_window not in SLIDING_WINDOW:
        raise ConfigError(f"drafter.sliding_window={d.sliding_window!r}: use one of {SLIDING_WINDOW}")
    overrides = {"block_size": d.block_size, "mask_token_id": d.mask_token_id, "target_layer_ids": d.target_layer_ids}
    if d.kind == "init":  # shape the random drafter by the target config's defaults
        overrides["mask_token_id"] = d.mask_token_id if d.mask_token_id is not None else t.mask_token_id
        overrides["target_layer_ids"] = d.target_layer_ids or t.default_taps
    return read_drafter(d.kind, d.name or _default_name(d), run_dir=d.run_dir, step=d.step, path=d.path, overrides=overrides,
                        init={"num_layers": d.num_layers, "num_taps": d.num_taps, "seed": d.seed})


def load_models(cfg: EvalConfig, info: TargetInfo, timings: dict[str, float], src: DrafterSource | None = None) -> tuple[Target, LoadedDrafter]:
    """The target's weights (after `inspect_target`), then the drafter (`src`: read and fitted to
    `info` already, else here) built beside the target's last layers."""
    device, dtype = resolve_device(cfg.device, cfg.attention, cfg.target.dtype)
    src = src or fit_drafter(read_drafter_conf(cfg), info)
    with timed(timings, "load_target"):
        target = load_target(info, dtype=dtype, device=device, attn=cfg.attention.target, cache_dir=cfg.cache_dir, device_map=cfg.device.device_map)
    with timed(timings, "load_drafter"):
        drafter = build_drafter(src, cfg.drafter.sliding_window, device=target.head_device, dtype=target.dtype)  # beside the last layers
        drafter.model.eval().requires_grad_(False)
        for note in share_equal(drafter.model, target):  # an own embedding / LM head equal to the target's: the target's (vLLM)
            log.info("drafter %s", note)
    log.info("drafter: %s (block %d, taps %s)", drafter.path or drafter.name, drafter.model.cfg.block_size, drafter.model.cfg.target_layer_ids)
    if (kernel := linear_attention_kernel(target.model)) is not None:
        log.info("target: Gated DeltaNet layers run %s", kernel)
    return target, drafter


def render_checked(cfg: EvalConfig, info: TargetInfo, prompts: list[Prompt]) -> list[list[int]]:
    """The prompts' ids through the target's chat template, checked against its context."""
    ids = [render(p, info.tokenizer, vars(cfg.target.template)) for p in prompts]
    check_lengths(prompts, ids, cfg.prompts.max_new_tokens, info.max_context)
    return ids


def load_prompt_ids(cfg: EvalConfig, info: TargetInfo) -> tuple[list[Prompt], list[list[int]]]:
    """The selected prompts, multi-turn ones expanded (dflash.stages.turns), and the ids of the first
    round (the prompts that wait for no answer of the target) rendered and checked."""
    pc = cfg.prompts
    prompts = expand(load_prompts(pc.source, pc.path, pc.num_prompts, pc.subsets, pc.data_dir, pc.selection, pc.seed))
    first = [p for p in prompts if turn_of(p) == 1]
    ids = render_checked(cfg, info, first)
    log.info("prompts: %d from %s (%s), %d tokens in the first round", len(prompts), pc.path or pc.source,
             ", ".join(sorted({p.subset for p in prompts})), sum(map(len, ids)))
    return prompts, ids


def _default_name(d: DrafterSchema) -> str:
    src = d.run_dir if d.kind == "training" else d.path if d.kind == "hf" else None
    return Path(src).name if src else d.kind


def run_name(d: DrafterSchema, step: int | None = None) -> str:
    name = d.name or _default_name(d)
    step = step if step is not None else d.step
    if d.kind == "init":
        return f"{name}@seed_{d.seed}"
    return f"{name}@step_{step}" if step is not None else f"{name}@latest"


def replay_prompts(cfg: EvalConfig, target: Target, drafter: LoadedDrafter, prompts: list[Prompt], ids: list[list[int]],
                   refs: list[list[int]], timings: dict[str, float]) -> list[PromptResult]:
    """Features (one truncated target pass per prompt + reference, or the feature cache) then the
    replay, in groups of prompts whose drafter context K/V fit replay.context_gb (`all` mode: one prompt
    per group; the taps are dropped once a prompt's K/V exist, so features are never all held at once)."""
    layer_ids, rp = drafter.model.cfg.target_layer_ids, cfg.replay
    chunk = int(cfg.anchors_per_chunk or (256 if target.device.type == "cuda" else 32))
    opt = ReplayOptions(rp.mode(target.device.type == "cuda"), rp.tf_stride, chunk, cfg.attention.drafter, cfg.scores)
    fstats, out, group = FeatureStats(), [], []
    feats = iter_features(target, [x + r for x, r in zip(ids, refs)], [layer_ids], cfg.cache_dir, stats=fstats, **vars(cfg.features))

    def flush(bar: Progress) -> None:
        with timed(timings, "replay"):
            t0 = time.perf_counter()
            done = replay_group(drafter.model, target, [s for _, s in group], opt)
            wall = time.perf_counter() - t0
        leaks = [None] * len(group)
        if cfg.leak_probe:
            with timed(timings, "leak_probe"):
                leaks = [c for c, _ in replay_group(drafter.model, target, [s for _, s in group], replace(opt, see_anchor=True))]
        n = sum(len(r) for (_, _, r), _ in group)
        for ((p, x, r), _), (c, blocks), leak in zip(group, done, leaks):
            c.wall_s = wall * len(r) / max(n, 1)  # a lockstep group's time, shared by new tokens
            out.append(PromptResult(p, x, r, c, blocks, leak))
        bar.update(n)
        group.clear()

    with Progress("replay", total=sum(map(len, refs)), unit="tok") as bar:
        for p, x, r, f in zip(prompts, ids, refs, feats):
            with timed(timings, "replay"):
                seq = prepare(drafter.model, target, x, r, f.taps(layer_ids))  # the taps [T, n*H] -> the drafter's context K/V
            group.append(((p, x, r), seq))
            if opt.anchors == "all" or sum(s.nbytes for _, s in group) >= rp.context_gb * 1e9 or len(group) >= chunk:
                flush(bar)
        if group:
            flush(bar)
    timings["features"] = fstats.seconds
    return out


def check_measured(results: list[PromptResult], source: str, drop: Callable[[list[list[int]]], int] | None = None) -> list[str]:
    """Prompts whose replay made no verify step measured nothing: all of them is an error (exit 2, the
    run ends FAILED) and `drop(prompt ids)` removes those refused references from the cache (-> how many
    were there), so the next run asks again; some is a warning naming them. -> the warnings."""
    empty = [r for r in results if r.counters.steps == 0]
    if not empty:
        return []
    named = ", ".join(f"{r.prompt.id} ({len(r.reference)} new token{'' if len(r.reference) == 1 else 's'})" for r in empty[:5])
    what = (f"{len(empty)} of {len(results)} prompts had no verify step: {named}{', ...' if len(empty) > 5 else ''} (the first new token "
            "comes from the prefill: a reference of one token leaves nothing to draft; it stopped at once)")
    if len(empty) == len(results):
        dropped = drop([r.prompt_ids for r in results]) if drop is not None else 0
        gone = f"; their {dropped} cached references were removed, so the next run asks again" if dropped else ""
        raise ReferenceError(f"nothing was measured: {what}{gone}. Check the references (references={source}: does the server stop at once, "
                             "e.g. a stop token or a chat template of its own?) or raise prompts.max_new_tokens")
    log.warning("%s; they count in no ratio", what)
    return [f"{what}; they count in no ratio"]


def run(cfg: EvalConfig) -> EvalResult:
    timings: dict[str, float] = {}
    torch.manual_seed(cfg.seed)
    _, dtype = resolve_device(cfg.device, cfg.attention, cfg.target.dtype)
    pc, rc, tmpl = cfg.prompts, cfg.references, vars(cfg.target.template)
    # cheap checks first: everything that needs no target weights
    with timed(timings, "prepare"):
        src = read_drafter_conf(cfg)  # config and weights checked: no target needed
        t = cfg.target
        info = inspect_target(t.kind, t.path, cfg.cache_dir, t.max_context)
        prompts, ids = load_prompt_ids(cfg, info)
        src = fit_drafter(src, info, max(map(len, ids)) + pc.max_new_tokens)  # taps, mask token, shapes vs the target (first round)
        first = [p for p in prompts if turn_of(p) == 1]
        ref_opts = ReferenceOptions(**vars(rc))  # the references.* fields, one typed object passed whole
        ref_plan = check_references(info, ids, pc.max_new_tokens, tmpl, cfg.cache_dir, dtype, [p.id for p in first], options=ref_opts)
        warn = thinking_warning(cfg)
    target, drafter = load_models(cfg, info, timings, src)
    del src  # its weights are the module's now

    def references(ps: list[Prompt], xs: list[list[int]]):
        return get_references(target, xs, pc.max_new_tokens, tmpl, cfg.cache_dir, names=[p.id for p in ps], server=ref_plan.server, options=ref_opts)

    with timed(timings, "references"):
        refs1, stats1 = references(first, ids)
        prompts, ids, refs, ref_stats = references_in_rounds(prompts, target.tokenizer, lambda p: render_checked(cfg, info, [p])[0], references,
                                                             first=(ids, refs1, stats1))
    if ref_stats.setup_s is not None:
        timings["references_setup"] = ref_stats.setup_s  # part of references: the engine's compile and capture
    results = replay_prompts(cfg, target, drafter, prompts, ids, refs, timings)
    unmeasured = check_measured(results, rc.source, lambda ps: drop_references(ref_stats, ps))
    lookup = prompt_lookup(cfg.prompt_lookup, results, timings) if cfg.prompt_lookup.enabled else None
    per_prompt = [(r.prompt.subset, r.counters) for r in results]
    metrics = summarize(per_prompt)
    total = sum((c for _, c in per_prompt[1:]), per_prompt[0][1])
    curves = {**position_curves(total), "accuracy_se": accuracy_se([c for _, c in per_prompt])}
    if cfg.leak_probe:
        lm = summarize([(r.prompt.subset, r.leak) for r in results if r.leak is not None])
        metrics["leak_probe/acceptance_length"] = lm["acceptance_length"]
        tau, leak_tau = metrics["acceptance_length"], lm["acceptance_length"]
        metrics["leak_probe/tau_gain"] = None if tau is None or leak_tau is None else leak_tau - tau  # undefined without a verify step
    metrics["tokens_per_second_replay"] = ratio(total.new_tokens, timings.get("replay", 0.0))  # None: no replay was timed
    metrics.update(ref_stats.metrics())
    metrics.update(served_metrics([(r.counters, s) for r in results if (s := ref_stats.served.get(tuple(r.prompt_ids))) is not None]))
    dc = drafter.model.cfg
    info = RunInfo(
        run_name=run_name(cfg.drafter, drafter.step), drafter_name=drafter.name, drafter_step=drafter.step, checkpoint_path=drafter.path,
        checkpoint_sha256=drafter.sha256, device=str(target.device), dtype=str(target.dtype).replace("torch.", ""), target_identity=target.identity,
        target_source=target.source, block_size=dc.block_size, target_layer_ids=list(dc.target_layer_ids), mask_token_id=dc.mask_token_id,
        stop_ids=target.eos_ids, prompt_ids=[p.id for p in prompts], references=ref_stats,
        drafter_config=effective_config(dc, drafter.model.sliding_window == "apply"),
        linear_attention_kernel=linear_attention_kernel(target.model), replay_anchors=cfg.replay.mode(target.device.type == "cuda"),
        tf_stride=cfg.replay.tf_stride,
        prompt_format=prompt_format(cfg.target.template),
    )
    window = window_warning(dc, drafter.model.sliding_window, max(len(r.prompt_ids) + len(r.reference) for r in results))
    shown = {p.id for p in round_robin(prompts, cfg.num_samples)} if cfg.num_samples > 0 else set()
    samples = [sample_record(r.prompt, r.prompt_ids, r.reference, r.blocks, target.tokenizer) for r in results if r.prompt.id in shown]
    return EvalResult(metrics, curves, results, total, samples, timings, info, drafter.warnings + ref_stats.warnings + warn + window + unmeasured,
                      lookup)


def prompt_lookup(pl: PromptLookupConfig, results: list[PromptResult], timings: dict[str, float]) -> PromptLookup:
    """The yardstick: prompt lookup replayed on every prompt's reference at the drafter's block size."""
    with timed(timings, "prompt_lookup"):
        B = results[0].counters.block_size
        lookup = [lookup_replay(r.prompt_ids, r.reference, B, pl.min, pl.max) for r in results]
        y = yardstick([r.counters for r in results], lookup, pl.min, pl.max)
    log.info("prompt lookup (n-gram, n %d..%d, %d drafted): τ %s", pl.min, pl.max, B - 1, "-" if y.tau is None else f"{y.tau:.3f}")
    return y


def prompt_format(t: TemplateConfig) -> str:
    """target.template in words, as the summary prints it: the thinking mode is explicit (DFLASH.md §3, §7)."""
    if not t.use_chat_template:
        return "no chat template" + (", system prompt set" if t.system_prompt else "")
    return f"chat template, thinking {'on' if t.enable_thinking else 'off'}" + (", system prompt set" if t.system_prompt else "")


def window_warning(dc: DrafterConfig, mode: str, longest: int) -> list[str]:
    """A warning when sequences outgrow the drafter's sliding window: there SGLang (window applied) and z-lab's
    sdpa / eager loop (window ignored) draft differently, and the τ measured follows drafter.sliding_window (DFLASH.md §6)."""
    w = dc.sliding_window
    if w is None or "sliding_attention" not in dc.layer_types or longest <= w:
        return []
    msg = (f"sequences reach {longest} tokens, past the drafter's sliding window of {w}: drafter.sliding_window={mode} "
           f"{'applies it, as SGLang serves the drafter' if mode == 'apply' else 'ignores it, as z-lab sdpa / eager loop does'}; "
           f"with drafter.sliding_window={'ignore' if mode == 'apply' else 'apply'} τ differs on these sequences (DFLASH.md §6)")
    log.warning(msg)
    return [msg]


PUBLIC_NO_THINKING = ("qwen3-4b-dflash", "qwen3-8b-dflash")  # z-lab trained these without thinking traces (DFLASH.md §7)


def thinking_warning(cfg: EvalConfig) -> list[str]:
    """A warning when a Qwen3-4B/8B public drafter is evaluated with target.template.enable_thinking=true."""
    d = cfg.drafter
    names = " ".join(str(x).lower() for x in (d.name, d.path, d.run_dir) if x)
    if not cfg.target.template.enable_thinking or not any(n in names for n in PUBLIC_NO_THINKING):
        return []
    w = ("target.template.enable_thinking=true with a Qwen3-4B/8B public DFlash drafter: z-lab trained these without thinking traces and "
         "publishes their τ with thinking off; this τ is not comparable (set target.template.enable_thinking=false)")
    log.warning(w)
    return [w]
