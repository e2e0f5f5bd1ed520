"""What one process keeps between the jobs of a `-m` sweep it runs, behind one object.

A sweep in one process (Hydra's basic launcher) evaluates several checkpoints against one target:
the target's inspection and weights, and its tapped features, are the same for every job, so they
are kept in memory (`PROCESS`), each under its own name (`PROCESS.memo("features", ...)`).
`PROCESS.clear()` forgets all of it: what a new process would hold (a benchmark's fresh start, a
test's). A `Memo` is a keyed store, least recently used first; with `size_of` it counts bytes and
`put(..., cap=N)` drops the oldest entries beyond N; with `keep=1` it holds only its newest entry
(the target: the previous one is freed before another loads).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterator


class Memo:
    def __init__(self, size_of: Callable[[Any], int] | None = None, keep: int | None = None):
        self._items: OrderedDict[Hashable, Any] = OrderedDict()  # oldest first
        self.size_of, self.keep, self.bytes = size_of, keep, 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable, default: Any = None) -> Any:
        if key not in self._items:
            return default
        self._items.move_to_end(key)
        return self._items[key]

    def pop(self, key: Hashable) -> Any:
        value = self._items.pop(key, None)
        if value is not None and self.size_of:
            self.bytes -= self.size_of(value)
        return value

    def put(self, key: Hashable, value: Any, cap: int | None = None) -> None:
        self.pop(key)
        self._items[key] = value
        if self.size_of:
            self.bytes += self.size_of(value)
        while self._items and (
            (cap is not None and self.bytes > cap) or (self.keep is not None and len(self._items) > self.keep)
        ):
            self.pop(next(iter(self._items)))

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0


class ProcessMemo:
    def __init__(self) -> None:
        self._memos: dict[str, Memo] = {}

    def memo(self, name: str, size_of: Callable[[Any], int] | None = None, keep: int | None = None) -> Memo:
        """The memo named `name` (made on first use with these settings)."""
        if name not in self._memos:
            self._memos[name] = Memo(size_of, keep)
        return self._memos[name]

    def clear(self) -> None:
        """Forget everything this process keeps (as a new process would start)."""
        for m in self._memos.values():
            m.clear()


PROCESS = ProcessMemo()
