"""MLflow tracking: the only package that knows MLflow.

Layout (what dflash-eval logs through `Run`; docs/metrics.md and docs/mlflow.md):
- One experiment per target, `dflash/<target>` (training: `dflash-train/<target>`), tagged
  `mlflow.experimentKind=custom_model_development` so MLflow 3 opens it as a model-training
  experiment (its runs table), not in its GenAI mode; an evaluation experiment also holds a
  description (`mlflow.note.content`) and a saved view (`mlflow.sharedViewState.dflash`, "dflash:
  τ and curves"): the runs table with τ ± SE and τ per subset as columns, and the chart view
  opening on τ, the three per-position curves and the commits-per-step curve, everything else in
  collapsed sections. `view_url` is the link that opens it.
- A run: name `<drafter>@step_<N>`; params = the config with every null / auto it resolved
  (step, taps, block size, device, dtype) as the value used; tags = MLflow's `mlflow.source.*`
  (file, git commit, branch, dirty), `mlflow.note.content` (a markdown description), Hydra group
  choices, overrides, process identity (`dflash.host`, `dflash.pid`, `dflash.pid_start`), library
  versions; the prompt set as a dataset input (name and digest: runs on the same prompts filter
  together); scalars that are undefined (None, NaN) are not logged; curves (`by_position/<kind>`,
  step = draft slot; `by_commit/share`, step = tokens committed) never share a name with a scalar.
- Every name of an evaluation run's record (tags, params, artifacts, curves) is defined once, in
  dflash/tracking/record.py (`log_eval` writes them; readers read back through the same constants).
- Training runs (dflash/evaluation/series.py): the steps of one training run evaluated on one target and prompt
  setting are children of one parent (tag `dflash.series_id`, a digest of that identity; role
  `training_run`), which holds one point per step on its curves (MLflow step = training step: τ micro,
  macro, per subset, expected τ, accuracy at slots 1-3, other τ-like scalars a child logs) and the
  trainer's own metrics under `train/` (`train_name`: a name already there kept) and a picture of both
  (`TRAINING_CHART`). A step whose checkpoint digest a finished child holds is skipped. A rewind (a step rewritten
  with other weights) marks the old timeline's children `dflash.superseded_by` (`supersede`) and continues the
  parent as a new lineage holding the points before it (`new_lineage`; `series_children` reads every lineage's).
- Sweeps: every job of one `-m` sweep is a child of one parent run per experiment, found by the
  sweep's unique id (tag `dflash.sweep_id`, see dflash/cli/app.py), never by its folder. Both families
  live in dflash/tracking/parents.py. At the end
  `sweep_parents` reads the children back and `finish_parent` gives the parent what dflash/cli/app.py made
  of them (`sweep/children.csv`, `sweep/tau.png`, `sweep/per_position.png`, from dflash.report.sweep), the best child's
  τ as its metrics, the failed
  jobs, a description, and ends it FINISHED, FAILED or KILLED. Creating the store, an experiment, a
  parent happens under a file lock, so jobs launched in parallel never race.
- Runs always end: `Run` is a context manager; an exception ends it FAILED with the error as a tag,
  Ctrl-C and SIGTERM (dflash.util.errors.Terminated) end it KILLED, and its sweep parent too. A run left
  RUNNING by a hard kill is found at the next start (`reap`: RUNNING runs of this host whose process
  is gone, the pid's start time telling a reused pid apart) and ended KILLED with a tag saying why;
  `python -m dflash.tracking reap [--uri URI] [--run RUN_ID ...]` does it on demand.
- `find_runs` / `load_per_prompt` read finished evaluation runs back for `dflash-compare`
  (`Run.log_per_prompt` logs the rows as `PER_PROMPT`, per_prompt.json; `Run.set_run_name` renames a run);
  `log_files` logs in-memory files (plots, tables) to an existing run.

Runs are driven through `MlflowClient` with explicit ids: no global "active run" state, so
several runs in one process (Hydra's basic launcher) cannot step on each other.
"""

