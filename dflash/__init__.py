"""dflash-eval: evaluation harness for DFlash speculative-decoding drafters (see README.md).

`dflash.evaluate(...)` evaluates one drafter from Python (dflash/api.py; docs/training-runs.md)."""

from __future__ import annotations

from typing import Any


def evaluate(*args: Any, **kwargs: Any) -> Any:
    """dflash.api.evaluate (imported on first use: `import dflash` loads neither torch nor MLflow)."""
    from dflash.api import evaluate as _evaluate

    return _evaluate(*args, **kwargs)
