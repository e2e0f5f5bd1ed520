"""An evaluation run's record in MLflow: every name it holds (tags, params, artifacts, curves), defined once,
and `log_eval`, which writes one result under those names. Readers (dflash.tracking.parents, store.load_per_prompt,
dflash.cli.compare through `RunTags`) read back through the same constants.

What the report makes of a result (the description, plots, samples) arrives ready as an `EvalRecord`
(dflash/evaluation/logged.py composes it): this module only decides where each piece goes.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from dflash.result import EvalResult, PromptLookup, per_prompt_row

# tags of an evaluation run
CHECKPOINT_PATH_TAG = "checkpoint_path"
CHECKPOINT_SHA_TAG = "checkpoint_sha256"  # a training run's parent matches steps already evaluated by it
DRAFTER_STEP_TAG = "drafter_step"
ORIGIN_TAG = "checkpoint."  # + layout | step_unit (micro_batch: SpecForge's legacy steps) | epoch | run_id | folders
DEVICE_TAG, DTYPE_TAG = "device", "dtype"
TARGET_TAG = "target_identity"
WARNINGS_TAG = "warnings"
LINEAR_KERNEL_TAG = "target.linear_attention_kernel"
REFERENCE_ENGINE_TAG = "references.engine"
OVERRIDES_TAG = "overrides"  # the job's Hydra overrides (JSON list)
JOB_TAG = "dflash.job"  # a sweep job's number
GROUP_TAG = "group."  # + a Hydra group: its choice
ERROR_TAG = "error"  # why a run ended FAILED
KILLED_TAG = "dflash.killed"  # why a run ended KILLED

# tags of a training run's own MLflow run (dflash.train)
KIND_TAG = "dflash.kind"  # "train"
VARIANT_TAG = "dflash.variant"
BUG_TAG = "dflash.bug."  # + a bug's name: whether the variant has it
IMPORTED_FROM_TAG = "dflash.imported_from"  # a metrics.jsonl logged after the fact


def train_tags(variant: str, bugs: dict[str, bool], imported_from: str | None = None) -> dict[str, str | None]:
    """The tags of a dflash.train run (one per variant)."""
    return {
        KIND_TAG: "train",
        VARIANT_TAG: variant,
        IMPORTED_FROM_TAG: imported_from,
        **{f"{BUG_TAG}{k}": str(v) for k, v in bugs.items()},
    }


# artifacts
CONFIG_FILE = "config.yaml"
PER_POSITION = "per_position.json"
PER_PROMPT = "per_prompt.json"  # the per-prompt rows (Run.log_per_prompt, store.load_per_prompt, dflash-compare)

# curves (MLflow step = draft slot k, or tokens committed by a verify step) and scalar prefixes
BY_POSITION = "by_position/"  # + accept_rate | accept_rate_cond | accuracy | ...
BY_COMMIT = "by_commit/share"
SERVED_BY_COMMIT = "served/by_commit/share"
TIME = "time/"  # + a stage: its seconds
TAU = "acceptance_length"

# the yardstick (dflash/stages/replay/prompt_lookup.py): prompt lookup's τ over prompts and the drafter's paired gain on
# it; its settings are the run's params prompt_lookup.*; a sweep reads the τ back (parents.ChildRun.prompt_lookup_tau)
PROMPT_LOOKUP_TAU = "prompt_lookup/acceptance_length"
PROMPT_LOOKUP_TAU_SE = "prompt_lookup/acceptance_length_se"
PROMPT_LOOKUP_GAIN = "prompt_lookup/gain"
PROMPT_LOOKUP_GAIN_SE = "prompt_lookup/gain_se"

# DFlash2 drafters' extras (dflash/stages/metrics.py computes them; absent for DFlash, not 0), each with the SpecForge
# training metric it answers (docs/family.md §8.5; docs/dflash2.md). SpecForge's are teacher-forced on sampled training
# anchors; these on every anchor of the evaluation references.
TAU_UNARY = "acceptance_length_unary"  # τ of the unary argmax's own walk: the drafter without its selector
SELECTOR_GAIN = "selector_gain"  # τ - unary τ, with selector_gain_se (paired over prompts)
DFLASH2_SPECFORGE = {  # our MLflow name -> SpecForge's training metric (K = selector_top_k)
    TAU: "dflash2/selector/walk_accepted_length (there: over sampled anchors)",
    TAU_UNARY: "dflash/hard_label/walk_accepted_length",
    SELECTOR_GAIN: "the difference of the two walk_accepted_length",
    "expected_acceptance_length_unary": "dflash/hard_label/*_accepted_length of the unary argmax (1 + Σ Π unary "
    "accuracy)",
    "expected_acceptance_length_topk": "dflash/hard_label/unary_topK_oracle_accepted_length",
    f"{BY_POSITION}unary_accuracy": "dflash/hard_label/unary_top1_accuracy, position_<j>",
    f"{BY_POSITION}accuracy": "dflash2/selector/self_conditioned_marginal_accuracy, position_<j> (the walk's)",
    f"{BY_POSITION}topk_recall": "dflash/hard_label/unary_topK_recall, position_<j>",
}


# DSpark drafters' extras (dflash/stages/metrics.py: dspark_summary; docs/dspark.md); absent for other drafters
MARKOV_GAIN = "markov_gain"  # τ - τ of the base argmax's walk (TAU_UNARY: the same block without the Markov head)
CONFIDENCE = "confidence_threshold/"  # + <t>/ + acceptance_length | acceptance_length_se | gain | gain_se | ...
BRIER = "confidence_brier"  # the confidence head's Brier score over every slot and anchor, with BRIER + "_se"
CALIBRATION_FILE = "calibration.json"  # per slot and per bin: predicted against realised acceptance
DSPARK_BLOCK = "dspark/"  # + drafted_per_step | verify_rate: the whole block's

# the convention check (every DFlash-family drafter): the drafter read in the other slot convention
CONVENTION = "convention_check/"  # + acceptance_length_other | gain | gain_se | z


def threshold_name(t: float, what: str) -> str:
    """The MLflow name of a confidence threshold's figure (`what`: a ThresholdRow field, τ as acceptance_length)."""
    what = {"tau": TAU, "tau_se": f"{TAU}_se"}.get(what, what)
    return f"{CONFIDENCE}{t:g}/{what}"