from dflash.tracking.parents import (
    BEST_CHILD_TAG,
    FAILED_JOBS_TAG,
    JOBS_TAG,
    LINEAGE_TAG,
    REPLACED_BY_TAG,
    RUN_DIR_TAG,
    SUPERSEDED_TAG,
    ChildRun,
    ParentRun,
    SweepFamily,
    TrainingRunFamily,
    adopt,
    children,
    evaluated_steps,
    finish_parent,
    new_lineage,
    open_parent,
    series_children,
    supersede,
    sweep_parents,
)
from dflash.tracking.record import (
    ACCURACY_SLOT,
    CHECKPOINT_SHA_TAG,
    DFLASH2_SPECFORGE,
    DRAFTER_STEP_TAG,
    ERROR_TAG,
    GROUP_TAG,
    JOB_TAG,
    KILLED_TAG,
    ORIGIN_TAG,
    OVERRIDES_TAG,
    PER_PROMPT,
    PROMPT_LOOKUP_TAU,
    TAU,
    TRAIN,
    TRAINER_BEST_TAG,
    TRAINING_CHART,
    Dataset,
    EvalRecord,
    RunTags,
    dspark_metrics,
    log_eval,
    prompt_dataset,
    prompt_lookup_metrics,
    series_point,
    train_name,
    train_tags,
)
from dflash.tracking.run import NoRun, Run, flatten, log_files
from dflash.tracking.store import (
    HOST_TAG,
    PID_START_TAG,
    PID_TAG,
    ROLE_TAG,
    SERIES_TAG,
    SWEEP,
    SWEEP_TAG,
    TRAINING_RUN,
    ensure_experiment,
    find_runs,
    load_per_prompt,
    main,
    metric_history,
    mlflow_client,
    open_store,
    reap,
    run_tags,
    start_ticks,
    store_lock,
    trainer_runs,
)
from dflash.tracking.view import (
    TRAINING_VIEW_KEY,
    eval_view,
    setup_eval_experiment,
    setup_training_view,
    training_view_url,
    view_url,
)

__all__ = [
    "ACCURACY_SLOT",
    "BEST_CHILD_TAG",
    "CHECKPOINT_SHA_TAG",
    "DFLASH2_SPECFORGE",
    "DRAFTER_STEP_TAG",
    "ERROR_TAG",
    "FAILED_JOBS_TAG",
    "GROUP_TAG",
    "HOST_TAG",
    "JOBS_TAG",
    "JOB_TAG",
    "KILLED_TAG",
    "LINEAGE_TAG",
    "ORIGIN_TAG",
    "REPLACED_BY_TAG",
    "SUPERSEDED_TAG",
    "TRAINER_BEST_TAG",
    "TRAINING_CHART",
    "OVERRIDES_TAG",
    "PER_PROMPT",
    "PID_START_TAG",
    "PID_TAG",
    "PROMPT_LOOKUP_TAU",
    "ROLE_TAG",
    "RUN_DIR_TAG",
    "SERIES_TAG",
    "SWEEP",
    "SWEEP_TAG",
    "TAU",
    "TRAIN",
    "TRAINING_RUN",
    "TRAINING_VIEW_KEY",
    "setup_training_view",
    "training_view_url",
    "ChildRun",
    "Dataset",
    "EvalRecord",
    "NoRun",
    "ParentRun",
    "Run",
    "RunTags",
    "SweepFamily",
    "TrainingRunFamily",
    "adopt",
    "children",
    "new_lineage",
    "series_children",
    "supersede",
    "train_name",
    "ensure_experiment",
    "eval_view",
    "evaluated_steps",
    "find_runs",
    "finish_parent",
    "flatten",
    "load_per_prompt",
    "dspark_metrics",
    "log_eval",
    "log_files",
    "main",
    "metric_history",
    "mlflow_client",
    "open_parent",
    "open_store",
    "prompt_dataset",
    "prompt_lookup_metrics",
    "reap",
    "train_tags",
    "trainer_runs",
    "run_tags",
    "series_point",
    "setup_eval_experiment",
    "start_ticks",
    "store_lock",
    "sweep_parents",
    "view_url",
]
