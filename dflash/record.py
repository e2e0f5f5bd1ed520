"""One evaluation logged: what the report makes of a result (its description, plots, samples) handed to
dflash.tracking, which owns every name and the layout (`tracking.log_eval`). evaluate.py, dflash.series and
dflash.api open and log runs through here."""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash.config.schema import EvalConfig, experiment_name
from dflash.stages.result import EvalResult


def open_run(cfg: EvalConfig, name: str, tags: dict[str, Any] | None = None, parent: Any = None):
    """The run an evaluation logs to (a `NoRun` when tracking.enabled=false), its config logged as params (null and
    auto left for `log_result`, which logs them as resolved); `parent`: a dflash.tracking family (sweep, training run)."""
    from dflash import tracking

    tc = cfg.tracking
    if not tc.enabled:
        return tracking.NoRun()
    run = tracking.Run(tc.uri, experiment_name(tc, cfg.target.name), name, tc.artifact_location, parent=parent, tags=tags)
    run.log_params({k: v for k, v in tracking.flatten(dataclasses.asdict(cfg)).items() if v != "auto"})
    return run


def log_result(run: Any, res: EvalResult, cfg: EvalConfig, config_text: str) -> None:
    """The result on its run: the report's description and files, through tracking's record."""
    from dflash import tracking
    from dflash.report import console, plots, samples

    if run.run_id is None:
        return  # tracking disabled
    ds = tracking.prompt_dataset(res, cfg.prompts)
    shown = samples.samples_of(res, cfg.num_samples)  # built here, by the report step
    files = {**plots.run_plots(res.total, res.info.run_name), **samples.artifacts(shown, res.info.run_name)}
    tracking.log_eval(run, res, tracking.EvalRecord(console.markdown(res, ds.name, cfg.target.name), files, config_text), ds)
