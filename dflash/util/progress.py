"""Progress: every stage announces itself, every long loop shows how far it is.

Everything goes through `logging` (logger `dflash`), so Hydra's job log (`evaluate.log`) holds
it as well as the console. Long loops use `Progress`: a tqdm bar when stderr is a terminal,
otherwise a log line at most every `interval` seconds (10 by default) and one at the end, so a
job log or CI output shows movement without a line per item. `configure(enabled=False)`
(`progress=false`) silences bars and stage lines; warnings still show.

    log.info("features: %d prompts, %d tokens", n, t)          # a stage announces itself
    with Progress("references", total=n_tokens, unit="tok") as bar:
        ...; bar.update(k)
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Iterable, Iterator, TypeVar

log = logging.getLogger("dflash")
T = TypeVar("T")
_enabled = True
clock = time.monotonic  # seconds; tests put a fake clock here


def configure(enabled: bool = True) -> None:
    """Turn stage lines and bars on or off; make sure INFO lines reach stderr outside Hydra too."""
    global _enabled
    _enabled = enabled
    log.setLevel(logging.INFO if enabled else logging.WARNING)
    root = logging.getLogger()
    if not root.handlers and not log.handlers:  # not under Hydra (which configures the root logger)
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
        log.addHandler(h)
        log.propagate = False


def enabled() -> bool:
    return _enabled


class Progress:
    """A bar on a terminal, periodic log lines elsewhere. Use as a context manager."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "it", interval: float = 10.0):
        self.desc, self.total, self.unit, self.interval = desc, total, unit, interval
        self.n = 0
        self.t0 = self.last = clock()
        self.bar: Any = None
        if _enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close(ok=exc[0] is None)

    def _line(self, verb: str) -> str:
        dt = clock() - self.t0
        of = f"/{self.total}" if self.total is not None else ""
        rate = f", {self.n / dt:.1f} {self.unit}/s" if dt > 0 and self.n else ""
        return f"{self.desc}: {verb} {self.n}{of} {self.unit} in {dt:.1f} s{rate}"

    def update(self, n: int = 1, **postfix: Any) -> None:
        self.n += n
        if not _enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            return
        now = clock()
        if now - self.last >= self.interval:
            self.last = now
            extra = "".join(f", {k} {v}" for k, v in postfix.items())
            log.info(self._line("at") + extra)

    def shrink_total(self, n: int) -> None:
        """n of the total will not come (a row that stopped early leaves its budget unused): the bar still ends full."""
        if self.total is None or n <= 0:
            return
        self.total -= n
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def close(self, ok: bool = True) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if _enabled and ok:
            log.info(self._line("done"))


def track(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """Iterate with a Progress counting one per item."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(desc, total, unit) as p:
        for x in items:
            yield x
            p.update()
