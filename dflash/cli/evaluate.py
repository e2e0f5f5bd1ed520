"""`dflash-eval [group=choice] [key=value]` (also `python -m dflash`, `python evaluate.py` in a clone): the Hydra app.

Composes dflash/conf/ into the typed, strict config (dflash/config/schema.py), then evaluates: one drafter
through the one logged evaluation (dflash/evaluation/logged.py: open the MLflow run, run the pipeline, log
the result; in a `-m` sweep a child of the sweep's parent), or several steps of a training run
(`drafter.step=all`, a list, a range, `follow=true`) through dflash/evaluation/series.py; prints a summary.
Exit policy (dflash/cli/app.py): bad input exits 2 with a message that says what to fix, a bug 1 with a
traceback, Ctrl-C / SIGTERM 130 / 143; the run ends FAILED or KILLED, never RUNNING. A sweep runs every job;
if one failed, its parent ends FAILED and the process exits 1. `mlflow.db`, `mlruns/` and Hydra's `outputs/`
land in the working directory.
"""

from __future__ import annotations

import json

import hydra
from omegaconf import DictConfig, OmegaConf

from dflash.cli import app
from dflash.cli.app import JobContext
from dflash.config import compose
from dflash.util.progress import configure

compose.register()


def evaluate(cfg: DictConfig, ctx: JobContext) -> float | None:
    from dflash.evaluation.preflight import check_inputs

    c = compose.to_object(cfg)
    configure(c.progress)
    if (
        ctx.sweep is None and ctx.job_num is None
    ):  # a single run fails fast, before torch, transformers and MLflow load;
        check_inputs(c)  # a sweep job gets its MLflow run, ended FAILED with the same error from the pipeline

    from dflash import tracking
    from dflash.evaluation import logged, pipeline
    from dflash.report import console
    from dflash.report.samples import samples_of

    if c.device.gpu_per_job and ctx.job_num is not None:
        c.device.name = pipeline.job_device(c.device.name, ctx.job_num)
    tags = {
        **{f"{tracking.GROUP_TAG}{k}": v for k, v in ctx.choices.items()},
        tracking.OVERRIDES_TAG: json.dumps(ctx.overrides),
        tracking.JOB_TAG: ctx.job_num,
    }
    if c.series:  # several steps of a training run, or follow=true: one parent per training run
        from dflash.evaluation import series

        return series.evaluate_training_run(c, OmegaConf.to_yaml(cfg), tags).last_tau
    parent = (
        tracking.SweepFamily(ctx.sweep.id, ctx.sweep.name, ctx.sweep.dir)
        if ctx.sweep is not None and c.tracking.enabled
        else None
    )
    out = logged.evaluate(c, lambda: pipeline.run(c), OmegaConf.to_yaml(cfg), tags, parent=parent)
    print(console.summary(out.result, out.where, samples=samples_of(out.result, min(c.num_samples, 1))))
    return out.result.metrics["acceptance_length"]


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    return app.run_job(evaluate, cfg)


def cli() -> None:
    """The console script `dflash-eval`."""
    app.main(main)


if __name__ == "__main__":
    cli()
