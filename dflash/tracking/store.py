"""The MLflow store: opening it under a lock, experiments, process identity and stale runs, source
tags, a sweep's parent, reading finished runs back; `main` is `python -m dflash.tracking`."""

from __future__ import annotations

import argparse
import fcntl
import functools
import json
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

from dflash.runs.trainlog import RunSpan
from dflash.tracking.record import KILLED_TAG, PER_PROMPT
from dflash.util.errors import TrackingError, signals_deferred
from dflash.util.files import open_append

SWEEP_TAG = "dflash.sweep_id"
SERIES_TAG = "dflash.series_id"  # a training run's parent and its children: a digest of what identifies the series
ROLE_TAG = "dflash.role"  # on a parent: SWEEP or TRAINING_RUN
SWEEP, TRAINING_RUN = "sweep", "training_run"
PARENT_TAG = "mlflow.parentRunId"
NOTE_TAG = "mlflow.note.content"
RUN_NAME_TAG = "mlflow.runName"
HOST_TAG, PID_TAG, PID_START_TAG = "dflash.host", "dflash.pid", "dflash.pid_start"
VIEW_KEY = "dflash"  # the evaluation experiment's saved view: mlflow.sharedViewState.dflash
MAX_TAG = 7900  # MLflow keeps 8000 characters of a run tag


class SignalSafeClient:
    """An MlflowClient whose every call runs with SIGINT and SIGTERM held back until it returns. A signal is raised
    as a BaseException, which MLflow's store sessions do not roll back (they catch Exception): one that lands inside a
    write can leave the SQLite store locked, and the run's own closing writes then fail ("database is locked")."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def deferred(*args: Any, **kwargs: Any) -> Any:
            with signals_deferred():
                return attr(*args, **kwargs)

        return deferred


def mlflow_client(uri: str) -> Any:
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    from mlflow.tracking import MlflowClient

    with signals_deferred():  # the constructor opens the store (creating or migrating its tables)
        return SignalSafeClient(MlflowClient(tracking_uri=uri))


@contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """An exclusive file lock beside the SQLite store (or in the cache for other stores)."""
    if uri.startswith("sqlite:///"):
        lock = Path(uri[len("sqlite:///") :] + ".lock")
    else:
        lock = Path.home() / ".cache" / "dflash-eval" / "mlflow.lock"
    try:
        f = open_append(lock)  # created like open() makes files (the umask), never truncated
    except OSError as e:
        raise TrackingError(
            f"cannot write beside the MLflow store {uri} ({e.strerror}: {e.filename}); pass a writable "
            "tracking.uri=sqlite:///<folder>/mlflow.db, or tracking.enabled=false"
        ) from None
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _create_sqlite_store(path: Path) -> None:
    """A new SQLite store is built under a temporary name and linked into place: a process killed while MLflow
    creates its tables (seconds) leaves no half-built store that every later run would fail to open. Linked, not
    renamed: a store another process created meanwhile (a client opened outside store_lock) is kept, never swapped
    under its open connection (SQLite then refuses that connection's writes: "attempt to write a readonly database")."""
    tmp = path.with_name(
        f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    )  # unique: MLflow caches a store per URI
    try:
        mlflow_client(f"sqlite:///{tmp}").search_experiments(max_results=1)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # created meanwhile: that one is used
        except OSError:  # a filesystem without hard links: renamed, unless one was created meanwhile
            if not path.exists():
                os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def open_store(uri: str):
    """A client on a created / migrated store (call under store_lock): TrackingError if it cannot be used."""
    try:
        if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).exists():
            _create_sqlite_store(Path(uri[len("sqlite:///") :]))
        client = mlflow_client(uri)
        client.search_experiments(max_results=1)
    except Exception as e:
        raise TrackingError(
            f"cannot open the MLflow store {uri}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; pass "
            f"a "
            "writable tracking.uri=sqlite:///<folder>/mlflow.db (a store half-built by an older version killed "
            "while creating it: move it aside), or tracking.enabled=false"
        ) from None
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
        raise TrackingError(
            f"cannot write MLflow artifacts to {path} ({e.strerror}); pass a writable tracking.artifact_location=..., "
            "run from a writable folder, or tracking.enabled=false"
        ) from None


