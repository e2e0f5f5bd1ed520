"""`dflash.evaluate(...)`: one drafter evaluated from Python (a training loop's callback, a notebook), no Hydra app.

The `lm_eval.simple_evaluate` convention: keyword arguments in, the typed result out (`EvalResult`: metrics,
curves, per-prompt counters, run info), MLflow only when asked (`log=True`: a run as `dflash-eval`
logs it, in tracking.uri). Settings are named as on the command line: the presets of dflash/conf/ by name (`target=`,
`prompts=`), any other key through `overrides=["prompts.num_prompts=32", ...]`, composed and checked by the
same strict schema; or a ready `config=EvalConfig(...)` (no dflash/conf/ read at all). A path names the drafter:
a step folder (`<run>/step_<N>`, SpecForge's `epoch_<e>_step_<s>` or `<run_id>-step<N>`; or a run folder and `step=`),
or a public HF-format folder; SpecForge's unified steps also take `overrides=["drafter.config=<launch JSON>"]`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

from dflash.config.compose import compose
from dflash.config.schema import EvalConfig
from dflash.result import EvalResult
from dflash.util.errors import ConfigError
from dflash.util.files import find_path


def drafter_overrides(drafter: str | Path, step: int | None) -> list[str]:
    """A drafter path -> the drafter group's overrides: a step folder or a run folder of any layout (training:
    dflash/models/drafter/layouts.py; a SpecForge step folder or `-latest` / `-best` link names its run and step), an
    HF folder (hf)."""
    from dflash.models.drafter import layouts

    p = find_path(drafter)
    if step is None and p.name.startswith("step_") and p.name[5:].isdigit():
        return ["drafter=training", f"drafter.run_dir={p.parent}", f"drafter.step={int(p.name[5:])}"]
    root, _, _ = layouts.locate(p)
    if step is not None or root != p or layouts.detect(p) is not None:
        return ["drafter=training", f"drafter.run_dir={p}", f"drafter.step={'null' if step is None else int(step)}"]
    if (p / "config.json").is_file():
        return ["drafter=hf", f"drafter.path={p}"]
    raise ConfigError(
        f"drafter={drafter!r}: not a step folder, a training run folder (holding step_<N>/, epoch_<e>_step_<s>/ or "
        "<run_id>-step<N>/ folders) nor an HF-format folder (config.json + model.safetensors)"
    )


def evaluate(
    drafter: str | Path | None = None,
    *,
    step: int | None = None,
    target: str | None = None,
    prompts: str | None = None,
    overrides: Sequence[str] = (),
    config: EvalConfig | None = None,
    log: bool = False,
    tracking_uri: str | None = None,
    progress: bool = False,
) -> EvalResult:
    """Evaluate one drafter -> its `EvalResult` (`.metrics["acceptance_length"]` is τ). `drafter`, `target`, `prompts`
    and `overrides` compose dflash/conf/ as `dflash-eval` would (defaults: the schema's and
    dflash/conf/config.yaml's);
    `config` replaces all of them. `log=True` logs the run to MLflow (`tracking_uri`, else tracking.uri) and sets
    `result.run_id`. Bad input raises dflash.util.errors.UserError subclasses with the message the CLI prints."""
    from dflash.evaluation import logged, pipeline
    from dflash.util.progress import configure

    if config is None:
        args = [
            *(drafter_overrides(drafter, step) if drafter is not None else []),
            *([f"target={target}"] if target else []),
            *([f"prompts={prompts}"] if prompts else []),
            f"progress={str(progress).lower()}",
            f"tracking.enabled={str(log).lower()}",
            *([f"tracking.uri={tracking_uri}"] if tracking_uri else []),
            *overrides,
        ]
        config = compose(args)
    elif tracking_uri:
        config.tracking.uri = tracking_uri
    if config.series:
        raise ConfigError(
            f"dflash.evaluate evaluates one checkpoint; drafter.step={config.drafter.step!r} / follow=true evaluate a "
            f"training run: "
            "use `dflash-eval ... drafter.step=all` (or follow=true), or call dflash.evaluate once per step"
        )
    configure(config.progress)
    if not log:
        return pipeline.run(config)
    text = json.dumps(dataclasses.asdict(config), indent=1, default=str)  # JSON is YAML
    return logged.evaluate(config, lambda: pipeline.run(config), text).result
