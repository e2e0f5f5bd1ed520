"""A training run evaluated step by step, in words: the parent run's description and the console's lines.

`stall_text`: the stall check's finding (dflash.runs.trainlog.stall) with its numbers; `training_run_markdown`:
one row per evaluated step (τ ± SE, macro, expected τ, the trainer's accuracy there), the stall finding first.
Undefined values print "-".
"""

from __future__ import annotations

from typing import Sequence

from dflash.report.console import fmt
from dflash.runs.trainlog import Point, Stall


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


def training_run_markdown(
    run_dir: str,
    rows: Sequence[tuple[Point, float | None, float | None]],
    accuracy: str | None,
    stall: Stall | None,
    status: str,
) -> str:
    """The parent's description; `rows`: per evaluated step (its Point, τ macro, expected τ), by step."""
    lines = [
        f"**τ by training step** of `{run_dir}`: {len(rows)} steps evaluated ({status}). Curves: MLflow step = "
        f"training step; "
        "the trainer's own metrics under `train/`.",
        "",
    ]
    if stall is not None:
        lines += [f"**Warning**: {stall_text(stall)}.", ""]
    acc = f" | train {accuracy}" if accuracy else ""
    lines += [
        f"| step | τ ± SE | τ macro | expected τ{acc} |",
        "| --- | --- | --- | ---" + (" | ---" if accuracy else "") + " |",
    ]
    for p, macro, expected in rows:
        tau = "-" if p.tau is None else f"{fmt(p.tau)} ± {fmt(p.tau_se)}"
        extra = f" | {fmt(p.train_acc)}" if accuracy else ""
        lines.append(f"| {p.step} | {tau} | {fmt(macro)} | {fmt(expected)}{extra} |")
    return "\n".join(lines)
