"""MLflow tracking: the only module that knows MLflow.

- One experiment per target (`dflash/<target>`), artifacts under `./mlruns/`.
- Run name `<drafter>@step_<N>`; params = the flattened resolved config; tags = Hydra group
  choices, git commit, checkpoint path and sha256, library versions, device.
- Per-position series are logged twice: `accept_rate/pos_01`.. as scalars (compare runs), and
  `accept_rate` etc. with `step` = position, so the chart view draws them as curves.
- Sweeps: every job of one `-m` sweep is a child of one parent run, found by the sweep folder
  tag. Creating the store, the experiment and the parent happens under a file lock, so jobs
  launched in parallel never race. `close_sweep` ends the parent when the sweep ends.
- `find_runs` / `load_per_prompt` read finished evaluation runs back (by id or by run name) for
  `python -m dflash.compare`; `log_files` / `Run.log_files` log in-memory files (plots, tables,
  samples pages) as artifacts.
- `Run` is a context manager: an exception ends the run FAILED (KILLED on Ctrl-C) with the
  error logged, never leaving it RUNNING.

Runs are driven through `MlflowClient` with explicit ids: no global "active run" state, so
several runs in one process (Hydra's basic launcher) cannot step on each other.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import platform
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

SWEEP_TAG = "dflash.sweep_dir"
PARENT_TAG = "mlflow.parentRunId"


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
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_experiment(client, name: str, artifact_location: str | None) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    loc = artifact_location or (Path("mlruns").resolve() / name.replace("/", "_")).as_uri()
    return client.create_experiment(name, artifact_location=loc)


def _sweep_parent(client, exp_id: str, sweep_dir: str) -> str:
    found = client.search_runs([exp_id], filter_string=f"tags.`{SWEEP_TAG}` = '{sweep_dir}' and tags.`dflash.role` = 'sweep'", max_results=1)
    if found:
        return found[0].info.run_id
    run = client.create_run(exp_id, run_name=f"sweep {Path(sweep_dir).name}", tags={SWEEP_TAG: sweep_dir, "dflash.role": "sweep"})
    return run.info.run_id


def flatten(d: Any, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = json.dumps(d) if isinstance(d, (list, tuple)) else str(d)
    return out


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def library_versions() -> dict[str, str]:
    import torch
    import transformers

    import mlflow

    return {"version.python": platform.python_version(), "version.torch": torch.__version__, "version.transformers": transformers.__version__, "version.mlflow": mlflow.__version__}


class Run:
    """One evaluation run. Use as `with Run(...) as run:`; log through its methods."""

    def __init__(self, uri: str, experiment: str, run_name: str, artifact_location: str | None = None, sweep_dir: str | None = None, tags: dict[str, str] | None = None, resume_id: str | None = None):
        self.uri = uri
        with store_lock(uri):  # first use creates the SQLite schema; the experiment and parent once
            self.client = _client(uri)
            self.client.search_experiments(max_results=1)  # creates/migrates the store, under the lock
            self.experiment_id = ensure_experiment(self.client, experiment, artifact_location)
            parent = _sweep_parent(self.client, self.experiment_id, sweep_dir) if sweep_dir else None
        self.parent_id = parent
        if resume_id:  # a resumed training run keeps logging to its run
            self.client.update_run(resume_id, status="RUNNING")
            self.run_id = resume_id
            return
        all_tags = {**(tags or {}), "git_commit": git_commit(), **library_versions()}
        if parent:
            all_tags.update({PARENT_TAG: parent, SWEEP_TAG: sweep_dir or ""})
        self.run_id = self.client.create_run(self.experiment_id, run_name=run_name, tags=all_tags).info.run_id

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.client.set_terminated(self.run_id, "FINISHED")
        else:
            status = "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"
            try:
                self.client.set_tag(self.run_id, "error", f"{exc_type.__name__}: {exc}"[:5000])
            finally:
                self.client.set_terminated(self.run_id, status)
        return False

    def end(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status)

    def set_tags(self, tags: dict[str, Any]) -> None:
        for k, v in tags.items():
            if v is not None:
                self.client.set_tag(self.run_id, k, str(v)[:5000])

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], curves: dict[str, list[float]] | None = None, step: int = 0) -> None:
        """Scalars at `step` (non-finite values skipped); each curve as one metric with step = position (1-based)."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step) for k, v in metrics.items() if math.isfinite(float(v))]
        for name, values in (curves or {}).items():
            items += [Metric(name, float(v), ts, k) for k, v in enumerate(values, start=1)]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        cols = {k: [r.get(k) for r in rows] for k in (rows[0] if rows else {})}
        self.client.log_table(self.run_id, data=cols, artifact_file=artifact_file)

    def log_files(self, files: dict[str, bytes]) -> None:
        _log_files(self.client, self.run_id, files)

    def where(self) -> str:
        return f"run {self.run_id} in experiment {self.experiment_id} at {self.uri}  (see it: mlflow ui --backend-store-uri {self.uri})"


def _log_files(client, run_id: str, files: dict[str, bytes]) -> None:
    import tempfile

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


def close_sweep(uri: str, sweep_dir: str) -> None:
    """End a sweep's parent run: FINISHED if every child finished, else FAILED."""
    client = _client(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    if not exps:
        return
    for parent in client.search_runs(exps, filter_string=f"tags.`{SWEEP_TAG}` = '{sweep_dir}' and tags.`dflash.role` = 'sweep'"):
        kids = client.search_runs(exps, filter_string=f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'")
        ok = kids and all(k.info.status == "FINISHED" for k in kids)
        client.set_terminated(parent.info.run_id, "FINISHED" if ok else "FAILED")


from dflash.errors import TrackingError


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
    import tempfile

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

    run_id = parent_id = None

    def __enter__(self) -> "NoRun":
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def __getattr__(self, name: str):
        return lambda *a, **k: None

    def where(self) -> str:
        return "tracking disabled (tracking.enabled=false)"
