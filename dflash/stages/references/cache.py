"""The reference cache: one JSON file per reference, named by the sha256 of all that decides it.

`reference_key` hashes target identity, source (local with its dtype; for a server, what it
reports serving and the request it gets), rendered prompt ids, max_new_tokens and template
options. `ReferenceCache` reads and writes `<cache_dir>/references/<k[:2]>/<k>.json` atomically
(dflash/util/files.py: the umask is followed), keeps a server's speculative counters beside each
reference, turns read-only (with a warning) when a write fails, and `drop`s an entry the run refused
(it is never reused). `completion_problem` is the check every completion passes, generated or read back.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

from dflash.stages.references.served import Served
from dflash.util.files import atomic_write_text
from dflash.util.progress import log


def reference_key(
    identity: str, source: str, prompt_ids: list[int], max_new_tokens: int, template: dict[str, Any]
) -> str:
    blob = json.dumps([identity, source, prompt_ids, max_new_tokens, sorted(template.items())], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def completion_problem(ids: Any, max_new_tokens: int, eos_ids: list[int], vocab_size: int) -> str | None:
    """What is wrong with a completion as a greedy reference, or None."""
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return "is not a list of token ids"
    if not ids:
        return "is empty"
    if len(ids) > max_new_tokens:
        return f"has {len(ids)} tokens, more than max_new_tokens={max_new_tokens}"
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"holds token id {bad}, outside the target's vocabulary (0..{vocab_size - 1})"
    stop = set(eos_ids)
    early = next((k for k, t in enumerate(ids[:-1]) if t in stop), None)
    if early is not None:
        return f"goes on past the stop token {ids[early]} at position {early}"
    if len(ids) < max_new_tokens and ids[-1] not in stop:
        return (
            f"stops after {len(ids)} of {max_new_tokens} tokens at token {ids[-1]}, not at one of the target's stop "
            f"tokens {eos_ids}"
        )
    return None


class ReferenceCache:
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser() / "references"
        self.read_only: str | None = None  # why the cache cannot be written

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def drop(self, key: str) -> bool:
        """Remove a reference the run refused, so no later run reuses it; -> whether one was there."""
        try:
            self._path(key).unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            log.warning(
                "references: cannot remove the refused reference %s (%s); references.refresh=true replaces it",
                self._path(key),
                e,
            )
            return False

    def get(self, key: str, problem: Callable[[Any], str | None] | None = None) -> list[int] | None:
        """The cached completion, or None where there is none or it is unreadable or fails `problem`."""
        try:
            ids = json.loads(self._path(key).read_text())["completion_ids"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return ids if (problem or (lambda _: None))(ids) is None else None

    def served(self, key: str) -> Served | None:
        """The server's speculative counters kept beside a cached reference (None: none were reported)."""
        try:
            return Served.from_dict(json.loads(self._path(key).read_text()).get("served"))
        except (OSError, ValueError, AttributeError):
            return None

    def put(self, key: str, completion_ids: list[int], meta: dict[str, Any]) -> None:
        if self.read_only:
            return
        try:
            atomic_write_text(self._path(key), json.dumps({**meta, "completion_ids": completion_ids}))
        except OSError as e:  # disk full, permissions changed under us: keep the run going
            self.read_only = f"{type(e).__name__}: {e}"
            log.warning(
                "references: cannot write the cache %s (%s): this run's references stay in memory only",
                self.root,
                self.read_only,
            )

    def check_writable(self) -> str | None:
        """Try to write here (a probe file, removed); -> why not, or None."""
        try:
            probe = self.root / f".write-probe-{os.getpid()}"
            atomic_write_text(probe, "")
            probe.unlink()
        except OSError as e:
            self.read_only = f"{type(e).__name__}: {e}"
        return self.read_only
