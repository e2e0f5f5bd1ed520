"""Entry point: `python evaluate.py [group=choice] [key=value]` (Hydra; `-m` sweeps).

Composes conf/ into a typed config, opens an MLflow run, runs the pipeline
(load -> references -> features -> replay -> metrics), logs the result, prints a summary.
Bad input exits with status 2 and a message that says what to fix; the MLflow run of a failed
evaluation ends FAILED.
"""

from __future__ import annotations

import dataclasses
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from dflash import config as config_mod
from dflash.errors import UserError

config_mod.register()


def log_result(run, res, cfg: dict) -> None:
    from dflash import plots, samples
    from dflash.pipeline import per_prompt_row

    info = res.info
    run.set_tags({
        "mlflow.runName": info.run_name, "checkpoint_path": info.checkpoint_path, "checkpoint_sha256": info.checkpoint_sha256,
        "drafter_step": info.drafter_step, "device": info.device, "dtype": info.dtype, "target_identity": info.target_identity,
        "warnings": " | ".join(res.warnings) or None,
    })
    run.log_metrics({**res.metrics, **{f"time/{k}": v for k, v in res.timings.items()}}, curves=res.curves)
    run.log_text(OmegaConf.to_yaml(OmegaConf.create(cfg)), "config.yaml")
    run.log_table([per_prompt_row(r) for r in res.prompts], "per_prompt.json")
    run.log_files({**plots.run_plots(res.total, info.run_name), **samples.artifacts(res.samples, info.run_name)})


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    from dflash import pipeline, report, tracking

    try:
        c = config_mod.to_object(cfg)
    except Exception as e:  # a ??? left unset, an interpolation that fails
        print(f"dflash-eval: config error: {e}", file=sys.stderr)
        sys.exit(2)
    ctx = config_mod.hydra_context()
    if c.device.gpu_per_job and ctx["job_num"] is not None:
        c.device.name = pipeline.job_device(c.device.name, ctx["job_num"])
    tc = c.tracking
    params = dataclasses.asdict(c)
    if tc.enabled:
        run = tracking.Run(
            tc.uri, tc.experiment or f"dflash/{c.target.name}", pipeline.run_name(c.drafter), tc.artifact_location,
            sweep_dir=ctx["sweep_dir"], tags={**{f"group.{k}": v for k, v in ctx["choices"].items()}, "overrides": " ".join(ctx["overrides"])},
        )
        run.log_params(params)
    else:
        run = tracking.NoRun()
    try:
        with run:
            res = pipeline.run(c)
            log_result(run, res, params)
    except UserError as e:
        print(f"dflash-eval: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(report.summary(res, run.where()))
    return float(res.metrics["acceptance_length"])


if __name__ == "__main__":
    main()
