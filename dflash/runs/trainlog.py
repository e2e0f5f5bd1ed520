"""A trainer's own metrics, read beside τ: from its metrics.jsonl, its TensorBoard event files or (through
dflash.tracking) its MLflow run; the names chosen; and the stall check.

Every reader returns the same plain data, `{name: [(step, value)]}` sorted by step. `choose(names, patterns)`
keeps the names a training-run parent logs under `train/` (default: accuracy- and loss-like ones);
`accuracy_name` picks the training accuracy the stall check reads. `stall(points, min_rise)`: when the trainer's
accuracy kept rising while τ did not rise past its best earlier value by more than two standard errors, the
numbers that say so (docs/family.md §9: training accuracy that says nothing of acceptance).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dflash.util.errors import ConfigError

Series = dict[str, list[tuple[int, float]]]  # name -> [(step, value)], by step
DEFAULT_PATTERNS = (r"acc", r"loss")  # accuracy- and loss-like names: acc, acc_1, train/acc_0, loss, train/ploss_0, ...


def read_jsonl(path: Path) -> Series:
    """metrics.jsonl: one JSON object per line with a `step` and numbers (dflash.train's format); other lines
    skipped."""
    out: Series = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line being written
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            continue
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                out.setdefault(k, []).append((row["step"], float(v)))
    return {k: sorted(v) for k, v in out.items()}


def event_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("events.out.tfevents.*"))


def read_tensorboard(folder: Path) -> Series:
    """The scalars of every TensorBoard event file under `folder` (tensorboard's event reader); a file in a
    subfolder prefixes its names with that subfolder (`<sub>/<tag>`), as TensorBoard names its runs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: Series = {}
    for f in event_files(folder):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        sub = f.parent.relative_to(folder).as_posix()
        for tag in acc.Tags().get("scalars", []):
            name = tag if sub == "." else f"{sub}/{tag}"
            out.setdefault(name, []).extend((int(e.step), float(e.value)) for e in acc.Scalars(tag))
    return {k: sorted(set(v)) for k, v in out.items()}


def choose(names: Sequence[str], patterns: Sequence[str] | None) -> list[str]:
    """The names a parent logs: those any pattern (a regular expression, searched case-blind) finds."""
    pats = [re.compile(p, re.IGNORECASE) for p in (patterns if patterns is not None else DEFAULT_PATTERNS)]
    return sorted(n for n in names if any(p.search(n) for p in pats))


def accuracy_name(names: Sequence[str], configured: str | None) -> str | None:
    """The training accuracy for the stall check: `configured` (it must be among `names`), else the shortest name
    holding `acc` (ties: alphabetical); None where there is none."""
    if configured is not None:
        if configured not in names:
            raise ConfigError(
                f"train_metrics.accuracy_key={configured!r} is not among the trainer's logged metrics "
                f"({', '.join(sorted(names)[:12])}{', ...' if len(names) > 12 else ''})"
            )
        return configured
    accs = [n for n in names if "acc" in n.lower()]
    return min(accs, key=lambda n: (len(n), n)) if accs else None


def at_or_before(points: list[tuple[int, float]], step: int) -> float | None:
    """The last value logged at or before `step` (a trainer logs every few steps; checkpoints fall between)."""
    vals = [v for s, v in points if s <= step]
    return vals[-1] if vals else None


@dataclass(frozen=True)
class Point:
    """One evaluated step: τ, its SE (None: one prompt), the trainer's accuracy there (None: not logged yet)."""

    step: int
    tau: float | None
    tau_se: float | None
    train_acc: float | None


@dataclass(frozen=True)
class Stall:
    """Training accuracy rose from `acc_from` (at `best_step`, where τ was best) to `acc_to` (at `last_step`) while τ
    went from `tau_best` to `tau_last`, within 2 SE of the best or below it."""

    accuracy: str  # the trainer's name of the accuracy
    best_step: int
    last_step: int
    acc_from: float
    acc_to: float
    tau_best: float
    tau_last: float
    tau_se: float | None


def stall(points: Sequence[Point], accuracy: str, min_rise: float) -> Stall | None:
    """Whether the trainer's accuracy kept rising while τ stalled or fell: over the evaluated steps (by step), the
    last one against the earlier step of best τ; a stall when accuracy rose at least `min_rise` between them and
    the last τ is not above the best by more than 2 SE (its own SE; 0 where undefined). None: no stall, or fewer
    than two steps with both τ and accuracy."""
    pts = sorted((p for p in points if p.tau is not None and p.train_acc is not None), key=lambda p: p.step)
    if len(pts) < 2:
        return None
    last, earlier = pts[-1], pts[:-1]
    best = max(earlier, key=lambda p: (p.tau, -p.step))
    assert last.tau is not None and best.tau is not None and last.train_acc is not None and best.train_acc is not None
    rose = last.train_acc - best.train_acc >= min_rise
    flat = last.tau - best.tau <= 2 * (last.tau_se or 0.0)
    if not (rose and flat):
        return None
    return Stall(accuracy, best.step, last.step, best.train_acc, last.train_acc, best.tau, last.tau, last.tau_se)
