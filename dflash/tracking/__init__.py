"""MLflow tracking: the only package that knows MLflow.

Layout (what evaluate.py logs through `Run`; README "What it reports" and "MLflow UI"):
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
- Sweeps: every job of one `-m` sweep is a child of one parent run per experiment, found by the
  sweep's unique id (tag `dflash.sweep_id`, see dflash/entry.py), never by its folder. At the end
  `sweep_parents` reads the children back and `finish_parent` gives the parent what dflash/entry.py made
  of them (`sweep/children.csv`, `sweep/tau.png`, `sweep/per_position.png`, from dflash.report.sweep), the best child's τ as its metrics, the failed
  jobs, a description, and ends it FINISHED, FAILED or KILLED. Creating the store, an experiment, a
  parent happens under a file lock, so jobs launched in parallel never race.
- Runs always end: `Run` is a context manager; an exception ends it FAILED with the error as a tag,
  Ctrl-C and SIGTERM (dflash.util.errors.Terminated) end it KILLED, and its sweep parent too. A run left
  RUNNING by a hard kill is found at the next start (`reap`: RUNNING runs of this host whose process
  is gone, the pid's start time telling a reused pid apart) and ended KILLED with a tag saying why;
  `python -m dflash.tracking reap [--uri URI] [--run RUN_ID ...]` does it on demand.
- `find_runs` / `load_per_prompt` read finished evaluation runs back for `python -m dflash.compare`
  (`Run.log_per_prompt` logs the rows as `PER_PROMPT`, per_prompt.json; `Run.set_run_name` renames a run);
  `log_files` logs in-memory files (plots, tables) to an existing run.

Runs are driven through `MlflowClient` with explicit ids: no global "active run" state, so
several runs in one process (Hydra's basic launcher) cannot step on each other.
"""

from dflash.tracking.run import NoRun, Run, flatten, log_files
from dflash.tracking.store import (
                                   HOST_TAG,
                                   PER_PROMPT,
                                   PID_START_TAG,
                                   PID_TAG,
                                   ROLE_TAG,
                                   SWEEP_TAG,
                                   ensure_experiment,
                                   find_runs,
                                   load_per_prompt,
                                   main,
                                   mlflow_client,
                                   open_store,
                                   reap,
                                   run_tags,
                                   start_ticks,
                                   store_lock,
)
from dflash.tracking.sweep import ChildRun, ParentRun, finish_parent, open_sweep, sweep_parents
from dflash.tracking.view import eval_view, setup_eval_experiment, view_url
from dflash.tracking.yardstick import PROMPT_LOOKUP_TAU, prompt_lookup_metrics

__all__ = [
    "HOST_TAG",
    "PER_PROMPT",
    "PID_START_TAG",
    "PID_TAG",
    "PROMPT_LOOKUP_TAU",
    "ROLE_TAG",
    "SWEEP_TAG",
    "NoRun",
    "Run",
    "mlflow_client",
    "ChildRun",
    "ParentRun",
    "finish_parent",
    "sweep_parents",
    "ensure_experiment",
    "eval_view",
    "find_runs",
    "flatten",
    "load_per_prompt",
    "log_files",
    "main",
    "open_store",
    "open_sweep",
    "prompt_lookup_metrics",
    "reap",
    "run_tags",
    "setup_eval_experiment",
    "start_ticks",
    "store_lock",
    "view_url",
]
