"""MLflow tracking: the only module that knows MLflow.

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
  sweep's unique id (tag `dflash.sweep_id`, see dflash/config.py), never by its folder. `close_sweep`
  gives the parent the comparison of its children (`sweep/children.csv`, `sweep/tau.png`,
  `sweep/per_position.png`, from dflash.compare), the best child's τ as its metrics, the failed
  jobs, a description, and ends it FINISHED, FAILED or KILLED. Creating the store, an experiment, a
  parent happens under a file lock, so jobs launched in parallel never race.
- Runs always end: `Run` is a context manager; an exception ends it FAILED with the error as a tag,
  Ctrl-C and SIGTERM (dflash.errors.Terminated) end it KILLED, and its sweep parent too. A run left
  RUNNING by a hard kill is found at the next start (`reap`: RUNNING runs of this host whose process
  is gone, the pid's start time telling a reused pid apart) and ended KILLED with a tag saying why;
  `python -m dflash.tracking reap [--uri URI] [--run RUN_ID ...]` does it on demand.
- `find_runs` / `load_per_prompt` read finished evaluation runs back for `python -m dflash.compare`;
  `log_files` logs in-memory files (plots, tables) to an existing run.

Runs are driven through `MlflowClient` with explicit ids: no global "active run" state, so
several runs in one process (Hydra's basic launcher) cannot step on each other.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from dflash.errors import Terminated, TrackingError, signals_deferred

SWEEP_TAG = "dflash.sweep_id"
ROLE_TAG = "dflash.role"  # "sweep" on a sweep's parent
PARENT_TAG = "mlflow.parentRunId"
NOTE_TAG = "mlflow.note.content"
HOST_TAG, PID_TAG, PID_START_TAG = "dflash.host", "dflash.pid", "dflash.pid_start"
VIEW_KEY = "dflash"  # the evaluation experiment's saved view: mlflow.sharedViewState.dflash
MAX_TAG = 7900  # MLflow keeps 8000 characters of a run tag


def _client(uri: str):
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


@contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """An exclusive file lock beside the SQLite store (or in the cache for other stores)."""
    if uri.startswith("sqlite:///"):
        lock = Path(uri[len("sqlite:///") :] + ".lock")
    else:
        lock = Path.home() / ".cache" / "dflash-eval" / "mlflow.lock"
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        f = open(lock, "w")
    except OSError as e:
        raise TrackingError(f"cannot write beside the MLflow store {uri} ({e.strerror}: {e.filename}); pass a writable "
                            "tracking.uri=sqlite:///<folder>/mlflow.db, or tracking.enabled=false") from None
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def open_store(uri: str):
    """A client on a created / migrated store (call under store_lock): TrackingError if it cannot be used."""
    client = _client(uri)
    try:
        client.search_experiments(max_results=1)
    except Exception as e:
        raise TrackingError(f"cannot open the MLflow store {uri}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; pass a "
                            "writable tracking.uri=sqlite:///<folder>/mlflow.db, or tracking.enabled=false") from None
    return client


def _check_artifacts_writable(location: str) -> None:
    if not location.startswith("file:"):
        return  # a remote artifact store answers for itself
    from urllib.parse import unquote, urlparse

    path = Path(unquote(urlparse(location).path))
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as e:
        raise TrackingError(f"cannot write MLflow artifacts to {path} ({e.strerror}); pass a writable tracking.artifact_location=..., "
                            "run from a writable folder, or tracking.enabled=false") from None


def ensure_experiment(client, name: str, artifact_location: str | None) -> str:
    """The experiment's id, created (as a model-training experiment) when missing; its artifacts checked writable."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        loc = artifact_location or (Path("mlruns").resolve() / name.replace("/", "_")).as_uri()
        _check_artifacts_writable(loc)
        return client.create_experiment(name, artifact_location=loc, tags={"mlflow.experimentKind": "custom_model_development"})
    _check_artifacts_writable(exp.artifact_location)
    if "mlflow.experimentKind" not in exp.tags:  # created by an older dflash-eval
        client.set_experiment_tag(exp.experiment_id, "mlflow.experimentKind", "custom_model_development")
    return exp.experiment_id


