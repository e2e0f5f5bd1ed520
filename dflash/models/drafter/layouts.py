"""A training run's folder: which layout it is, its step folders, which are complete, what a step's digest covers.

The one home of "which steps does this run hold" (read by dflash.runs.watch, dflash.evaluation.series, the loader
dflash.models.drafter.checkpoint and dflash.evaluation.api). Three layouts, told apart by their folder names
(docs/training-runs.md, docs/specforge-runs.md):

- `dflash` (`dflash-train`): `<run>/step_<N>/` holding `checkpoint.pt` or an HF-format folder; N counts
  optimizer steps.
- `specforge-legacy` (SpecForge's `scripts/train_dflash.py`): `<run>/epoch_<e>_step_<s>/` holding `config.json`,
  `model.safetensors` (the drafter), `training_state.pt` (optimizer state: never unpickled) and a copy of the modeling
  code (`dflash.py`: never imported). `s` counts micro-batches (an optimizer step every `accumulation_steps` of them);
  the final save repeats the last `s` in a folder of the next epoch: one step, two folders. Files are written in
  place, the weights through a safetensors temporary file (`.tmpXXXXXX`, safetensors >= 0.8) renamed into place:
  a step is complete when no temporary file is there, config.json parses and every safetensors file (every shard
  the index names) is whole.
- `specforge` (SpecForge's `specforge train`): `<run>/<run_id>-step<N>/training_state.pt` (+ one
  `training_state_rank<r>.pt` per rank: optimizer and RNG state, never read), N counting optimizer steps; beside
  them the links `<run_id>-latest`, `<run_id>-best` (relative symlinks, never listed as steps) and
  `<run_id>.best_meta.json` (SpecForge's best step by its eval metric). Each file is written to `<name>.tmp` and
  renamed: a step is complete once `training_state.pt` is in place. No config.json: the drafter's config is the
  JSON the run was launched with (`drafter.config`; dflash/models/drafter/specforge.py).

`drafter.run_dir` is the run folder; for SpecForge's layout also one step folder, or a `-latest` / `-best` link,
which pick that run (and that step when `drafter.step` is null). Pure of time: the caller owns the clock.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.models.drafter.files import TEMP_NAME, checkpoint_files, in_git_history, incomplete, list_steps
from dflash.util.errors import CheckpointError
from dflash.util.files import find_path

DFLASH, LEGACY, UNIFIED = "dflash", "specforge-legacy", "specforge"
UNITS = {DFLASH: "step", LEGACY: "micro_batch", UNIFIED: "optimizer_step"}  # what a layout's step number counts
WHERE = {  # what each layout's step folders look like, for messages
    DFLASH: "step_<N>/ (dflash-train: checkpoint.pt, or config.json + *.safetensors)",
    LEGACY: "epoch_<e>_step_<s>/ (SpecForge's train_dflash.py: config.json + model.safetensors)",
    UNIFIED: "<run_id>-step<N>/training_state.pt (specforge train)",
}
LEGACY_DIR = re.compile(r"epoch_(\d+)_step_(\d+)")
UNIFIED_DIR = re.compile(r"(.+)-step(\d+)")
UNIFIED_LINK = re.compile(r"(.+)-(latest|best)")
SAFETENSORS_TEMP = re.compile(r"\.tmp[0-9A-Za-z]{6}")  # safetensors >= 0.8: NamedTempFile in the folder, renamed
SHARD = re.compile(r".+-\d{5}-of-\d{5}\.safetensors")
LEGACY_EXTRAS = ("training_state.pt",)  # beside a legacy step's safetensors: optimizer state, not the drafter
PAYLOAD = "training_state.pt"
BEST = "best"  # drafter.step=best: the step the trainer recorded as its best


@dataclass(frozen=True)
class StepFolder:
    """One step of a run as it is on disk now."""

    step: int
    path: Path
    files: tuple[tuple[str, int, int], ...]  # (name, size, mtime_ns), sorted: changes when anything is written
    why_not: str | None  # None: complete
    layout: str = DFLASH
    epoch: int | None = None  # specforge-legacy: the epoch of the folder read
    labels: tuple[str, ...] = ()  # the folder names holding this step (legacy's final save: two)

    @property
    def unit(self) -> str:
        return UNITS[self.layout]

    @property
    def newest_ns(self) -> int:
        """When the folder last changed (its newest file's mtime; 0 when empty)."""
        return max((m for _, _, m in self.files), default=0)


@dataclass(frozen=True)
class BestMeta:
    """SpecForge's `<run_id>.best_meta.json`: the step it keeps as best, by `metric` (for DFlash
    `eval/simulated_acc_len` is the teacher-forced token accuracy, not a length)."""

    step: int
    metric: str
    score: float | None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RunFolder:
    """A run folder read now: its layout (None: no step folder yet), steps by step, SpecForge's best and links."""

    root: Path
    layout: str | None
    steps: list[StepFolder]
    run_id: str | None = None
    best: BestMeta | None = None
    links: dict[str, int] = field(default_factory=dict)  # "latest" / "best" -> the step the link points at
    pinned: int | str | None = None  # drafter.run_dir named a step folder (its step) or a -best link (BEST)

    @property
    def unit(self) -> str:
        return UNITS[self.layout or DFLASH]

    def step(self, n: int) -> StepFolder | None:
        return next((f for f in self.steps if f.step == n), None)


# --- the folder named -------------------------------------------------------------------------------


def locate(run_dir: str | Path) -> tuple[Path, str | None, int | str | None]:
    """drafter.run_dir -> (run folder, SpecForge run id it names or None, step it pins or None): a
    `<run_id>-step<N>` or `epoch_<e>_step_<s>` folder pins its step, a `<run_id>-best` link the best, a
    `<run_id>-latest` link only its run."""
    p = find_path(run_dir)
    name = p.name
    if (m := UNIFIED_LINK.fullmatch(name)) and (p.is_symlink() or p.is_dir()) and _unified_steps(p.parent, m[1]):
        return p.parent, m[1], BEST if m[2] == "best" else None
    if (m := UNIFIED_DIR.fullmatch(name)) and p.is_dir() and _unified_steps(p.parent, m[1]):
        return p.parent, m[1], int(m[2])
    if (m := LEGACY_DIR.fullmatch(name)) and p.is_dir():
        return p.parent, None, int(m[2])
    return p, None, None


def _unified_steps(root: Path, run_id: str | None = None) -> dict[str, list[tuple[int, Path]]]:
    """SpecForge's unified step folders by run id (real folders only: the links are not steps)."""
    out: dict[str, list[tuple[int, Path]]] = {}
    for p in _entries(root):
        if (m := UNIFIED_DIR.fullmatch(p.name)) and not p.is_symlink() and p.is_dir() and run_id in (None, m[1]):
            out.setdefault(m[1], []).append((int(m[2]), p))
    return out


def _entries(root: Path) -> list[Path]:
    try:
        return sorted(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def run_ids(root: Path) -> list[str]:
    """The SpecForge run ids whose unified step folders a folder holds."""
    return sorted(_unified_steps(root))


def detect(root: Path) -> str | None:
    """The layout of a run folder (None: no step folder of any layout yet); several at once is refused."""
    found = []
    if list_steps(root):
        found.append(DFLASH)
    if any(LEGACY_DIR.fullmatch(p.name) and p.is_dir() for p in _entries(root)):
        found.append(LEGACY)
    if _unified_steps(root):
        found.append(UNIFIED)
    if len(found) > 1:
        raise CheckpointError(
            f"{root} holds step folders of several layouts ({'; '.join(WHERE[k] for k in found)}): which run is "
            "it? Point drafter.run_dir at a folder holding one run"
        )
    return found[0] if found else None


def unreadable(root: Path) -> CheckpointError:
    """The refusal of a run folder holding no step folder of any layout: what was looked for and what is there."""
    if not root.is_dir():
        return CheckpointError(
            f"drafter.run_dir={root} does not exist; point it at a training run folder (holding step_<N>/, "
            "epoch_<e>_step_<s>/ or <run_id>-step<N>/ folders)"
        )
    if in_git_history(root):
        return CheckpointError(
            f"{root} holds no step_<N>/ folders: its weights are kept in the git history, outside checkpoints/' "
            "budget (checkpoints/extra.txt); `make drafters` restores them"
        )
    names = [p.name + ("/" if p.is_dir() else "") for p in _entries(root)]
    there = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "nothing"
    hint = ""
    if "config.json" in names and any(n.endswith(".safetensors") for n in names):
        hint = (
            "; it looks like an HF-format drafter folder (e.g. `specforge export --to hf`): use drafter=hf "
            "drafter.path="
        )
    elif any(UNIFIED_DIR.fullmatch(n.rstrip("/")) for n in names):
        hint = "; its <run_id>-step<N>/ folders hold no training_state.pt"
    return CheckpointError(
        f"{root} holds no step folders of a layout this evaluator reads: looked for "
        f"{'; '.join(WHERE.values())}; found {there}{hint}. Is drafter.run_dir right?"
    )


# --- the steps --------------------------------------------------------------------------------------


def _files(folder: Path) -> tuple[tuple[str, int, int], ...]:
    out = []
    for p in sorted(folder.rglob("*")):
        try:
            st = p.stat()
        except OSError:  # removed while listed (a temporary file renamed)
            continue
        out.append((str(p.relative_to(folder)), st.st_size, st.st_mtime_ns))
    return tuple(out)


def legacy_incomplete(folder: Path) -> str | None:
    """Why a legacy SpecForge step folder cannot be read yet, None when its drafter files are whole."""
    names = sorted(p.name for p in _entries(folder))
    if tmp := [n for n in names if TEMP_NAME.search(n) or SAFETENSORS_TEMP.fullmatch(n)]:
        return f"a writer's temporary file is there ({tmp[0]}): the weights are being written"
    st = [n for n in names if n.endswith(".safetensors")]
    if "config.json" not in names or not st:
        return "config.json + model.safetensors are not there yet"
    if any(SHARD.fullmatch(n) for n in st):
        index = folder / "model.safetensors.index.json"
        try:
            wanted = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return "sharded weights without a readable model.safetensors.index.json yet (written last)"
        if missing := sorted(wanted - set(st)):
            return f"{missing[0]}, named by the index, is not there yet"
    return incomplete(folder)


def unified_incomplete(folder: Path) -> str | None:
    """Why a unified SpecForge step cannot be read yet: training_state.pt not renamed into place, or not a whole zip.
    The rank files (optimizer and RNG state) are not the drafter: their temporary files do not count."""
    names = {p.name for p in _entries(folder)}
    if PAYLOAD not in names:
        return f"{PAYLOAD} is not in place yet" + (" (its .tmp is being written)" if f"{PAYLOAD}.tmp" in names else "")
    if f"{PAYLOAD}.tmp" in names:
        return f"{PAYLOAD} is being rewritten ({PAYLOAD}.tmp is there)"
    return None if zipfile.is_zipfile(folder / PAYLOAD) else f"{PAYLOAD} is not a whole torch (zip) file yet"


def _legacy(root: Path) -> list[StepFolder]:
    """One StepFolder per micro-batch step s: the final save repeating s in the next epoch's folder is the same
    step (its labels name both; the complete folder of the latest epoch is read)."""
    by_step: dict[int, list[tuple[int, Path]]] = {}
    for p in _entries(root):
        if (m := LEGACY_DIR.fullmatch(p.name)) and p.is_dir():
            by_step.setdefault(int(m[2]), []).append((int(m[1]), p))
    out = []
    for s, folders in sorted(by_step.items()):
        seen = [(e, p, legacy_incomplete(p)) for e, p in sorted(folders)]
        e, p, why = max(seen, key=lambda t: (t[2] is None, t[0]))
        files = tuple(f for _, q, _ in seen for f in ((q.name + "/" + n, z, t) for n, z, t in _files(q)))
        out.append(StepFolder(s, p, files, why, LEGACY, e, tuple(q.name for _, q, _ in seen)))
    return out


def _link(root: Path, name: str, run_id: str) -> int | None:
    """The step a SpecForge link points at (a relative `<run_id>-step<N>`), None when missing or dangling."""
    try:
        target = os.readlink(root / name)
    except OSError:
        return None
    m = UNIFIED_DIR.fullmatch(Path(target).name)
    return int(m[2]) if m and m[1] == run_id and (root / Path(target).name).is_dir() else None


def read_best(root: Path, run_id: str) -> BestMeta | None:
    """`<run_id>.best_meta.json` (written atomically by SpecForge), None when absent, unreadable or for another run."""
    try:
        d = json.loads((root / f"{run_id}.best_meta.json").read_text())
        step = d["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(step, int) or isinstance(step, bool) or d.get("run_id", run_id) != run_id:
        return None
    metrics = {k: float(v) for k, v in (d.get("metrics") or {}).items() if isinstance(v, (int, float))}
    score = d.get("score")
    return BestMeta(step, str(d.get("metric", "")), float(score) if isinstance(score, (int, float)) else None, metrics)


def scan(run_dir: str | Path) -> RunFolder:
    """The run folder as it is now: layout, step folders by step with what each holds and why it is not complete."""
    root, run_id, pinned = locate(run_dir)
    layout = detect(root)
    if layout == DFLASH:
        folders = [(s, root / f"step_{s}") for s in list_steps(root)]
        steps = [StepFolder(s, d, _files(d), incomplete(d)) for s, d in folders if d.is_dir()]
        return RunFolder(root, layout, steps, pinned=pinned)
    if layout == LEGACY:
        return RunFolder(root, layout, _legacy(root), pinned=pinned)
    if layout is None:
        return RunFolder(root, None, [], pinned=pinned)
    runs = _unified_steps(root, run_id)
    if len(runs) > 1:
        raise CheckpointError(
            f"{root} holds the steps of several SpecForge runs ({', '.join(sorted(runs))}): point drafter.run_dir at "
            f"<run folder>/<run_id>-latest to pick one (e.g. {root / (sorted(runs)[0] + '-latest')})"
        )
    rid, found = next(iter(runs.items()))
    steps = [StepFolder(n, p, _files(p), unified_incomplete(p), UNIFIED) for n, p in sorted(found)]
    links = {k: s for k in ("latest", "best") if (s := _link(root, f"{rid}-{k}", rid)) is not None}
    best = read_best(root, rid)
    if best is not None and not (root / f"{rid}-step{best.step}").is_dir():
        best = None  # SpecForge forgets a best whose step is gone (a rewind)
    return RunFolder(root, layout, steps, rid, best, links, pinned)


def best_step(run: RunFolder) -> int:
    """drafter.step=best: the step the trainer recorded as its best (CheckpointError where none is recorded)."""
    if run.best is not None:
        return run.best.step
    if run.layout == UNIFIED:
        raise CheckpointError(
            f"drafter.step=best: {run.root} records no best step ({run.run_id}.best_meta.json is missing, or names a "
            "step that is gone): SpecForge records one when it evaluates during training. Name a step, or use all"
        )
    raise CheckpointError(
        f"drafter.step=best: a {run.layout} run ({WHERE[run.layout or DFLASH]}) records no best step; name a step, "
        "or use all (the training run's parent shows the step of best τ)"
    )


def find_step(run_dir: str | Path, step: int | str | None) -> tuple[RunFolder, StepFolder]:
    """drafter.step (N, null: the latest complete step, BEST) -> the run and that step's folder (CheckpointError
    naming what is missing)."""
    run = scan(run_dir)
    if run.layout is None:
        raise unreadable(run.root)
    if step is None and run.pinned is not None:
        step = run.pinned
    if step == BEST:
        step = best_step(run)
    if step is None and run.layout == DFLASH:
        return run, run.steps[-1]  # its readers say what is wrong with it, if anything
    if step is None:
        done = [f for f in run.steps if f.why_not is None]
        if not done:
            raise CheckpointError(
                f"{run.root}: no step is complete yet ("
                + "; ".join(f"{f.path.name}: {f.why_not}" for f in run.steps[-3:])
                + ")"
            )
        return run, done[-1]
    f = run.step(int(step))
    if f is None:
        raise CheckpointError(
            f"no checkpoint for step {step} in {run.root}; steps that exist: "
            + (", ".join(str(g.step) for g in run.steps) or "none")
        )
    if f.why_not is not None and run.layout != DFLASH:  # dflash's readers name what is wrong themselves
        raise CheckpointError(f"{f.path}: step {f.step} is not complete: {f.why_not}")
    return run, f


def digest_files(f: StepFolder) -> list[Path]:
    """The files a step's digest covers (the weights as stored): checkpoint.pt or the safetensors (dflash, legacy:
    the training_state.pt beside them is not the drafter), training_state.pt (specforge)."""
    if f.layout == UNIFIED:
        return [f.path / PAYLOAD]
    return checkpoint_files(f.path)


def origin(run: RunFolder, f: StepFolder) -> dict[str, Any]:
    """Where a step comes from, for its record: layout, what its step number counts, epoch, run id, folders."""
    out: dict[str, Any] = {"layout": f.layout, "step_unit": f.unit}
    if f.epoch is not None:
        out["epoch"] = f.epoch
    if run.run_id is not None:
        out["run_id"] = run.run_id
    if len(f.labels) > 1:
        out["folders"] = ", ".join(f.labels)
    return out