def dspark_metrics(res: EvalResult) -> dict[str, float | None]:
    """A DSpark result's extras (dspark_summary) and the convention check, under their names; empty where absent."""
    out: dict[str, float | None] = {}
    if (c := res.convention) is not None:
        out.update(
            {
                f"{CONVENTION}{TAU}_other": c.other_tau,
                f"{CONVENTION}gain": c.gain,
                f"{CONVENTION}gain_se": c.gain_se,
                f"{CONVENTION}z": c.z,
            }
        )
    if (d := res.dspark) is None:
        return out
    out.update(
        {
            TAU_UNARY: d.tau_unary,
            f"{TAU_UNARY}_se": d.tau_unary_se,
            MARKOV_GAIN: d.markov_gain,
            f"{MARKOV_GAIN}_se": d.markov_gain_se,
            "expected_acceptance_length_unary": d.expected_unary,
            f"{DSPARK_BLOCK}drafted_per_step": d.drafted_per_step,
            f"{DSPARK_BLOCK}verify_rate": d.verify_rate,
            BRIER: d.brier,
            f"{BRIER}_se": d.brier_se,
        }
    )
    for row in d.thresholds:
        for what in ("tau", "tau_se", "gain", "gain_se", "drafted_per_step", "verify_rate"):
            out[threshold_name(row.threshold, what)] = getattr(row, what)
    return out