# --- process identity and stale runs -------------------------------------------------------------


def _start_ticks(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after the (command), which may hold spaces


def process_tags() -> dict[str, str]:
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid()), PID_START_TAG: _start_ticks(os.getpid()) or ""}


def process_alive(pid: int, start: str | None) -> bool:
    """Whether the process that started the run still runs (same pid and, where known, same start time)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    now = _start_ticks(pid)
    return not (start and now and now != start)


def reap(client, run_ids: Sequence[str] = ()) -> list[tuple[str, str, str]]:
    """End KILLED the RUNNING runs of this host whose process is gone (and `run_ids`, whatever their
    host): -> [(run id, name, why)]. Runs of other hosts are left alone: their processes cannot be seen."""
    host = socket.gethostname()
    exps = [e.experiment_id for e in client.search_experiments()]
    found = []
    if exps:
        found = client.search_runs(exps, f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = '{host}'", max_results=5000)
    for r in run_ids:
        try:
            found.append(client.get_run(r))
        except Exception:
            raise TrackingError(f"no run {r!r} in this store") from None
    out = []
    for r in found:
        t = r.data.tags
        forced = r.info.run_id in run_ids
        if r.info.status != "RUNNING" or (not forced and PID_TAG in t and process_alive(int(t[PID_TAG]), t.get(PID_START_TAG))):
            continue
        why = (f"ended by `python -m dflash.tracking reap --run` on {host} at {time.strftime('%Y-%m-%d %H:%M:%S')}" if forced else
               f"process {t.get(PID_TAG)} on {host} is gone (killed hard?); found at {time.strftime('%Y-%m-%d %H:%M:%S')} by a later start")
        client.set_tag(r.info.run_id, "dflash.killed", why)
        client.set_terminated(r.info.run_id, "KILLED")
        out.append((r.info.run_id, r.info.run_name, why))
    return out


# --- what every run carries ----------------------------------------------------------------------


def source_tags() -> dict[str, str]:
    """MLflow's own source tags (mlflow.source.name / type / git.commit / git.branch, mlflow.user) and
    mlflow.source.git.dirty for the code that runs."""
    from mlflow.tracking.context.registry import resolve_tags

    tags = {k: v for k, v in resolve_tags().items() if k.startswith("mlflow.source.") or k == "mlflow.user"}
    try:
        here = Path(__file__).parent
        tags.setdefault("mlflow.source.git.commit", subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=here).stdout.strip())
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=True, cwd=here).stdout.strip()
        tags["mlflow.source.git.dirty"] = "true" if dirty else "false"
    except (OSError, subprocess.CalledProcessError):
        pass  # not a git checkout
    return tags


def library_versions() -> dict[str, str]:
    import torch
    import transformers

    import mlflow

    return {"version.python": platform.python_version(), "version.torch": torch.__version__, "version.transformers": transformers.__version__, "version.mlflow": mlflow.__version__}


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict -> {dotted key: leaf}."""
    if not isinstance(d, dict):
        return {prefix[:-1]: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}."))
    return out


def _param(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (list, tuple, dict)) else str(v)


def _finite(v: Any) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(float(v))