def ensure_experiment(client, name: str, artifact_location: str | None) -> str:
    """The experiment's id, created (as a model-training experiment) when missing; its artifacts checked writable."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        loc = artifact_location or (Path("mlruns").resolve() / name.replace("/", "_")).as_uri()
        _check_artifacts_writable(loc)
        return client.create_experiment(
            name, artifact_location=loc, tags={"mlflow.experimentKind": "custom_model_development"}
        )
    _check_artifacts_writable(exp.artifact_location)
    if "mlflow.experimentKind" not in exp.tags:  # created by an older dflash-eval
        client.set_experiment_tag(exp.experiment_id, "mlflow.experimentKind", "custom_model_development")
    return exp.experiment_id


# --- process identity and stale runs -------------------------------------------------------------


def start_ticks(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after the (command), which may hold spaces


def process_tags() -> dict[str, str]:
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid()), PID_START_TAG: start_ticks(os.getpid()) or ""}


def process_alive(pid: int, start: str | None) -> bool:
    """Whether the process that started the run still runs (same pid and, where known, same start time)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    now = start_ticks(pid)
    return not (start and now and now != start)


def reap(client, run_ids: Sequence[str] = ()) -> list[tuple[str, str, str]]:
    """End KILLED the RUNNING runs of this host whose process is gone (and `run_ids`, whatever their
    host): -> [(run id, name, why)]. Runs of other hosts are left alone: their processes cannot be seen."""
    host = socket.gethostname()
    exps = [e.experiment_id for e in client.search_experiments()]
    found = []
    if exps:
        found = client.search_runs(
            exps, f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = '{host}'", max_results=5000
        )
    for r in run_ids:
        try:
            found.append(client.get_run(r))
        except Exception:
            raise TrackingError(f"no run {r!r} in this store") from None
    out = []
    for r in found:
        t = r.data.tags
        forced = r.info.run_id in run_ids
        if r.info.status != "RUNNING" or (
            not forced and PID_TAG in t and process_alive(int(t[PID_TAG]), t.get(PID_START_TAG))
        ):
            continue
        why = (
            f"ended by `python -m dflash.tracking reap --run` on {host} at {time.strftime('%Y-%m-%d %H:%M:%S')}"
            if forced
            else f"process {t.get(PID_TAG)} on {host} is gone (killed hard?); found at "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} by a later start"
        )
        client.set_tag(r.info.run_id, KILLED_TAG, why)
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
        tags.setdefault(
            "mlflow.source.git.commit",
            subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=here
            ).stdout.strip(),
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            cwd=here,
        ).stdout.strip()
        tags["mlflow.source.git.dirty"] = "true" if dirty else "false"
    except (OSError, subprocess.CalledProcessError):
        pass  # not a git checkout
    return tags


def library_versions() -> dict[str, str]:
    import mlflow
    import torch
    import transformers

    return {
        "version.python": platform.python_version(),
        "version.torch": torch.__version__,
        "version.transformers": transformers.__version__,
        "version.mlflow": mlflow.__version__,
    }


# --- reading runs back ---------------------------------------------------------------------------


