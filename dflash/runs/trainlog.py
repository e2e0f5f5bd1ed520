"""A trainer's own metrics, read beside τ: from its metrics.jsonl, its TensorBoard event files or (through
dflash.tracking) its MLflow runs; the names chosen; and the stall check.

Every reader returns the same plain data, `{name: [(step, value)]}` sorted by step. A trainer restarted (a resume, a
rewind) logs again from an earlier step, in a new TensorBoard file or a new MLflow run: `stitch` joins them oldest
first, each one's points replacing the earlier ones' from its first step on (the abandoned timeline's points go).
`join_step` puts rows on the step a trainer logs as its join key (SpecForge: `train/optimizer_step`). `pick_runs`
keeps, of the MLflow runs of one name, those that belong to this run folder (alive while one of its steps was saved;
SpecForge's default run name is shared by unrelated runs). `choose(names, patterns)` keeps the names a training-run
parent logs under `train/` (default: accuracy-, loss- and acceptance-like ones, SpecForge's DFlash diagnostics and
its eval rows);
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
# accuracy-, loss- and acceptance-like names (acc, train/accuracy, train/ploss_0, ..._accepted_length), SpecForge's
# DFlash / DFlash2 diagnostics (train/dflash/hard_label/*, train/dflash2/selector/*) and its eval rows (eval/*)
DEFAULT_PATTERNS = (r"acc", r"loss", r"^(train/)?dflash2?/", r"^eval/")
JOIN_KEYS = ("train/optimizer_step",)  # a row's step as the trainer names it (SpecForge since its tracker's join key)
SLACK_S = 60.0  # pick_runs: seconds of clock skew between a run's MLflow times and its files' mtimes


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


def _written(f: Path) -> tuple[int, str]:
    """An event file's creation time, from its name (`events.out.tfevents.<unix time>.<host>...`), for ordering."""
    m = re.match(r"events\.out\.tfevents\.(\d+)", f.name)
    return (int(m[1]) if m else 0, f.name)


def stitch(parts: Sequence[Series]) -> Series:
    """Logs of one training run by successive processes, oldest first: each part's points replace the earlier
    parts' from its first step on (a resume or rewind logs again from there; what came after is abandoned)."""
    out: Series = {}
    for part in parts:
        first = min((s for pts in part.values() for s, _ in pts), default=None)
        if first is None:
            continue
        out = {k: [p for p in pts if p[0] < first] for k, pts in out.items()}
        for k, pts in part.items():
            out.setdefault(k, []).extend(pts)
    return {k: sorted(v) for k, v in out.items() if v}


def join_step(series: Series) -> Series:
    """Rows moved to the step the trainer logs as its join key (JOIN_KEYS: its value at that logged step), the key
    itself dropped; a series without one as it is."""
    key = next((k for k in JOIN_KEYS if k in series), None)
    if key is None:
        return series
    at = {s: int(round(v)) for s, v in series[key]}
    return {k: sorted((at.get(s, s), v) for s, v in pts) for k, pts in series.items() if k != key}


def read_tensorboard(folder: Path) -> Series:
    """The scalars of every TensorBoard event file under `folder` (tensorboard's event reader). Files in one folder
    are one run's successive processes, stitched oldest first (`stitch`, by the time in their names); where event
    files lie in several subfolders, each subfolder's names are prefixed with it (`<sub>/<tag>`), as TensorBoard
    names its runs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = event_files(folder)
    subs = sorted({f.parent.relative_to(folder).as_posix() for f in files})
    out: Series = {}
    for sub in subs:
        parts = []
        for f in sorted((f for f in files if f.parent.relative_to(folder).as_posix() == sub), key=_written):
            acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
            acc.Reload()
            part = {t: [(int(e.step), float(e.value)) for e in acc.Scalars(t)] for t in acc.Tags().get("scalars", [])}
            parts.append(join_step(part))
        prefix = "" if len(subs) == 1 or sub == "." else f"{sub}/"
        out.update({f"{prefix}{k}": v for k, v in stitch(parts).items()})
    return out


@dataclass(frozen=True)
class RunSpan:
    """An MLflow run of a trainer: id, name, when it started and ended (ms since the epoch; None: still running),
    and its `output_dir` param where it logged one (SpecForge's legacy trainer logs its arguments)."""

    run_id: str
    name: str
    start_ms: int
    end_ms: int | None
    output_dir: str | None = None


def same_folder(logged: str, root: Path) -> bool:
    """Whether a trainer's `output_dir` (as it logged it: absolute, or relative to its working directory) names
    this run folder: equal once resolved, or a relative path naming the folder's last components."""
    p = Path(logged)
    if p.is_absolute():
        return p.resolve() == root.resolve()
    parts = [x for x in p.parts if x not in (".", "")]
    return bool(parts) and ".." not in parts and list(root.resolve().parts[-len(parts) :]) == parts


def pick_runs(spans: Sequence[RunSpan], saves_s: Sequence[float], root: Path | None = None) -> list[RunSpan]:
    """The MLflow runs of one name that belong to this run folder, oldest first: those whose `output_dir` names it
    (where they logged one), else those alive while one of its steps was saved (`saves_s`: the step folders'
    mtimes), or started after its last save and still running (a restart that has not saved yet)."""
    if root is not None and any(r.output_dir for r in spans):
        return sorted((r for r in spans if r.output_dir and same_folder(r.output_dir, root)), key=lambda r: r.start_ms)
    last = max(saves_s, default=None)

    def alive(r: RunSpan) -> bool:
        lo, hi = r.start_ms / 1e3 - SLACK_S, (r.end_ms / 1e3 + SLACK_S) if r.end_ms is not None else float("inf")
        return any(lo <= t <= hi for t in saves_s) or (r.end_ms is None and (last is None or lo >= last - SLACK_S))

    return sorted((r for r in spans if alive(r)), key=lambda r: r.start_ms)


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