class Run:
    """One run. Use as `with Run(...) as run:`; log through its methods. `sweep` (a config.SweepInfo)
    makes it a child of that sweep's parent in its experiment."""

    def __init__(self, uri: str, experiment: str, run_name: str, artifact_location: str | None = None, sweep: Any = None,
                 tags: dict[str, Any] | None = None, resume_id: str | None = None):
        self.uri, self.parent_id, self._params = uri, None, set()
        with store_lock(uri):  # first use creates the SQLite schema; the experiment and the parent once
            self.client = open_store(uri)
            reap(self.client)
            self.experiment_id = ensure_experiment(self.client, experiment, artifact_location)
            if sweep is not None:
                self.parent_id = sweep_parent(self.client, self.experiment_id, sweep)
        all_tags = {**{k: str(v)[:MAX_TAG] for k, v in (tags or {}).items() if v is not None}, **source_tags(), **library_versions(), **process_tags()}
        if self.parent_id:
            all_tags.update({PARENT_TAG: self.parent_id, SWEEP_TAG: sweep.id})
        if resume_id:  # a resumed training run keeps logging to its run, now from this process
            self.run_id = resume_id
            self.client.update_run(resume_id, status="RUNNING")
            self.set_tags(process_tags())
            return
        self.run_id = self.client.create_run(self.experiment_id, run_name=run_name, tags=all_tags).info.run_id

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        with signals_deferred():  # a second Ctrl-C waits until the run is ended
            if exc_type is None:
                self.client.set_terminated(self.run_id, "FINISHED")
                return False
            killed = issubclass(exc_type, (KeyboardInterrupt, Terminated))
            why = ("SIGTERM" if issubclass(exc_type, Terminated) else "SIGINT (Ctrl-C)") if killed else f"{exc_type.__name__}: {exc}"
            try:
                self.client.set_tag(self.run_id, "dflash.killed" if killed else "error", why[:MAX_TAG])
                if killed and self.parent_id:  # the sweep stops with it
                    self.client.set_tag(self.parent_id, "dflash.killed", f"{why} during {self.run_id}")
                    self.client.set_terminated(self.parent_id, "KILLED")
            finally:
                self.client.set_terminated(self.run_id, "KILLED" if killed else "FAILED")
        return False

    def end(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status)

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)[:MAX_TAG]) for k, v in tags.items() if v is not None]
        if items:
            self.client.log_batch(self.run_id, tags=items)

    def set_note(self, markdown: str) -> None:
        """The run's description (Overview page, markdown)."""
        self.set_tags({NOTE_TAG: markdown if len(markdown) <= MAX_TAG else markdown[: MAX_TAG - 1] + "…"})

    def log_params(self, params: dict[str, Any]) -> None:
        """Flattened params; a key already logged by this Run is skipped (MLflow params never change),
        and so are None values (logged later, once resolved)."""
        from mlflow.entities import Param

        flat = {k: v for k, v in flatten(params).items() if v is not None and k not in self._params}
        self._params |= flat.keys()
        items = [Param(k, _param(v)[:6000]) for k, v in flat.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float | None], step: int = 0, curves: dict[str, Sequence[float | None]] | None = None,
                    first_step: int = 1, digits: int | None = None) -> None:
        """Scalars at `step`, and each curve as one metric with step = first_step, first_step + 1, ...;
        undefined values (None, NaN, inf) are not logged; `digits`: rounded to that many decimals (what the UI shows)."""
        from mlflow.entities import Metric

        def v_(v: float) -> float:
            return round(float(v), digits) if digits is not None else float(v)

        ts = int(time.time() * 1000)
        items = [Metric(k, v_(v), ts, step) for k, v in metrics.items() if _finite(v)]
        for name, values in (curves or {}).items():
            items += [Metric(name, v_(v), ts, k) for k, v in enumerate(values, start=first_step) if _finite(v)]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        cols = {k: [r.get(k) for r in rows] for k in (rows[0] if rows else {})}
        self.client.log_table(self.run_id, data=cols, artifact_file=artifact_file)

    def log_files(self, files: dict[str, bytes]) -> None:
        _log_files(self.client, self.run_id, files)

    def log_dataset(self, name: str, digest: str, source: dict[str, Any], profile: dict[str, Any], context: str = "eval") -> None:
        """An input dataset (the runs table's Dataset column; `dataset.digest = '...'` filters runs on the same data)."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        ds = Dataset(name=name, digest=digest, source_type="local", source=json.dumps(source), profile=json.dumps(profile))
        self.client.log_inputs(self.run_id, datasets=[DatasetInput(ds, tags=[InputTag("mlflow.data.context", context)])])

    def setup_eval_experiment(self, subsets: Sequence[str]) -> None:
        setup_eval_experiment(self.uri, self.experiment_id, subsets)

    def where(self) -> str:
        return (f"run {self.run_id} in experiment {self.experiment_id} at {self.uri}\n"
                f"  see it: mlflow ui --backend-store-uri {self.uri}   then {view_url(self.experiment_id)}")


def view_url(experiment_id: str, base: str = "http://127.0.0.1:5000") -> str:
    """The experiment's runs table through its saved view (τ columns; add &compareRunsMode=CHART for the charts)."""
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"


