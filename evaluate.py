"""Entry point: `python evaluate.py [group=choice] [key=value]` (Hydra; `-m` sweeps).

Composes conf/ into the typed, strict config (dflash/config/schema.py), opens an MLflow run (a child of
the sweep's parent in a `-m` sweep), runs the pipeline (load -> references -> features -> replay
-> metrics), logs the result (dflash/record.py; every name and the layout: dflash/tracking/record.py), prints a
summary. Several steps of a training run (`drafter.step=all`, a list, a range) or `follow=true` go to
dflash/series.py: one process, one MLflow parent per training run, a child per step.
Exit policy (dflash/entry.py): bad input exits 2 with a message that says what to fix, a bug 1
with a traceback, Ctrl-C / SIGTERM 130 / 143; the run ends FAILED or KILLED, never RUNNING. A
sweep runs every job; if one failed, its parent ends FAILED and the process exits 1.
"""

from __future__ import annotations

import json

import hydra
from omegaconf import DictConfig, OmegaConf

from dflash import entry
from dflash.config import schema as config_mod
from dflash.entry import JobContext
from dflash.util.progress import configure

config_mod.register()


def evaluate(cfg: DictConfig, ctx: JobContext) -> float | None:
    from dflash.stages.preflight import check_inputs

    c = config_mod.to_object(cfg)
    configure(c.progress)
    if ctx.sweep is None and ctx.job_num is None:  # a single run fails fast, before torch, transformers and MLflow load;
        check_inputs(c)  # a sweep job gets its MLflow run, ended FAILED with the same error from the pipeline

    from dflash import pipeline, record, tracking
    from dflash.report import console as report
    from dflash.report.samples import samples_of

    if c.device.gpu_per_job and ctx.job_num is not None:
        c.device.name = pipeline.job_device(c.device.name, ctx.job_num)
    tags = {**{f"{tracking.GROUP_TAG}{k}": v for k, v in ctx.choices.items()}, tracking.OVERRIDES_TAG: json.dumps(ctx.overrides),
            tracking.JOB_TAG: ctx.job_num}
    if c.series:  # several steps of a training run, or follow=true: one parent per training run (dflash/series.py)
        from dflash import series

        out = series.evaluate_training_run(c, OmegaConf.to_yaml(cfg), tags)
        return out.last_tau
    parent = tracking.SweepFamily(ctx.sweep.id, ctx.sweep.name, ctx.sweep.dir) if ctx.sweep is not None and c.tracking.enabled else None
    with record.open_run(c, pipeline.run_name(c.drafter), tags, parent=parent) as run:
        res = pipeline.run(c)
        record.log_result(run, res, c, OmegaConf.to_yaml(cfg))
    print(report.summary(res, run.where(), samples=samples_of(res, min(c.num_samples, 1))))
    return res.metrics["acceptance_length"]


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    return entry.run_job(evaluate, cfg)


if __name__ == "__main__":
    entry.main(main)
