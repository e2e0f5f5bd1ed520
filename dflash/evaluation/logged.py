"""One evaluation, logged: open its MLflow run, evaluate, hand the result to tracking, end the run.

`evaluate(cfg, work, config_text, ...)` is the one place that sequence is written; the command line
(dflash/cli/evaluate.py), the Python API (dflash/evaluation/api.py) and every step of a training run
(dflash/evaluation/series.py) go through it. `work()` runs inside the open run, so a failure or a signal
ends the run FAILED or KILLED, never RUNNING; a signal that comes while MLflow creates the run is held back until
the run is open, and ends it KILLED too. What the report makes of a result (its description, plots,
samples) is composed here and handed to dflash.tracking, which owns every name and the layout
(`tracking.log_eval`). With tracking.enabled=false nothing is logged and `Logged.where` says so.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from dflash.config.schema import EvalConfig, experiment_name
from dflash.evaluation.pipeline import run_name
from dflash.result import EvalResult
from dflash.util.errors import signals_deferred


@dataclass
class Logged:
    result: EvalResult
    where: str  # the run and how to open it (or "tracking disabled")


def evaluate(
    cfg: EvalConfig,
    work: Callable[[], EvalResult],
    config_text: str,
    tags: dict[str, Any] | None = None,
    parent: Any = None,
) -> Logged:
    """`work()` inside the run `cfg` logs to (a child of `parent`, a dflash.tracking family, where given), its
    result logged there; the result carries the run's id (`result.run_id`, None when tracking is off)."""
    with open_run(cfg, run_name(cfg.drafter), tags, parent) as run:
        res = work()
        log_result(run, res, cfg, config_text)
    res.run_id = run.run_id
    return Logged(res, run.where())


@contextmanager
def open_run(cfg: EvalConfig, name: str, tags: dict[str, Any] | None = None, parent: Any = None) -> Iterator[Any]:
    """The run an evaluation logs to, open for the block (a `NoRun` when tracking.enabled=false), its config logged as
    params (null and auto left for `log_result`, which logs them as resolved). SIGINT / SIGTERM wait while the run is
    created and entered: one that came meanwhile is raised inside the block, so the run ends KILLED (raised between
    MLflow's create_run and `with`, it would leave the run RUNNING)."""
    from dflash import tracking

    tc = cfg.tracking
    if not tc.enabled:
        yield tracking.NoRun()
        return
    with ExitStack() as stack:
        with signals_deferred():
            run = stack.enter_context(
                tracking.Run(
                    tc.uri, experiment_name(tc, cfg.target.name), name, tc.artifact_location, parent=parent, tags=tags
                )
            )
        run.log_params({k: v for k, v in tracking.flatten(dataclasses.asdict(cfg)).items() if v != "auto"})
        yield run


def log_result(run: Any, res: EvalResult, cfg: EvalConfig, config_text: str) -> None:
    """The result on its run: the report's description and files, through tracking's record."""
    from dflash import tracking
    from dflash.report import console, plots, samples

    if run.run_id is None:
        return  # tracking disabled
    ds = tracking.prompt_dataset(res, cfg.prompts)
    shown = samples.samples_of(res, cfg.num_samples)  # built here, by the report step
    files = {**plots.run_plots(res.total, res.info.run_name), **samples.artifacts(shown, res.info.run_name)}
    tracking.log_eval(
        run, res, tracking.EvalRecord(console.markdown(res, ds.name, cfg.target.name), files, config_text), ds
    )