def _log_files(client, run_id: str, files: dict[str, bytes]) -> None:
    with tempfile.TemporaryDirectory() as d:
        for rel, data in files.items():
            (Path(d) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(d) / rel).write_bytes(data)
        client.log_artifacts(run_id, d)


def log_files(uri: str, run_id: str, files: dict[str, bytes]) -> None:
    """Log in-memory files (artifact path -> bytes, e.g. `plots/tau.png`) to an existing run."""
    client = _client(uri)
    try:
        client.get_run(run_id)
    except Exception as e:
        raise TrackingError(f"no run {run_id!r} in {uri} to log to; pass the id of a run there (mlflow ui --backend-store-uri {uri})") from e
    _log_files(client, run_id, files)


# --- the evaluation experiment: description and saved view ---------------------------------------

EXPERIMENT_NOTE = """Evaluations of DFlash drafters on this target (dflash-eval, `python evaluate.py`).

- **τ** = `acceptance_length`: committed tokens per verify step, bonus included (plain decoding = 1), \
with `acceptance_length_se` (SE over prompts) and `acceptance_length/<subset>`.
- Curves over the draft slots (x = slot k, 1 = first drafted token): `by_position/accept_rate` (cumulative), \
`by_position/accept_rate_cond` (conditional), `by_position/accuracy` (teacher-forced); `by_commit/share`: \
share of verify steps committing x tokens. The table view shows a curve's last point: read curves in the chart view.
- Each run: description (overview), `samples.html`, `plots/`, `per_position.json`, `per_prompt.json`. A `-m` sweep: \
one parent per sweep with `sweep/children.csv` and `sweep/*.png`.
- Open the saved view **dflash: τ and curves** (Saved views, or `...&viewStateShareKey=dflash` in the URL) for τ \
in the table and these charts first. Pair two runs by prompt: `python -m dflash.compare A B`.
"""

HEADLINE = [("acceptance_length", "BAR"), ("by_position/accept_rate", "LINE"), ("by_position/accept_rate_cond", "LINE"),
            ("by_position/accuracy", "LINE"), ("by_commit/share", "LINE")]
COLLAPSED = ["by_position", "expected_acceptance_length", "leak_probe", "time", "Model metrics", "System metrics"]


def eval_view(subsets: Sequence[str]) -> dict[str, Any]:
    """The saved view's state (MLflow 3 ExperimentPageUIState): τ columns in the runs table; charts: the
    headline section (τ, the per-position curves, commits per step), τ per subset, the rest collapsed."""
    def chart(i: int, key: str, kind: str, section: str) -> dict[str, Any]:
        c: dict[str, Any] = {"uuid": f"dflash-{i}", "type": kind, "runsCountToCompare": 10, "metricSectionId": section, "deleted": False,
                             "isGenerated": False, "metricKey": key}
        if kind == "LINE":
            c.update(selectedMetricKeys=[key], xAxisKey="step", useGlobalXaxisKey=False, lineSmoothness=0, useGlobalLineSmoothing=False,
                     scaleType="linear", xAxisScaleType="linear", displayPoints=True, selectedXAxisMetricKey="",
                     range={"yMin": 0, "yMax": 1} if "/accept" in key or "/accuracy" in key else {})
        return c

    sections = [("dflash-headline", "τ, acceptance by draft slot, commits per step", True), ("dflash-subsets", "acceptance_length", True)]
    sections += [(f"dflash-s{i}", name, False) for i, name in enumerate(COLLAPSED)]
    charts = [chart(i, k, t, "dflash-headline") for i, (k, t) in enumerate(HEADLINE)]
    charts += [chart(len(charts) + i, f"acceptance_length/{s}", "BAR", "dflash-subsets") for i, s in enumerate(subsets)]
    metric_cols = ["acceptance_length", "acceptance_length_se", *[f"acceptance_length/{s}" for s in subsets], "expected_acceptance_length"]
    return {
        "selectedColumns": ["attributes.`Dataset`", *[f"metrics.`{m}`" for m in metric_cols]],
        "compareRunCharts": charts,
        "compareRunSections": [{"uuid": u, "name": n, "display": d, "isReordered": False, "deleted": False, "isGenerated": False} for u, n, d in sections],
        "isAccordionReordered": True, "hideEmptyCharts": True, "runsExpanded": {}, "runsPinned": [], "runsHidden": [], "groupBy": None,
        "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0, "selectedXAxisMetricKey": ""},
    }


