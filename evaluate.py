"""Entry point: `python evaluate.py [group=choice] [key=value]` (Hydra; `-m` sweeps).

Composes conf/ into the typed, strict config (dflash/config/schema.py), opens an MLflow run (a child of
the sweep's parent in a `-m` sweep), runs the pipeline (load -> references -> features -> replay
-> metrics), logs the result (`log_result`; the layout is in dflash/tracking/__init__.py), prints a summary.
Exit policy (dflash/entry.py): bad input exits 2 with a message that says what to fix, a bug 1
with a traceback, Ctrl-C / SIGTERM 130 / 143; the run ends FAILED or KILLED, never RUNNING. A
sweep runs every job; if one failed, its parent ends FAILED and the process exits 1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from dflash import entry
from dflash.config import schema as config_mod
from dflash.config.schema import EvalConfig
from dflash.entry import JobContext
from dflash.util.progress import configure

config_mod.register()


def prompt_dataset(res, c: EvalConfig) -> dict[str, Any]:
    """The selected prompts as an MLflow dataset input: a name, a digest of their content, where they came from."""
    pc = c.prompts
    rows = [[r.prompt.id, r.prompt.subset, [list(m) for m in r.prompt.messages]] for r in res.prompts]
    digest = hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode()).hexdigest()[:12]
    name = f"prompts:{pc.source}" + (f":{pc.path.rsplit('/', 1)[-1]}" if pc.path else "")
    profile = {"prompts": len(rows), "subsets": dict(Counter(r[1] for r in rows)), "prompt_tokens": sum(len(r.prompt_ids) for r in res.prompts)}
    source = {"source": pc.source, "path": pc.path, "num_prompts": pc.num_prompts, "subsets": pc.subsets, "ids": [r[0] for r in rows]}
    return {"name": name, "digest": digest, "source": source, "profile": profile}


def resolved_params(res) -> dict[str, Any]:
    """What the config left to the checkpoint, the target or `auto`, as evaluated."""
    i = res.info
    return {
        "drafter.name": i.drafter_name,
        "drafter.step": i.drafter_step,
        "drafter.block_size": i.block_size,
        "drafter.target_layer_ids": i.target_layer_ids,
        "drafter.mask_token_id": i.mask_token_id,
        "device.name": i.device,
        "device.dtype": i.dtype,
        "target.dtype": i.dtype,
        "replay.anchors": i.replay_anchors,
        **{f"drafter.config.{k}": v for k, v in i.drafter_config.items()},
    }  # the drafter as built (dflash.models.drafter_config)


def log_result(run, res, c: EvalConfig, composed: DictConfig) -> None:
    from dflash import tracking
    from dflash.report import console as report
    from dflash.report import plots, samples
    from dflash.stages.metrics import commit_share, position_table
    from dflash.stages.result import per_prompt_row
    from dflash.stages.served import served_histogram

    info = res.info
    run.set_run_name(info.run_name)  # the step is known now
    run.set_tags({
        "checkpoint_path": info.checkpoint_path, "checkpoint_sha256": info.checkpoint_sha256,
        "drafter_step": info.drafter_step, "device": info.device, "dtype": info.dtype, "target_identity": info.target_identity,
        "warnings": " | ".join(res.warnings) or None, "target.linear_attention_kernel": info.linear_attention_kernel,
        "references.engine": info.references.engine,
    })
    run.log_params(resolved_params(res))  # only keys not logged at the start (they were null or auto)
    curves = {f"by_position/{kind}": v for kind, v in res.curves.items()}  # step = draft slot k
    run.log_metrics({**res.metrics, **tracking.prompt_lookup_metrics(res.prompt_lookup), **{f"time/{k}": v for k, v in res.timings.items()}},
                    curves=curves)
    run.log_metrics({}, curves={"by_commit/share": commit_share(res.total)})  # step = tokens committed by a verify step
    if share := served_histogram(list(info.references.served.values())):
        run.log_metrics({}, curves={"served/by_commit/share": share})  # the server's own histogram, same steps
    ds = prompt_dataset(res, c)
    run.log_dataset(**ds)
    run.set_note(report.markdown(res, ds["name"], c.target.name))
    run.log_text(OmegaConf.to_yaml(composed), "config.yaml")
    run.log_per_prompt([per_prompt_row(r).to_dict() for r in res.prompts])
    run.log_table(position_table(res.total), "per_position.json")
    run.log_files({**plots.run_plots(res.total, info.run_name), **samples.artifacts(res.samples, info.run_name)})
    run.setup_eval_experiment(sorted({r.prompt.subset for r in res.prompts}))


def evaluate(cfg: DictConfig, ctx: JobContext) -> float | None:
    from dflash.stages.preflight import check_inputs

    c = config_mod.to_object(cfg)
    configure(c.progress)
    if ctx.sweep is None and ctx.job_num is None:  # a single run fails fast, before torch, transformers and MLflow load;
        check_inputs(c)  # a sweep job gets its MLflow run, ended FAILED with the same error from the pipeline

    from dflash import pipeline, tracking
    from dflash.report import console as report

    if c.device.gpu_per_job and ctx.job_num is not None:
        c.device.name = pipeline.job_device(c.device.name, ctx.job_num)
    tc = c.tracking
    if tc.enabled:
        tags = {**{f"group.{k}": v for k, v in ctx.choices.items()}, "overrides": json.dumps(ctx.overrides), "dflash.job": ctx.job_num}
        run = tracking.Run(
            tc.uri, config_mod.experiment_name(tc, c.target.name), pipeline.run_name(c.drafter), tc.artifact_location, sweep=ctx.sweep, tags=tags
        )
    else:
        run = tracking.NoRun()
    with run:
        run.log_params({k: v for k, v in tracking.flatten(dataclasses.asdict(c)).items() if v != "auto"})  # as configured; None left for later
        res = pipeline.run(c)
        log_result(run, res, c, cfg)
    print(report.summary(res, run.where()))
    return res.metrics["acceptance_length"]


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    return entry.run_job(evaluate, cfg)


if __name__ == "__main__":
    entry.main(main)
