"""dflash-eval: evaluation harness for DFlash speculative-decoding drafters (see README.md; the facts it relies on:
docs/family.md).

Where things live: `cli/` the commands (dflash-eval, dflash-compare; dflash-train and dflash-bench live in `train/`
and `bench/`); `evaluation/` one logged evaluation, its
pipeline and a training run's series; `stages/` prompts -> references -> features -> replay -> metrics; `result.py`
the typed result every reader takes; `models/` the drafter, the target and the decoding engine; `report/` what a
person reads; `tracking/` every MLflow name and the record's layout; `runs/` training runs on disk; `train/` the
reference trainer; `bench/` the cost ratios; `config/` and `conf/` the typed schema and its presets.
`dflash.evaluate(...)` evaluates one drafter from Python (dflash/evaluation/api.py; docs/training-runs.md)."""

from __future__ import annotations

from typing import Any


def evaluate(*args: Any, **kwargs: Any) -> Any:
    """dflash.evaluation.api.evaluate (imported on first use: `import dflash` loads neither torch nor MLflow)."""
    from dflash.evaluation.api import evaluate as _evaluate

    return _evaluate(*args, **kwargs)