def setup_eval_experiment(uri: str, experiment_id: str, subsets: Sequence[str]) -> None:
    """Description and saved view on an evaluation experiment; the view gains the τ of each new prompt subset."""
    key = f"mlflow.sharedViewState.{VIEW_KEY}"
    client = _client(uri)
    with store_lock(uri):
        tags = client.get_experiment(experiment_id).tags
        try:
            known = [c["metricKey"].split("/", 1)[1] for c in json.loads(json.loads(tags[key])["state"])["compareRunCharts"]
                     if c["metricKey"].startswith("acceptance_length/")]
        except (KeyError, ValueError, TypeError):
            known = []
        if NOTE_TAG not in tags:
            client.set_experiment_tag(experiment_id, NOTE_TAG, EXPERIMENT_NOTE)
        if key in tags and set(subsets) <= set(known):
            return
        state = json.dumps(eval_view(sorted(set(known) | set(subsets))))
        envelope = {"name": "dflash: τ and curves", "createdAt": int(time.time() * 1000), "state": state}
        client.set_experiment_tag(experiment_id, key, json.dumps(envelope))


# --- sweeps --------------------------------------------------------------------------------------


def sweep_parent(client, experiment_id: str, sweep: Any) -> str:
    """The run id of the sweep's parent in this experiment, created if missing (call under store_lock)."""
    found = client.search_runs([experiment_id], f"tags.`{SWEEP_TAG}` = '{sweep.id}' and tags.`{ROLE_TAG}` = 'sweep'", max_results=1)
    if found:
        return found[0].info.run_id
    tags = {SWEEP_TAG: sweep.id, ROLE_TAG: "sweep", "dflash.sweep_dir": sweep.dir, **source_tags(), **process_tags(),
            NOTE_TAG: f"A `-m` sweep (`{sweep.name}`), running: its children are the jobs. When it ends this run holds their comparison."}
    return client.create_run(experiment_id, run_name=sweep.name, tags=tags).info.run_id


def open_sweep(uri: str, experiment: str, sweep: Any, artifact_location: str | None = None) -> str:
    """Create the sweep's parent at its start (in the experiment of the sweep's base config)."""
    with store_lock(uri):
        client = open_store(uri)
        reap(client)
        return sweep_parent(client, ensure_experiment(client, experiment, artifact_location), sweep)


