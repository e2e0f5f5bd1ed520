"""The evaluation pipeline: config -> load -> references (in rounds for multi-turn prompts) -> features -> replay ->
metrics.

`run(cfg)` takes the typed config (`dflash.config.schema.EvalConfig`) and returns an `EvalResult`: plain
typed data, no tracking. evaluate.py hands the result to dflash.tracking. Every stage announces
itself (dflash.util.progress) and is timed (`EvalResult.timings`, seconds) so a run can report
where time goes.
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import torch

from dflash.config.schema import (
    AttentionConfig,
    DeviceConfig,
    DrafterSchema,
    EvalConfig,
    PromptLookupConfig,
    StepSelection,
)
from dflash.evaluation.checks import (
    check_measured,
    convention_warning,
    prompt_format,
    thinking_warning,
    window_warning,
)
from dflash.models.drafter.checkpoint import (
    INIT_DFLASH2,
    DrafterSource,
    LoadedDrafter,
    build_drafter,
    fit_drafter,
    read_drafter,
)
from dflash.models.drafter.config import effective_config
from dflash.models.drafter.formats import share_equal
from dflash.models.drafter.model import ATTENTION_BACKENDS, SLIDING_WINDOW
from dflash.models.target.kernels import linear_attention_kernel
from dflash.models.target.model import Target, TargetInfo, inspect_target, load_target
from dflash.result import EvalResult, PromptResult, RunInfo
from dflash.stages.features import FeatureStats, iter_features
from dflash.stages.metrics import (
    accuracy_se,
    convention_check,
    dspark_summary,
    position_curves,
    ratio,
    summarize,
)
from dflash.stages.prompts.sets import Prompt, load_prompts, render
from dflash.stages.references.collect import (
    ReferenceOptions,
    ReferenceStats,
    check_references,
    drop_references,
    get_references,
)
from dflash.stages.references.served import served_metrics
from dflash.stages.references.turns import expand, references_in_rounds, turn_of
from dflash.stages.replay.loop import ReplayOptions, auto_chunk, prepare, replay_group
from dflash.stages.replay.prompt_lookup import PromptLookup, lookup_replay, yardstick
from dflash.util.errors import ConfigError, PromptError
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
        raise ConfigError(
            "attention=flex needs a CUDA device (flex_attention is compiled for GPU); on CPU use attention=sdpa or "
            "attention=eager"
        )
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
                f"prompt {p.id!r} has {len(x)} tokens; with prompts.max_new_tokens={max_new_tokens} that exceeds the "
                f"target's "
                f"context of {max_context} tokens. Shorten the prompt, lower prompts.max_new_tokens, or drop it from "
                f"the set"
            )


def read_drafter_conf(cfg: EvalConfig, step: int | None = None) -> DrafterSource:
    """The drafter read and checked without the target (dflash.models.drafter.checkpoint's phase 1); `step`: that
    step of a training run (else drafter.step, a single step, null / latest for the latest, best)."""
    d, t = cfg.drafter, cfg.target
    sel = StepSelection.parse(d.step)
    one = step if step is not None else (sel.value if sel.single else None)
    if d.sliding_window not in SLIDING_WINDOW:
        raise ConfigError(f"drafter.sliding_window={d.sliding_window!r}: use one of {SLIDING_WINDOW}")
    overrides = {"block_size": d.block_size, "mask_token_id": d.mask_token_id, "target_layer_ids": d.target_layer_ids}
    if d.kind == "init":  # shape the random drafter by the target config's defaults
        overrides["mask_token_id"] = d.mask_token_id if d.mask_token_id is not None else t.mask_token_id
        overrides["target_layer_ids"] = d.target_layer_ids or t.default_taps
    return read_drafter(
        d.kind,
        d.name or _default_name(d),
        run_dir=d.run_dir,
        step=one,
        path=d.path,
        overrides=overrides,
        config=d.config,
        init={
            "num_layers": d.num_layers,
            "num_taps": d.num_taps,
            "seed": d.seed,
            "arch": d.arch,
            "window": d.window,
            "is_causal": d.is_causal,
            **{k: getattr(d, k) for k in INIT_DFLASH2},
        },
    )


def load_target_for(plan: "Plan", timings: dict[str, float]) -> Target:
    """The target's weights (after `inspect_target`), on the plan's device and dtype."""
    cfg = plan.cfg
    with timed(timings, "load_target"):
        target = load_target(
            plan.info,
            dtype=plan.dtype,
            device=plan.device,
            attn=cfg.attention.target,
            cache_dir=cfg.cache_dir,
            device_map=cfg.device.device_map,
        )
    if (kernel := linear_attention_kernel(target.model)) is not None:
        log.info("target: Gated DeltaNet layers run %s", kernel)
    return target


def build_beside(target: Target, src: DrafterSource, sliding_window: str, timings: dict[str, float]) -> LoadedDrafter:
    """The drafter (read and fitted) built beside the target's last layers, in its dtype."""
    with timed(timings, "load_drafter"):
        drafter = build_drafter(src, sliding_window, device=target.head_device, dtype=target.dtype)
        drafter.model.eval().requires_grad_(False)
        for note in share_equal(
            drafter.model, target
        ):  # an own embedding / LM head equal to the target's: the target's (vLLM)
            log.info("drafter %s", note)
    log.info(
        "drafter: %s (block %d, taps %s)",
        drafter.path or drafter.name,
        drafter.model.cfg.block_size,
        drafter.model.cfg.target_layer_ids,
    )
    return drafter


def load_models(
    cfg: EvalConfig, info: TargetInfo, timings: dict[str, float], src: DrafterSource | None = None
) -> tuple[Target, LoadedDrafter]:
    """The target's weights and the drafter (`src`: read and fitted to `info` already, else here), outside a plan (the
    benches)."""
    device, dtype = resolve_device(cfg.device, cfg.attention, cfg.target.dtype)
    src = src or fit_drafter(read_drafter_conf(cfg), info)
    with timed(timings, "load_target"):
        target = load_target(
            info,
            dtype=dtype,
            device=device,
            attn=cfg.attention.target,
            cache_dir=cfg.cache_dir,
            device_map=cfg.device.device_map,
        )
    return target, build_beside(target, src, cfg.drafter.sliding_window, timings)


def render_checked(cfg: EvalConfig, info: TargetInfo, prompts: list[Prompt]) -> list[list[int]]:
    """The prompts' ids through the target's chat template, checked against its context."""
    ids = [render(p, info.tokenizer, vars(cfg.target.template)) for p in prompts]
    check_lengths(prompts, ids, cfg.prompts.max_new_tokens, info.max_context)
    return ids


def load_prompt_ids(cfg: EvalConfig, info: TargetInfo) -> tuple[list[Prompt], list[list[int]]]:
    """The selected prompts, multi-turn ones expanded (dflash.stages.references.turns), and the ids of the first
    round (the prompts that wait for no answer of the target) rendered and checked."""
    pc = cfg.prompts
    prompts = expand(load_prompts(pc.source, pc.path, pc.num_prompts, pc.subsets, pc.data_dir, pc.selection, pc.seed))
    first = [p for p in prompts if turn_of(p) == 1]
    ids = render_checked(cfg, info, first)
    log.info(
        "prompts: %d from %s (%s), %d tokens in the first round",
        len(prompts),
        pc.path or pc.source,
        ", ".join(sorted({p.subset for p in prompts})),
        sum(map(len, ids)),
    )
    return prompts, ids


def _export_step(d: DrafterSchema) -> int | None:
    """An HF folder a trainer exported as `<run>/step_<N>`: its step N (None for any other folder)."""
    m = re.fullmatch(r"step_(\d+)", Path(d.path).name) if d.kind == "hf" and d.path else None
    return int(m[1]) if m else None


def _default_name(d: DrafterSchema) -> str:
    src = d.run_dir if d.kind == "training" else d.path if d.kind == "hf" else None
    if src and _export_step(d) is not None:
        src = str(Path(src).parent)  # <run>/step_<N>: named after the run
    return Path(src).name if src else d.kind


def run_name(d: DrafterSchema, step: int | None = None) -> str:
    name = d.name or _default_name(d)
    step = step if step is not None else (d.step if isinstance(d.step, int) else _export_step(d))
    if d.kind == "init":
        return f"{name}@seed_{d.seed}"
    if d.kind == "hf" and step is None:
        return name  # a folder has no steps
    return f"{name}@step_{step}" if step is not None else f"{name}@latest"


def replay_prompts(
    cfg: EvalConfig,
    target: Target,
    drafter: LoadedDrafter,
    prompts: list[Prompt],
    ids: list[list[int]],
    refs: list[list[int]],
    timings: dict[str, float],
) -> list[PromptResult]:
    """Features (one truncated target pass per prompt + reference, or the feature cache) then the
    replay, in groups of prompts whose drafter context K/V fit replay.context_gb (`all` mode: as many
    prompts as one drafter pass's anchors, anchors_per_chunk; the taps are dropped once a prompt's K/V
    exist, so features are never all held at once)."""
    layer_ids, rp = drafter.model.cfg.target_layer_ids, cfg.replay
    chunk = int(cfg.anchors_per_chunk or auto_chunk(drafter.model.cfg, target.device.type, target.dtype.itemsize))
    opt = ReplayOptions(
        rp.mode(),
        rp.tf_stride,
        chunk,
        cfg.attention.drafter,
        cfg.scores,
        thresholds=tuple(float(t) for t in rp.confidence_thresholds),
    )
    fstats, out, group = FeatureStats(), [], []
    feats = iter_features(
        target, [x + r for x, r in zip(ids, refs)], [layer_ids], cfg.cache_dir, stats=fstats, **vars(cfg.features)
    )

    def flush(bar: Progress) -> None:
        with timed(timings, "replay"):
            t0 = time.perf_counter()
            done = replay_group(drafter.model, target, [s for _, s in group], opt)
            wall = time.perf_counter() - t0
        leaks = [None] * len(group)
        if cfg.leak_probe:
            with timed(timings, "leak_probe"):
                leaks = [
                    c
                    for c, _ in replay_group(
                        drafter.model, target, [s for _, s in group], replace(opt, see_anchor=True)
                    )
                ]
        n = sum(len(r) for (_, _, r), _ in group)
        for ((p, x, r), _), (c, blocks), leak in zip(group, done, leaks):
            c.wall_s = wall * len(r) / max(n, 1)  # a lockstep group's time, shared by new tokens
            out.append(PromptResult(p, x, r, c, blocks, leak))
        bar.update(n)
        group.clear()

    with Progress("replay", total=sum(map(len, refs)), unit="tok") as bar:
        for p, x, r, f in zip(prompts, ids, refs, feats):
            with timed(timings, "replay"):
                seq = prepare(
                    drafter.model, target, x, r, f.taps(layer_ids)
                )  # the taps [T, n*H] -> the drafter's context K/V
            group.append(((p, x, r), seq))
            full = (
                sum(s.T - 1 - s.first for _, s in group) >= chunk if opt.anchors == "all" else len(group) >= chunk
            )  # anchors / prompts
            if full or sum(s.nbytes for _, s in group) >= rp.context_gb * 1e9:
                flush(bar)
        if group:
            flush(bar)
    timings["features"] = fstats.seconds
    return out


@dataclass
class Plan:
    """What an evaluation resolves before any weights load: device and dtype, the target's config and
    tokenizer, the prompts and their first-round ids, the references' plan, warnings. Made once; a
    training run's steps (dflash.evaluation.series) all run under one plan."""

    cfg: EvalConfig
    device: str
    dtype: str
    info: TargetInfo
    prompts: list[Prompt]
    ids: list[list[int]]  # the first round's rendered ids
    ref_opts: ReferenceOptions
    ref_plan: Any
    warnings: list[str]

    @property
    def max_len(self) -> int:
        """The longest first-round sequence (prompt + new tokens): what a drafter's rope must reach."""
        return max(map(len, self.ids)) + self.cfg.prompts.max_new_tokens

    def drafter(self, src: DrafterSource) -> DrafterSource:
        """A drafter read (phase 1) fitted to this plan's target (phase 2)."""
        return fit_drafter(src, self.info, self.max_len)


@dataclass
class Prepared:
    """What every drafter evaluated under one plan shares: the loaded target and the references (all rounds)."""

    plan: Plan
    target: Target
    prompts: list[Prompt]
    ids: list[list[int]]
    refs: list[list[int]]
    ref_stats: ReferenceStats


def plan(cfg: EvalConfig) -> Plan:
    """The cheap checks (no weights): device, target config and tokenizer, prompts, references' plan."""
    device, dtype = resolve_device(cfg.device, cfg.attention, cfg.target.dtype)
    t, pc = cfg.target, cfg.prompts
    info = inspect_target(t.kind, t.path, cfg.cache_dir, t.max_context)
    prompts, ids = load_prompt_ids(cfg, info)
    first = [p for p in prompts if turn_of(p) == 1]
    ref_opts = ReferenceOptions(**vars(cfg.references))  # the references.* fields, one typed object passed whole
    ref_plan = check_references(
        info, ids, pc.max_new_tokens, vars(t.template), cfg.cache_dir, dtype, [p.id for p in first], options=ref_opts
    )
    return Plan(cfg, device, dtype, info, prompts, ids, ref_opts, ref_plan, thinking_warning(cfg))


def prepare_run(p: Plan, timings: dict[str, float]) -> Prepared:
    """The target loaded, then its references (multi-turn prompts in rounds, dflash.stages.references.turns)."""
    cfg, pc, tmpl = p.cfg, p.cfg.prompts, vars(p.cfg.target.template)
    target = load_target_for(p, timings)
    first = [q for q in p.prompts if turn_of(q) == 1]

    def references(ps: list[Prompt], xs: list[list[int]]):
        return get_references(
            target,
            xs,
            pc.max_new_tokens,
            tmpl,
            cfg.cache_dir,
            names=[q.id for q in ps],
            server=p.ref_plan.server,
            options=p.ref_opts,
        )

    with timed(timings, "references"):
        refs1, stats1 = references(first, p.ids)
        prompts, ids, refs, ref_stats = references_in_rounds(
            p.prompts,
            target.tokenizer,
            lambda q: render_checked(cfg, p.info, [q])[0],
            references,
            first=(p.ids, refs1, stats1),
        )
    if ref_stats.setup_s is not None:
        timings["references_setup"] = ref_stats.setup_s  # part of references: the engine's compile and capture
    return Prepared(p, target, prompts, ids, refs, ref_stats)


def run(cfg: EvalConfig) -> EvalResult:
    """One drafter: plan (the drafter read first: cheap checks fail before anything loads), prepare, evaluate."""
    timings: dict[str, float] = {}
    with timed(timings, "prepare"):
        src = read_drafter_conf(cfg)  # config and weights checked: no target needed
        p = plan(cfg)
        src = p.drafter(src)  # taps, mask token, shapes vs the target (first round)
    return evaluate_drafter(prepare_run(p, timings), src, timings)


def evaluate_drafter(prep: Prepared, src: DrafterSource, timings: dict[str, float] | None = None) -> EvalResult:
    """One drafter (read and fitted to the plan's target) built, replayed over the prepared references, measured."""
    timings = {} if timings is None else timings
    cfg, target, rc = prep.plan.cfg, prep.target, prep.plan.cfg.references
    torch.manual_seed(cfg.seed)  # the one seed of a drafter's evaluation (drafter=init's weights draw from it)
    drafter = build_beside(target, src, cfg.drafter.sliding_window, timings)
    del src  # its weights are the module's now
    prompts, ref_stats = prep.prompts, prep.ref_stats
    results = replay_prompts(cfg, target, drafter, prompts, prep.ids, prep.refs, timings)
    unmeasured = check_measured(results, rc.source, lambda ps: drop_references(ref_stats, ps))
    lookup = prompt_lookup(cfg.prompt_lookup, results, timings) if cfg.prompt_lookup.enabled else None
    per_prompt = [(r.prompt.subset, r.counters) for r in results]
    metrics = summarize(per_prompt)
    total = sum((c for _, c in per_prompt[1:]), per_prompt[0][1])
    dspark = dspark_summary([c for _, c in per_prompt], total)
    convention = convention_check([c for _, c in per_prompt])
    curves = {**position_curves(total), "accuracy_se": accuracy_se([c for _, c in per_prompt])}
    if cfg.leak_probe:
        lm = summarize([(r.prompt.subset, r.leak) for r in results if r.leak is not None])
        metrics["leak_probe/acceptance_length"] = lm["acceptance_length"]
        tau, leak_tau = metrics["acceptance_length"], lm["acceptance_length"]
        metrics["leak_probe/tau_gain"] = (
            None if tau is None or leak_tau is None else leak_tau - tau
        )  # undefined without a verify step
    metrics["tokens_per_second_replay"] = ratio(
        total.new_tokens, timings.get("replay", 0.0)
    )  # None: no replay was timed
    metrics.update(ref_stats.metrics())
    metrics.update(
        served_metrics(
            [(r.counters, s) for r in results if (s := ref_stats.served.get(tuple(r.prompt_ids))) is not None]
        )
    )
    dc = drafter.model.cfg
    info = RunInfo(
        run_name=run_name(cfg.drafter, drafter.step),
        drafter_name=drafter.name,
        drafter_step=drafter.step,
        checkpoint_path=drafter.path,
        checkpoint_sha256=drafter.sha256,
        device=str(target.device),
        dtype=str(target.dtype).replace("torch.", ""),
        target_identity=target.identity,
        target_source=target.source,
        block_size=dc.width,
        target_layer_ids=list(dc.target_layer_ids),
        mask_token_id=dc.mask_token_id,
        stop_ids=target.eos_ids,
        prompt_ids=[p.id for p in prompts],
        references=ref_stats,
        drafter_config=effective_config(dc, drafter.model.sliding_window == "apply"),
        linear_attention_kernel=linear_attention_kernel(target.model),
        replay_anchors=cfg.replay.mode(),
        tf_stride=cfg.replay.tf_stride,
        prompt_format=prompt_format(cfg.target.template),
        checkpoint_origin=drafter.origin,
    )
    window = window_warning(
        dc, drafter.model.sliding_window, max(len(r.prompt_ids) + len(r.reference) for r in results)
    )
    trap = convention_warning(dc, convention, cfg.replay.convention_z)
    warnings = drafter.warnings + ref_stats.warnings + prep.plan.warnings + window + unmeasured + trap
    return EvalResult(
        metrics,
        curves,
        results,
        total,
        timings,
        info,
        warnings,
        tokenizer=target.tokenizer,
        prompt_lookup=lookup,
        dspark=dspark,
        convention=convention,
    )


def prompt_lookup(pl: PromptLookupConfig, results: list[PromptResult], timings: dict[str, float]) -> PromptLookup:
    """The yardstick: prompt lookup replayed on every prompt's reference at the drafter's block size."""
    with timed(timings, "prompt_lookup"):
        B = results[0].counters.block_size
        lookup = [lookup_replay(r.prompt_ids, r.reference, B, pl.min, pl.max) for r in results]
        y = yardstick([r.counters for r in results], lookup, pl.min, pl.max)
    log.info(
        "prompt lookup (n-gram, n %d..%d, %d drafted): τ %s",
        pl.min,
        pl.max,
        B - 1,
        "-" if y.tau is None else f"{y.tau:.3f}",
    )
    return y
