"""Atomic writes that follow the umask: what every cache and export of this project writes through.

A reader sees the old file (or folder) or the new one, never half of one: the content is written
under a temporary name beside its destination, then renamed over it. The file, or the folder and
everything in it, ends 0666 / 0777 minus the umask, like what `open()` and `mkdir` make (not
`tempfile`'s 0600 / 0700, nor the 0600 some writers such as safetensors' `save_file` use), so a
cache shared by a team (umask 002) stays readable and writable by the group. Whatever
exception passes (KeyboardInterrupt, SIGTERM's `Terminated` included), the temporary name goes.

    atomic_write_text(path, text); atomic_write_bytes(path, data)
    atomic_write(path, lambda tmp: save_file(tensors, tmp))      # any writer that takes a path
    with atomic_dir(dest) as tmp: model.save_pretrained(tmp)     # a folder, renamed when complete
    open_append(path)                                            # a log appended line by line (not atomic)
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


def umask() -> int:
    """The process's umask, read without changing it (Linux: /proc/self/status)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def _follow_umask(path: Path) -> None:
    """Give `path` (and, for a folder, everything in it) the modes a new file / folder gets."""
    m = umask()
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~m)
    if path.is_dir():
        for root, dirs, files in os.walk(path):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o777 & ~m)
            for name in files:
                os.chmod(os.path.join(root, name), 0o666 & ~m)


def _tmp_name(dest: Path) -> Path:
    """A fresh name beside `dest` that says whose it is (host, pid), for the stale-folder sweep."""
    return dest.with_name(f"{dest.name}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """`write(tmp_path)` writes the content to a path; it then replaces `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        write(str(tmp))
        _follow_umask(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def open_append(path: str | Path):
    """A log file opened to append lines (e.g. metrics.jsonl): created like `open()` makes files
    (0666 minus the umask), its folder made if missing; each line is flushed by the caller."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a", encoding="utf-8")


def remove_stale(dest: Path) -> list[Path]:
    """Remove temporary folders for `dest` left by processes of this host that are gone (a hard kill)."""
    mine = f"{dest.name}.tmp-{socket.gethostname()}-"
    gone = []
    for d in dest.parent.glob(mine + "*"):
        try:
            os.kill(int(d.name[len(mine) :].split("-")[0]), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
        except (ValueError, PermissionError):
            pass
    return gone


@contextmanager
def atomic_dir(dest: str | Path, replace: bool = False) -> Iterator[Path]:
    """A temporary folder beside `dest`, renamed to `dest` when the block ends without an exception.
    An existing `dest` stays (another process's copy is as good as ours), unless `replace`: then it
    is removed just before the rename."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(dest)
    os.mkdir(tmp, 0o777)
    try:
        yield tmp
        _follow_umask(tmp)
        if replace and dest.exists():
            shutil.rmtree(dest)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not dest.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


PROJECT_ROOT = Path(__file__).resolve().parents[2]


def find_path(p: str | Path) -> Path:
    """A relative path is looked up in the working directory, then in the project root (so the
    shipped `checkpoints/...` work from anywhere)."""
    path = Path(p).expanduser()
    if not path.is_absolute() and not path.exists() and (PROJECT_ROOT / path).exists():
        return PROJECT_ROOT / path
    return path
