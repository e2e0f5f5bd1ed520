"""`drafter.step` as written -> the step folders of a training run it selects (checked by the schema,
dflash/config/schema.py).

Forms: null or `latest` (the latest complete step), `best` (the step the trainer recorded as its best: SpecForge's
`<run_id>.best_meta.json`), N, `all`, a list `[N, M]`, a range `A..B` of training steps (both ends included, either
open), and `/k` after `all` or a range: every k-th step folder of those.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from dflash.util.errors import ConfigError

STEP_SYNTAX = (
    "use null or latest (the latest complete step), best (the trainer's recorded best), a step N, all, a list "
    "[N,M,...], a range A..B of training steps (both ends included; A.. or ..B leave one end open), and /k after "
    "all or a range for every k-th step folder of those (all/2, 1000..9000/4)"
)


@dataclass(frozen=True)
class StepSelection:
    """Which step folders of a training run `drafter.step` names: one (`single`: N, or null for the latest) or several
    (`all`, a list, a range A..B, each of them optionally thinned to every k-th folder by `/k`)."""

    single: bool = True
    step: Optional[int] = None  # single: the step; None: the latest (or the best, `best`)
    best: bool = False  # single: the step the trainer recorded as its best
    steps: Optional[tuple[int, ...]] = None  # a list
    lo: Optional[int] = None  # a range's ends (inclusive); None: open
    hi: Optional[int] = None
    every: int = 1

    @property
    def many(self) -> bool:
        return not self.single

    @classmethod
    def parse(cls, value: Any) -> "StepSelection":
        """drafter.step as written -> the selection; ConfigError naming the syntax when it is none of the forms."""
        bad = ConfigError(f"drafter.step={value!r} is not a step selection: {STEP_SYNTAX}")
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            if value is not None and value < 0:
                raise bad
            return cls(step=value)
        if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
            items = list(value)
            if not items or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in items):
                raise bad
            return cls(single=False, steps=tuple(sorted(set(items))))
        if not isinstance(value, str):
            raise bad
        if value.strip() in ("latest", "best"):
            return cls(best=value.strip() == "best")
        m = re.fullmatch(r"\s*(all|(\d*)\.\.(\d*)|\d+)\s*(?:/\s*(\d+))?\s*", value)
        if not m or (m.group(4) is not None and (m.group(1).isdigit() or int(m.group(4)) < 1)):
            raise bad
        if m.group(1).isdigit():
            return cls(step=int(m.group(1)))
        every = int(m.group(4) or 1)
        if m.group(1) == "all":
            return cls(single=False, every=every)
        lo, hi = (int(g) if g else None for g in (m.group(2), m.group(3)))
        if lo is not None and hi is not None and lo > hi:
            raise ConfigError(f"drafter.step={value!r}: the range's start is past its end; {STEP_SYNTAX}")
        return cls(single=False, lo=lo, hi=hi, every=every)

    @property
    def value(self) -> int | str | None:
        """A single selection as the loader takes it: N, None (the latest) or "best"."""
        return "best" if self.best else self.step

    def select(self, steps: list[int], best: int | None = None) -> list[int]:
        """The selected steps among those a run folder holds (sorted); a single selection: its step, the latest, or
        `best` (the trainer's recorded best step; none recorded: none)."""
        have = sorted(steps)
        if self.best:
            return [best] if best is not None else []
        if self.single:
            return [self.step] if self.step is not None else have[-1:]
        if self.steps is not None:
            return [s for s in have if s in self.steps]
        inside = [s for s in have if (self.lo is None or s >= self.lo) and (self.hi is None or s <= self.hi)]
        return inside[:: self.every]
