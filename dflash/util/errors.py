"""One family of user errors and the exit policy of every entry point.

A `UserError` is bad input the user can fix: config, files, prompts, checkpoints, server answers,
environment (a device that is not there, a store that cannot be written). Entry points catch it
and exit with `EXIT_USER` (2) and its message, no traceback (`HYDRA_FULL_ERROR=1` or
`DFLASH_VERBOSE=1` shows it). Anything else is a bug: exit 1 with a traceback.

Signals: `install_signal_handlers` turns SIGTERM (a timeout, SLURM preemption, `docker stop`) into
a `Terminated` exception raised in the main thread, so `finally` blocks and context managers run
(temporary folders removed, the MLflow run ended KILLED) exactly as they do for Ctrl-C's
KeyboardInterrupt. Exit codes follow the shell's convention: 130 for SIGINT, 143 for SIGTERM.
`signals_deferred()` holds both back while a run is being closed, so a second Ctrl-C cannot leave it
half-ended, and during every MLflow call (dflash.tracking.store.SignalSafeClient), so none lands inside a store
write; they are delivered (and raise) when the block ends.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Iterator

EXIT_USER = 2
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class UserError(Exception):
    """Bad input the user can fix; the message says what is wrong and how to fix it."""


class ConfigError(UserError):
    pass


class CheckpointError(UserError):
    pass


class PromptError(UserError):
    pass


class TargetError(UserError):
    pass


class ReferenceError(UserError):  # noqa: A001 (shadows the builtin weakref error, which nothing here uses)
    pass


class TrackingError(UserError):
    pass


class NumericsError(UserError):
    """Non-finite activations: the run's numbers would be meaningless (e.g. float16 overflow)."""


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like KeyboardInterrupt (a BaseException: `except Exception` lets it
    through)."""


def _raise_terminated(signum, frame):
    raise Terminated(f"terminated by signal {signum}")


def install_signal_handlers() -> None:
    """SIGTERM -> Terminated in the main thread (SIGINT already raises KeyboardInterrupt)."""
    signal.signal(signal.SIGTERM, _raise_terminated)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends, then act as they would have (main thread; elsewhere a no-op).
    Held by swapping the Python handlers, not by a signal mask: a process-directed signal reaches whichever thread
    does not block it, and Python runs its handler in the main thread all the same (torch and MLflow start threads)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in old.items():
            if handler is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(s, handler)
        for s in dict.fromkeys(pending):  # each signal once, in the order it came
            handler = old[s]
            if callable(handler):
                handler(s, None)  # raises (KeyboardInterrupt, Terminated), or an outer block's hold records it
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), s)


def exit_code(exc: BaseException) -> int:
    if isinstance(exc, Terminated):
        return EXIT_SIGTERM
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_SIGINT
    if isinstance(exc, UserError):
        return EXIT_USER
    return 1


def verbose() -> bool:
    """Show tracebacks of user errors too."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1" or os.environ.get("DFLASH_VERBOSE") == "1"
