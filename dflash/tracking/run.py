"""One MLflow run as a context manager that always ends (FINISHED, FAILED, KILLED), and what it logs."""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from dflash.tracking.record import ERROR_TAG, KILLED_TAG, PER_PROMPT
from dflash.tracking.store import (
    MAX_TAG,
    NOTE_TAG,
    PARENT_TAG,
    RUN_NAME_TAG,
    ensure_experiment,
    library_versions,
    mlflow_client,
    open_store,
    process_tags,
    reap,
    source_tags,
    store_lock,
)
from dflash.tracking.view import setup_eval_experiment, view_url
from dflash.util.errors import Terminated, TrackingError, signals_deferred
from dflash.util.files import atomic_write_bytes


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
    """One run. Use as `with Run(...) as run:`; log through its methods. `parent` (dflash.tracking.parents: a sweep's
    or a training run's `Family`) makes it a child of that family's parent in its experiment; `Run.attach` logs to
    a run that exists (a parent)."""

    def __init__(
        self,
        uri: str,
        experiment: str | None,
        run_name: str,
        artifact_location: str | None = None,
        parent: Any = None,
        tags: dict[str, Any] | None = None,
        resume_id: str | None = None,
        reopen: bool = True,
    ):
        self.uri, self.parent_id, self._params = uri, None, set()
        with store_lock(uri):  # first use creates the SQLite schema; the experiment and the parent once
            self.client = open_store(uri)
            reap(self.client)
            if experiment is None and resume_id:
                self.experiment_id = self.client.get_run(resume_id).info.experiment_id
            else:
                self.experiment_id = ensure_experiment(self.client, str(experiment), artifact_location)
            if parent is not None:
                self.parent_id = parent.parent_run(self.client, self.experiment_id)
        if (
            resume_id
        ):  # a resumed run (a training run, a training run's parent) keeps logging to its run, now from this process
            self.run_id = resume_id
            if reopen:
                self.client.update_run(resume_id, status="RUNNING")
                self.set_tags(process_tags())
            return
        all_tags = {
            **{k: str(v)[:MAX_TAG] for k, v in (tags or {}).items() if v is not None},
            **source_tags(),
            **library_versions(),
            **process_tags(),
        }
        if self.parent_id:
            all_tags.update({PARENT_TAG: self.parent_id, **parent.child_tags()})
        self.run_id = self.client.create_run(self.experiment_id, run_name=run_name, tags=all_tags).info.run_id

    @classmethod
    def attach(cls, uri: str, run_id: str, reopen: bool = False) -> "Run":
        """A `Run` on an existing run (a parent: its curves, files, description, status); `reopen`: mark it RUNNING
        from this process, so leaving a `with` block ends it again."""
        return cls(uri, None, "", resume_id=run_id, reopen=reopen)

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        with signals_deferred():  # a second Ctrl-C waits until the run is ended
            if exc_type is None:
                self.client.set_terminated(self.run_id, "FINISHED")
                return False
            killed = issubclass(exc_type, (KeyboardInterrupt, Terminated))
            why = (
                ("SIGTERM" if issubclass(exc_type, Terminated) else "SIGINT (Ctrl-C)")
                if killed
                else f"{exc_type.__name__}: {exc}"
            )
            try:
                self.client.set_tag(self.run_id, KILLED_TAG if killed else ERROR_TAG, why[:MAX_TAG])
                if killed and self.parent_id:  # the sweep (the training run's evaluation) stops with it
                    self.client.set_tag(self.parent_id, KILLED_TAG, f"{why} during {self.run_id}")
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

    def set_run_name(self, name: str) -> None:
        """Rename the run (e.g. once the drafter's step is known)."""
        self.set_tags({RUN_NAME_TAG: name})

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

    def log_metrics(
        self,
        metrics: dict[str, float | None],
        step: int = 0,
        curves: dict[str, Sequence[float | None]] | None = None,
        first_step: int = 1,
    ) -> None:
        """Scalars at `step`, and each curve as one metric with step = first_step, first_step + 1, ...;
        each value as measured (full precision: rounding is for what a person reads); undefined values
        (None, NaN, inf) are not logged."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step) for k, v in metrics.items() if _finite(v)]
        for name, values in (curves or {}).items():
            items += [Metric(name, float(v), ts, k) for k, v in enumerate(values, start=first_step) if _finite(v)]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def log_points(self, points: dict[str, list[tuple[int, float]]]) -> None:
        """Metrics at steps of their own ({name: [(step, value)]}: a trainer's metrics on a training run's parent),
        batched."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, int(s)) for k, pts in points.items() for s, v in pts if _finite(v)]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        cols = {k: [r.get(k) for r in rows] for k in (rows[0] if rows else {})}
        self.client.log_table(self.run_id, data=cols, artifact_file=artifact_file)

    def log_per_prompt(self, rows: list[dict[str, Any]]) -> None:
        """An evaluation run's per-prompt rows (PromptRow.to_dict), as `load_per_prompt` and dflash-compare read
        them."""
        self.log_table(rows, PER_PROMPT)

    def log_files(self, files: dict[str, bytes]) -> None:
        _log_files(self.client, self.run_id, files)

    def log_dataset(
        self, name: str, digest: str, source: dict[str, Any], profile: dict[str, Any], context: str = "eval"
    ) -> None:
        """An input dataset (the runs table's Dataset column; `dataset.digest = '...'` filters runs on the same
        data)."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        ds = Dataset(
            name=name, digest=digest, source_type="local", source=json.dumps(source), profile=json.dumps(profile)
        )
        self.client.log_inputs(
            self.run_id, datasets=[DatasetInput(ds, tags=[InputTag("mlflow.data.context", context)])]
        )

    def setup_eval_experiment(self, subsets: Sequence[str]) -> None:
        setup_eval_experiment(self.uri, self.experiment_id, subsets)

    def where(self) -> str:
        return (
            f"run {self.run_id} in experiment {self.experiment_id} at {self.uri}\n"
            f"  see it: mlflow ui --backend-store-uri {self.uri}   then {view_url(self.experiment_id)}"
        )


def _log_files(client, run_id: str, files: dict[str, bytes]) -> None:
    with tempfile.TemporaryDirectory() as d:
        for rel, data in files.items():
            atomic_write_bytes(Path(d) / rel, data)
        client.log_artifacts(run_id, d)


def log_files(uri: str, run_id: str, files: dict[str, bytes]) -> None:
    """Log in-memory files (artifact path -> bytes, e.g. `plots/tau.png`) to an existing run."""
    client = mlflow_client(uri)
    try:
        client.get_run(run_id)
    except Exception as e:
        raise TrackingError(
            f"no run {run_id!r} in {uri} to log to; pass the id of a run there (mlflow ui --backend-store-uri {uri})"
        ) from e
    _log_files(client, run_id, files)


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
