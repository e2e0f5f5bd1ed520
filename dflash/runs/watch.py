"""A training run's folder as a follower sees it: which step folders are there and which are ready to read.

`scan(run_dir)` (dflash.models.drafter.layouts: every layout's step folders, with what each holds, names, sizes and
modification times, and why it cannot be read yet). `Settle` remembers when each step last changed and calls it
ready once it is complete and unchanged for `settle_s` seconds: a trainer that writes in place (not by rename, as
dflash.train and SpecForge's unified trainer do) may pause between files. `settled(f, now, settle_s)`: the same
question for a run read once (no follower): its newest file older than `settle_s` by the wall clock. Pure of time:
the caller passes the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash.models.drafter.layouts import StepFolder, scan

__all__ = ["Settle", "StepFolder", "scan", "settled"]


def settled(f: StepFolder, now_s: float, settle_s: float) -> bool:
    """Whether a step folder's files are older than `settle_s` (wall clock, seconds since the epoch)."""
    return now_s - f.newest_ns / 1e9 >= settle_s


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