def calibration_table(res: EvalResult) -> dict[str, Any] | None:
    """CALIBRATION_FILE's content: the reliability table (bins) and the per-slot calibration; None without the head."""
    d = res.dspark
    if d is None or not d.slots:
        return None
    return {
        "brier": d.brier,
        "brier_se": d.brier_se,
        "slots": [asdict(s) for s in d.slots],
        "bins": [asdict(b) for b in d.bins],
    }


@dataclass(frozen=True)
class Dataset:
    """The prompts as an MLflow dataset input: runs on the same prompts filter together by `digest`."""

    name: str
    digest: str
    source: dict[str, Any]
    profile: dict[str, Any]


@dataclass(frozen=True)
class EvalRecord:
    """What the report made of a result for its run: the description, files (plots, samples), the composed config."""

    note: str
    files: dict[str, bytes]
    config_text: str


@dataclass(frozen=True)
class RunTags:
    """The tags a reader of evaluation runs checks (dflash.cli.compare: same target, same dtype), read back by name."""

    target_identity: str | None = None
    dtype: str | None = None

    @classmethod
    def of(cls, tags: dict[str, str]) -> "RunTags":
        return cls(tags.get(TARGET_TAG), tags.get(DTYPE_TAG))


def prompt_dataset(res: EvalResult, prompts_cfg: Any) -> Dataset:
    """The selected prompts as a dataset input: a name, a digest of their content, where they came from."""
    pc = prompts_cfg
    rows = [[r.prompt.id, r.prompt.subset, [list(m) for m in r.prompt.messages]] for r in res.prompts]
    digest = hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode()).hexdigest()[:12]
    name = f"prompts:{pc.source}" + (f":{pc.path.rsplit('/', 1)[-1]}" if pc.path else "")
    profile = {
        "prompts": len(rows),
        "subsets": dict(Counter(r[1] for r in rows)),
        "prompt_tokens": sum(len(r.prompt_ids) for r in res.prompts),
    }
    source = {
        "source": pc.source,
        "path": pc.path,
        "num_prompts": pc.num_prompts,
        "subsets": pc.subsets,
        "ids": [r[0] for r in rows],
    }
    return Dataset(name, digest, source, profile)


def resolved_params(res: EvalResult) -> dict[str, Any]:
    """What the config left to the checkpoint, the target or `auto`, as evaluated (params logged once resolved)."""
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
    }  # the drafter as built (dflash.models.drafter.config)


def prompt_lookup_metrics(p: PromptLookup | None) -> dict[str, float | None]:
    """The yardstick as metrics (empty when it was not computed; undefined values are not logged)."""
    if p is None:
        return {}
    return {
        PROMPT_LOOKUP_TAU: p.tau,
        PROMPT_LOOKUP_TAU_SE: p.tau_se,
        PROMPT_LOOKUP_GAIN: p.gain,
        PROMPT_LOOKUP_GAIN_SE: p.gain_se,
    }


