"""A training run's folder as a follower sees it: which step folders are there and which are complete.

`scan(run_dir)` lists the `step_<N>/` folders with what each holds (names, sizes, modification times) and why
it cannot be read yet (dflash.models.drafter.files.incomplete: a writer's temporary file, a torch zip
without its central directory, a safetensors file shorter than its header names). `Settle` remembers when
each folder last changed and calls it ready once it is complete and unchanged for `settle_s` seconds: a
trainer that writes in place (not by rename, as dflash.train does) may pause between files. Pure of time:
the caller passes the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash.models.drafter.files import incomplete, list_steps


@dataclass(frozen=True)
class StepFolder:
    step: int
    path: Path
    files: tuple[tuple[str, int, int], ...]  # (name, size, mtime_ns), sorted: changes when anything is written
    why_not: str | None  # None: complete


def _files(folder: Path) -> tuple[tuple[str, int, int], ...]:
    out = []
    for p in sorted(folder.rglob("*")):
        try:
            st = p.stat()
        except OSError:  # removed while listed (a temporary file renamed)
            continue
        out.append((str(p.relative_to(folder)), st.st_size, st.st_mtime_ns))
    return tuple(out)


def scan(run_dir: Path) -> list[StepFolder]:
    """The step folders of a run, by step."""
    out = []
    for s in list_steps(run_dir):
        d = run_dir / f"step_{s}"
        if d.is_dir():
            out.append(StepFolder(s, d, _files(d), incomplete(d)))
    return out


@dataclass
class Settle:
    """Ready = complete and unchanged for `settle_s` seconds (0: complete is enough)."""

    settle_s: float
    _since: dict[int, tuple[tuple, float]] = field(default_factory=dict)  # step -> (files, first seen so)

    def ready(self, folders: list[StepFolder], now: float) -> list[StepFolder]:
        out = []
        for f in folders:
            files, since = self._since.get(f.step, (None, now))
            if files != f.files:
                since = now
            self._since[f.step] = (f.files, since)
            if f.why_not is None and now - since >= self.settle_s:
                out.append(f)
        return out
