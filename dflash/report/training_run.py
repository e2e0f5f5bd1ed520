"""A training run evaluated step by step, in words and one figure: the parent run's description, its chart, the
console's lines.

`stall_text`: the stall check's finding (dflash.runs.trainlog.stall) with its numbers; `best_text`: the trainer's
recorded best step (SpecForge's `best_meta.json`) beside the step of best τ; `training_run_markdown`: one row per
evaluated step (τ ± SE, macro, expected τ, the trainer's accuracy there; a step the trainer rewound marked
superseded), the stall finding and the best steps first; `training_run_png`: τ ± SE and the trainer's accuracy by
step on one chart (dflash.report.plots.training_run_figure). Undefined values print "-".
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from dflash.models.drafter.layouts import BestMeta
from dflash.report.console import fmt
from dflash.report.plots import training_run_figure_png
from dflash.runs.trainlog import Point, Series, Stall

UNIT_WORDS = {
    "step": "training steps",
    "optimizer_step": "optimizer steps",
    "micro_batch": "micro-batches (SpecForge's legacy trainer: an optimizer step every accumulation_steps of them)",
}


class Row(NamedTuple):
    """An evaluated step: its Point, τ macro, expected τ, whether a rewind superseded it."""

    point: Point
    macro: float | None
    expected: float | None
    superseded: bool = False


def stall_text(s: Stall) -> str:
    """The warning: training accuracy rising while τ stalls or falls, with the numbers."""
    went = "fell" if s.tau_last < s.tau_best else "stalled"
    se = f" ± {fmt(s.tau_se)}" if s.tau_se is not None else ""
    return (
        f"training accuracy ({s.accuracy}) rose {fmt(s.acc_from)} -> {fmt(s.acc_to)} from step {s.best_step} to step "
        f"{s.last_step} "
        f"while τ {went}: {fmt(s.tau_best)} -> {fmt(s.tau_last)}{se}. Training accuracy is not acceptance: check the "
        f"labels and "
        "what the drafter sees in training against inference (docs/family.md §4, §9)"
    )


def tau_best(points: Sequence[Point]) -> Point | None:
    """The evaluated step of best τ (ties: the earlier step)."""
    pts = [p for p in points if p.tau is not None]
    return max(pts, key=lambda p: (p.tau, -p.step)) if pts else None


def best_text(best: BestMeta, points: Sequence[Point]) -> str:
    """The trainer's best step (by its own metric) beside the step of best τ, and a note where they differ."""
    score = f" = {fmt(best.score)}" if best.score is not None else ""
    what = " (SpecForge's teacher-forced token accuracy)" if best.metric == "eval/simulated_acc_len" else ""
    line = f"the trainer's best: step {best.step} by {best.metric or 'its metric'}{what}{score}"
    top = tau_best(points)
    if top is None:
        return line
    line += f"; best τ: step {top.step} (τ {fmt(top.tau)})"
    if top.step != best.step:
        at = next((p for p in points if p.step == best.step), None)
        there = f", where τ is {fmt(at.tau)}" if at is not None and at.tau is not None else " (not evaluated)"
        line += f". τ would pick step {top.step}, not the trainer's step {best.step}{there}"
    return line


def training_run_markdown(
    run_dir: str,
    rows: Sequence[Row],
    accuracy: str | None,
    stall: Stall | None,
    status: str,
    best: BestMeta | None = None,
    unit: str = "step",
) -> str:
    """The parent's description; `rows`: per evaluated step, by step."""
    current = [r for r in rows if not r.superseded]
    lines = [
        f"**τ by training step** of `{run_dir}`: {len(current)} steps evaluated ({status}). Curves: MLflow step = "
        f"training step, in {UNIT_WORDS.get(unit, unit)}; the trainer's own metrics under `train/`. Chart: "
        "`training_run/tau_by_step.png`.",
        "",
    ]
    if stall is not None:
        lines += [f"**Warning**: {stall_text(stall)}.", ""]
    if best is not None:
        lines += [f"**Best step**: {best_text(best, [r.point for r in current])}.", ""]
    if gone := sorted({r.point.step for r in rows if r.superseded}):
        lines += [
            f"Superseded (the trainer rewound the run and trained these steps again; their earlier evaluation is kept "
            f"as a child tagged `dflash.superseded_by`): step(s) {', '.join(map(str, gone))}.",
            "",
        ]
    acc = f" | train {accuracy}" if accuracy else ""
    lines += [
        f"| step | τ ± SE | τ macro | expected τ{acc} |",
        "| --- | --- | --- | ---" + (" | ---" if accuracy else "") + " |",
    ]
    for r in current:
        p = r.point
        tau = "-" if p.tau is None else f"{fmt(p.tau)} ± {fmt(p.tau_se)}"
        extra = f" | {fmt(p.train_acc)}" if accuracy else ""
        mark = " (trainer's best)" if best is not None and p.step == best.step else ""
        lines.append(f"| {p.step}{mark} | {tau} | {fmt(r.macro)} | {fmt(r.expected)}{extra} |")
    return "\n".join(lines)


def training_run_png(
    rows: Sequence[Row], train: Series, accuracy: str | None, best: BestMeta | None, unit: str, title: str
) -> bytes:
    """τ ± SE by step (superseded evaluations apart), the trainer's accuracy (and its best's metric) on a second
    axis, the trainer's best step and the step of best τ marked."""
    cur = [r.point for r in rows if not r.superseded]
    old = [r.point for r in rows if r.superseded]
    lines = {k: train[k] for k in dict.fromkeys([accuracy, best.metric if best else None]) if k and k in train}
    top = tau_best(cur)
    return training_run_figure_png(
        [p.step for p in cur],
        [p.tau for p in cur],
        [p.tau_se for p in cur],
        [(p.step, p.tau) for p in old],
        lines,
        UNIT_WORDS.get(unit, unit).split(" (")[0],
        best.step if best else None,
        top.step if top else None,
        title,
    )