def log_eval(run: Any, res: EvalResult, rec: EvalRecord, dataset: Dataset) -> None:
    """One evaluation's record on its run (a dflash.tracking.run.Run, not imported here: run.py reads this module's
    names): name, tags, resolved params, metrics and curves, the prompts as a dataset, the description, the config,
    per-prompt and per-position tables, the report's files."""
    info = res.info
    run.set_run_name(info.run_name)  # the step is known now
    run.set_tags(
        {
            CHECKPOINT_PATH_TAG: info.checkpoint_path,
            CHECKPOINT_SHA_TAG: info.checkpoint_sha256,
            DRAFTER_STEP_TAG: info.drafter_step,
            DEVICE_TAG: info.device,
            DTYPE_TAG: info.dtype,
            TARGET_TAG: info.target_identity,
            WARNINGS_TAG: " | ".join(res.warnings) or None,
            LINEAR_KERNEL_TAG: info.linear_attention_kernel,
            REFERENCE_ENGINE_TAG: info.references.engine,
            **{f"{ORIGIN_TAG}{k}": v for k, v in info.checkpoint_origin.items()},
        }
    )
    run.log_params(resolved_params(res))  # only keys not logged at the start (they were null or auto)
    curves = {f"{BY_POSITION}{kind}": v for kind, v in res.curves.items()}  # step = draft slot k
    run.log_metrics(
        {
            **res.metrics,
            **prompt_lookup_metrics(res.prompt_lookup),
            **dspark_metrics(res),
            **{f"{TIME}{k}": v for k, v in res.timings.items()},
        },
        curves=curves,
    )
    run.log_metrics({}, curves={BY_COMMIT: res.commit_share()})  # step = tokens committed by a verify step
    if share := res.served_commit_share():
        run.log_metrics({}, curves={SERVED_BY_COMMIT: share})  # the server's own histogram, same steps
    run.log_dataset(dataset.name, dataset.digest, dataset.source, dataset.profile)
    run.set_note(rec.note)
    run.log_text(rec.config_text, CONFIG_FILE)
    run.log_per_prompt([per_prompt_row(r).to_dict() for r in res.prompts])
    run.log_table(res.position_table(), PER_POSITION)
    if (cal := calibration_table(res)) is not None:
        run.log_text(json.dumps(cal, indent=1), CALIBRATION_FILE)
    run.log_files(rec.files)
    run.setup_eval_experiment(sorted({r.prompt.subset for r in res.prompts}))


# --- a training run's parent: one point per evaluated step ---------------------------------------

TRAIN = "train/"  # + the trainer's own metric name: logged on the parent at the trainer's steps (train_name)
TRAINING_CHART = "training_run/tau_by_step.png"  # a training run's parent: τ and the trainer's metrics by step
TRAINER_BEST_TAG = "dflash.trainer_best_step"  # a training run's parent: the step the trainer recorded as its best


def train_name(name: str) -> str:
    """The parent's name of a trainer's metric: under TRAIN, a name already under it kept as it is (SpecForge's
    `train/acc` stays `train/acc`, its `eval/avg_acc` becomes `train/eval/avg_acc`)."""
    return name if name.startswith(TRAIN) else f"{TRAIN}{name}"


ACCURACY_SLOT = "accuracy/slot_"  # + k: teacher-forced accuracy at draft slot k (k = 1..SLOTS)
SLOT_CURVES = {
    "accuracy": ACCURACY_SLOT,
    "unary_accuracy": "unary_accuracy/slot_",
    "topk_recall": "topk_recall/slot_",
}  # DFlash2: the last two
SLOTS = 3
SERIES_WORDS = (
    TAU,
    "recall",
    "unary",
    SELECTOR_GAIN,
    MARKOV_GAIN,
    CONVENTION,
    BRIER,
)  # a child's scalar whose name holds one of these is a curve of its parent


def series_point(metrics: dict[str, float | None], curves: dict[str, list[float | None]]) -> dict[str, float | None]:
    """A step's point on its training run's curves (MLflow step = training step): every τ-like scalar the child
    logged (micro, macro, SE, per subset, expected τ; other drafters' extras such as a unary τ, the selector's or the
    Markov head's gain, DSpark's τ at each confidence threshold and its Brier score, where present; the convention
    check's τ in the other slot convention) and the teacher-forced per-slot rates of SLOT_CURVES (accuracy; DFlash2's
    unary accuracy and top-k recall) at slots 1..SLOTS."""
    out = {
        k: v
        for k, v in metrics.items()
        if any(w in k for w in SERIES_WORDS) and (not k.startswith(CONFIDENCE) or k.endswith(f"/{TAU}"))
    }
    for kind, name in SLOT_CURVES.items():
        rate = curves.get(kind) or []
        out.update({f"{name}{k}": rate[k - 1] for k in range(1, SLOTS + 1) if k <= len(rate)})
    return out