def close_sweep(uri: str, sweep_id: str, failed: Sequence[dict[str, Any]] = (), status: str | None = None, reason: str = "") -> list[str]:
    """End every parent of the sweep: the comparison of its children (table, plots, best τ, description),
    the failed jobs, and the status (None: FINISHED when every job passed, else FAILED). -> parent ids."""
    from dflash import compare, report

    client = _client(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    parents = client.search_runs(exps, f"tags.`{SWEEP_TAG}` = '{sweep_id}' and tags.`{ROLE_TAG}` = 'sweep'") if exps else []
    for parent in parents:
        pid = parent.info.run_id
        kids = client.search_runs([parent.info.experiment_id], f"tags.`{PARENT_TAG}` = '{pid}'", max_results=5000)
        kids.sort(key=lambda k: int(k.data.tags.get("dflash.job", "0")))
        values = compare.swept_values([json.loads(k.data.tags.get("overrides", "[]")) for k in kids])
        children = [compare.Child(k.info.run_name, k.info.run_id, v, _rows_or_none(uri, k)) for k, v in zip(kids, values)]
        table = compare.sweep_table(children) if children else []
        bad_jobs = sorted({int(r["job"]) for r in failed} | {int(k.data.tags.get("dflash.job", -1)) for k in kids if k.info.status != "FINISHED"})
        final = status or ("FAILED" if bad_jobs else "FINISHED")
        run = Run.__new__(Run)  # log through Run's methods on the existing parent
        run.client, run.run_id, run._params = client, pid, set()
        if children:
            run.log_files(compare.sweep_artifacts(children, title=parent.info.run_name))
        best = compare.best(table)
        if best is not None:
            m = client.get_run(best["run_id"]).data.metrics
            run.log_metrics({k: v for k, v in m.items() if k.startswith(("acceptance_length", "expected_acceptance_length"))}, digits=4)
            run.set_tags({"dflash.best_child": f"{best['run']} ({best['run_id']})"})
        fails = [f"job {r['job']} ({r.get('label') or ' '.join(r['overrides'])}): {r['error']}" for r in failed]
        tags = {"dflash.jobs": f"{len(kids)} children, {len(bad_jobs)} failed", "dflash.failed_jobs": "; ".join(fails) or None}
        if final != "FINISHED" and reason:
            tags["dflash.killed" if final == "KILLED" else "error"] = reason
        run.set_tags(tags)
        run.set_note(report.sweep_markdown(parent.info.run_name, table, fails, final, reason))
        client.set_terminated(pid, final)
    return [p.info.run_id for p in parents]


def _rows_or_none(uri: str, run) -> list[dict[str, Any]] | None:
    if run.info.status != "FINISHED":
        return None
    try:
        return load_per_prompt(uri, run.info.run_id)
    except TrackingError:
        return None


# --- reading runs back ---------------------------------------------------------------------------


def find_runs(uri: str, run: str, limit: int = 20) -> list[tuple[str, str]]:
    """A run id -> [(id, name)]; a run name -> its FINISHED runs, newest first."""
    client = _client(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    if not exps:
        return []
    found = client.search_runs(exps, filter_string=f"attributes.run_id = '{run}'") if len(run) == 32 and run.isalnum() else []
    if not found:
        found = client.search_runs(exps, filter_string=f"attributes.run_name = '{run}' and attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"], max_results=limit)
    return [(r.info.run_id, r.info.run_name) for r in found]


def load_per_prompt(uri: str, run_id: str) -> list[dict[str, Any]]:
    """The per-prompt rows an evaluation run logged as per_prompt.json."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no download bar on the console
    with tempfile.TemporaryDirectory() as d:
        try:
            path = _client(uri).download_artifacts(run_id, "per_prompt.json", d)
        except Exception as e:
            raise TrackingError(f"run {run_id} has no per_prompt.json: is it an evaluation run that finished? ({e})") from e
        table = json.loads(Path(path).read_text())
    return [dict(zip(table["columns"], row)) for row in table["data"]]


class NoRun:
    """Stand-in when tracking.enabled=false: same methods, records nothing."""

    run_id = parent_id = experiment_id = None

    def __enter__(self) -> "NoRun":
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def __getattr__(self, name: str):
        return lambda *a, **k: None

    def where(self) -> str:
        return "tracking disabled (tracking.enabled=false)"


def main(argv: list[str] | None = None) -> int:
    """`python -m dflash.tracking reap [--uri URI] [--run RUN_ID ...]`: end runs left RUNNING by a hard kill."""
    ap = argparse.ArgumentParser(prog="python -m dflash.tracking", description=main.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reap", help="end KILLED this host's RUNNING runs whose process is gone (and --run ones, whatever their host)")
    r.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"))
    r.add_argument("--run", action="append", default=[], metavar="RUN_ID", help="also end this run KILLED (e.g. one left by another machine)")
    args = ap.parse_args(argv)
    try:
        with store_lock(args.uri):
            done = reap(open_store(args.uri), args.run)
    except TrackingError as e:
        print(f"dflash.tracking: error: {e}", file=sys.stderr)
        return 2
    for run_id, name, why in done:
        print(f"KILLED {name} ({run_id}): {why}")
    print(f"{len(done)} run(s) ended KILLED" if done else "no run left RUNNING by a process that is gone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