def find_runs(uri: str, run: str, limit: int = 20) -> list[tuple[str, str]]:
    """A run id -> [(id, name)]; a run name -> its FINISHED runs, newest first."""
    client = mlflow_client(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    if not exps:
        return []
    found = (
        client.search_runs(exps, filter_string=f"attributes.run_id = '{run}'")
        if len(run) == 32 and run.isalnum()
        else []
    )
    if not found:
        found = client.search_runs(
            exps,
            filter_string=f"attributes.run_name = '{run}' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=limit,
        )
    return [(r.info.run_id, r.info.run_name) for r in found]


def run_tags(uri: str, run_id: str) -> dict[str, str]:
    """A run's tags (e.g. `target_identity`, `dtype`: what dflash.cli.compare checks beside the rows)."""
    return dict(mlflow_client(uri).get_run(run_id).data.tags)


def load_per_prompt(uri: str, run_id: str) -> list[dict[str, Any]]:
    """The per-prompt rows an evaluation run logged (`Run.log_per_prompt`)."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no download bar on the console
    with tempfile.TemporaryDirectory() as d:
        try:
            path = mlflow_client(uri).download_artifacts(run_id, PER_PROMPT, d)
        except Exception as e:
            raise TrackingError(
                f"run {run_id} has no {PER_PROMPT}: is it an evaluation run that finished? ({e})"
            ) from e
        table = json.loads(Path(path).read_text())
    return [dict(zip(table["columns"], row)) for row in table["data"]]


def metric_history(uri: str, run: str, keys: Sequence[str] | None = None) -> dict[str, list[tuple[int, float]]]:
    """A run's metrics as logged, step by step: {name: [(step, value)], sorted by step}; `run`: its id, or its name
    (the newest run of that name in any experiment: what a trainer's `--report-to mlflow` run is known by);
    `keys`: only these names (default: every metric the run holds)."""
    client = mlflow_client(uri)
    try:
        exps = [e.experiment_id for e in client.search_experiments()]
    except Exception as e:
        raise TrackingError(f"cannot read the MLflow store {uri}: {type(e).__name__}: {e}") from None
    found = (
        client.search_runs(exps, f"attributes.run_id = '{run}'") if exps and len(run) == 32 and run.isalnum() else []
    )
    if not found and exps:
        found = client.search_runs(
            exps, f"attributes.run_name = '{run}'", order_by=["attributes.start_time DESC"], max_results=1
        )
    if not found:
        raise TrackingError(
            f"no run with id or name {run!r} in {uri}: pass the trainer's run id or name (train_metrics.run) and its "
            "store (train_metrics.uri)"
        )
    rid = found[0].info.run_id
    names = list(keys) if keys is not None else list(found[0].data.metrics)
    out = {}
    for k in names:
        pts = sorted({(m.step, m.timestamp): m.value for m in client.get_metric_history(rid, k)}.items())
        if pts:
            out[k] = [(int(step), float(v)) for (step, _), v in pts]
    return out


def trainer_runs(
    uri: str, names: Sequence[str] = (), ids: Sequence[str] = (), output_dir_like: str | None = None
) -> list[RunSpan]:
    """A trainer's MLflow runs, of any experiment: those with these ids, every run of these names (a trainer
    restarted starts a new run of the same name), and those whose `output_dir` param holds `output_dir_like`."""
    client = mlflow_client(uri)
    try:
        exps = [e.experiment_id for e in client.search_experiments()]
    except Exception as e:
        raise TrackingError(f"cannot read the MLflow store {uri}: {type(e).__name__}: {e}") from None
    if not exps:
        return []
    quoted = [q.replace("'", "\\'") for q in (*ids, *names)]
    filters = [f"attributes.run_id = '{i}'" for i in quoted[: len(ids)]]
    filters += [f"attributes.run_name = '{n}'" for n in quoted[len(ids) :]]
    if output_dir_like:
        filters.append(f"params.output_dir LIKE '%{output_dir_like.replace(chr(39), '')}%'")
    found: dict[str, Any] = {}
    for f in filters:
        for r in client.search_runs(exps, f, max_results=1000):
            found[r.info.run_id] = r
    return [
        RunSpan(
            r.info.run_id,
            r.info.run_name,
            int(r.info.start_time or 0),
            None if r.info.status == "RUNNING" or r.info.end_time is None else int(r.info.end_time),
            r.data.params.get("output_dir"),
        )
        for r in found.values()
    ]


def main(argv: list[str] | None = None) -> int:
    """`python -m dflash.tracking reap [--uri URI] [--run RUN_ID ...]`: end runs left RUNNING by a hard kill."""
    ap = argparse.ArgumentParser(prog="python -m dflash.tracking", description=main.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser(
        "reap", help="end KILLED this host's RUNNING runs whose process is gone (and --run ones, whatever their host)"
    )
    r.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"))
    r.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="RUN_ID",
        help="also end this run KILLED (e.g. one left by another machine)",
    )
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
