"""Parent runs: a `-m` sweep's and a training run's, and their children read back. One module for both families.

A family is what makes a run a child: `SweepFamily` (the jobs of one `-m` sweep, found by the sweep's unique id,
dflash/cli/app.py) and `TrainingRunFamily` (the evaluated steps of one training run on one target and prompt
setting, found by a digest of that identity, dflash/evaluation/series.py). `Run(..., parent=family)` finds or creates
the
family's parent in its experiment under the store lock (jobs launched together share one parent) and tags the
child. At a sweep's end `sweep_parents` reads the children back and `finish_parent` gives the parent what the
caller made of them; a training run's parent is reopened by each invocation (`open_parent`), learns which
steps its finished children hold (`evaluated_steps`) and gets one point per step on its curves. No report code
here: the callers compose descriptions and files (dflash.report) between these calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dflash.tracking.record import (
    CHECKPOINT_SHA_TAG,
    DRAFTER_STEP_TAG,
    JOB_TAG,
    OVERRIDES_TAG,
    PROMPT_LOOKUP_TAU,
    TAU,
    RunTags,
)
from dflash.tracking.run import Run
from dflash.tracking.store import (
    NOTE_TAG,
    PARENT_TAG,
    ROLE_TAG,
    SERIES_TAG,
    SWEEP,
    SWEEP_TAG,
    TRAINING_RUN,
    ensure_experiment,
    load_per_prompt,
    mlflow_client,
    open_store,
    process_tags,
    reap,
    source_tags,
    store_lock,
)
from dflash.util.errors import TrackingError

SWEEP_DIR_TAG = "dflash.sweep_dir"
RUN_DIR_TAG = "dflash.run_dir"  # a training run's parent: the folder its steps come from
LINEAGE_TAG = "dflash.lineage"  # a training run's parent: 0, 1, ...: a new parent each time the trainer rewound the run
REPLACED_BY_TAG = "dflash.replaced_by"  # an earlier lineage's parent: the parent that goes on from it
SUPERSEDED_TAG = "dflash.superseded_by"  # a step's child whose weights the trainer rewrote or dropped (a rewind)
BEST_CHILD_TAG = "dflash.best_child"
JOBS_TAG, FAILED_JOBS_TAG = (
    "dflash.jobs",
    "dflash.failed_jobs",
)  # a sweep's parent: its children counted, the failed jobs


@dataclass(frozen=True)
class SweepFamily:
    """The jobs of one `-m` sweep (dflash.cli.app.SweepInfo: id, name, dir)."""

    id: str
    name: str
    dir: str

    def parent_run(self, client, experiment_id: str) -> str:
        """The sweep's parent in this experiment, created if missing (call under store_lock)."""
        found = client.search_runs(
            [experiment_id], f"tags.`{SWEEP_TAG}` = '{self.id}' and tags.`{ROLE_TAG}` = '{SWEEP}'", max_results=1
        )
        if found:
            return found[0].info.run_id
        tags = {
            SWEEP_TAG: self.id,
            ROLE_TAG: SWEEP,
            SWEEP_DIR_TAG: self.dir,
            **source_tags(),
            **process_tags(),
            NOTE_TAG: f"A `-m` sweep (`{self.name}`), running: its children are the jobs. When it ends this run holds "
            f"their comparison.",
        }
        return client.create_run(experiment_id, run_name=self.name, tags=tags).info.run_id

    def child_tags(self) -> dict[str, str]:
        return {SWEEP_TAG: self.id}


@dataclass(frozen=True)
class TrainingRunFamily:
    """The evaluated steps of one training run: `id` digests what makes their τ comparable (the run folder, the
    target, the prompts and references settings); `name` the parent's run name."""

    id: str
    name: str
    run_dir: str
    note: str = ""

    def parent_run(self, client, experiment_id: str) -> str:
        """The parent of the run's newest lineage (created if there is none)."""
        found = client.search_runs(
            [experiment_id],
            f"tags.`{SERIES_TAG}` = '{self.id}' and tags.`{ROLE_TAG}` = '{TRAINING_RUN}'",
            max_results=100,
        )
        live = [r for r in found if REPLACED_BY_TAG not in r.data.tags]
        if live:
            return max(live, key=lambda r: int(r.data.tags.get(LINEAGE_TAG, 0))).info.run_id
        tags = {
            SERIES_TAG: self.id,
            ROLE_TAG: TRAINING_RUN,
            RUN_DIR_TAG: self.run_dir,
            **source_tags(),
            **process_tags(),
            NOTE_TAG: self.note or f"τ by training step of `{self.run_dir}`: one child per evaluated step.",
        }
        return client.create_run(experiment_id, run_name=self.name, tags=tags).info.run_id

    def child_tags(self) -> dict[str, str]:
        return {SERIES_TAG: self.id}


def open_parent(uri: str, experiment: str, family: Any, artifact_location: str | None = None) -> str:
    """Find or create the family's parent (at a sweep's start; at each evaluation of a training run) -> its run id."""
    with store_lock(uri):
        client = open_store(uri)
        reap(client)
        return family.parent_run(client, ensure_experiment(client, experiment, artifact_location))


@dataclass
class ChildRun:
    """A child as the store holds it."""

    name: str
    run_id: str
    job: int  # a sweep job's number (-1: none)
    status: str  # FINISHED, FAILED, KILLED, RUNNING
    overrides: list[str]
    params: dict[str, str]
    rows: list[dict[str, Any]] | None  # per_prompt.json; None: it logged none (failed)
    identity: RunTags = field(default_factory=RunTags)  # its target and dtype
    metrics: dict[str, float] = field(default_factory=dict)  # its scalars' last values
    step: int | None = None  # a training run's child: the drafter's step
    sha256: str | None = None  # its checkpoint's digest
    superseded_by: str | None = None  # a training run's child whose step the trainer rewrote: what replaced it
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def prompt_lookup_tau(self) -> float | None:
        """The yardstick's τ it logged (dflash.tracking.record.PROMPT_LOOKUP_TAU); None: none."""
        return self.metrics.get(PROMPT_LOOKUP_TAU)


@dataclass
class ParentRun:
    name: str
    run_id: str
    children: list[ChildRun] = field(default_factory=list)  # in job order (a training run's: by step)


def _child(uri: str, k, rows: bool) -> ChildRun:
    t = k.data.tags
    step = t.get(DRAFTER_STEP_TAG)
    return ChildRun(
        k.info.run_name,
        k.info.run_id,
        int(t.get(JOB_TAG, -1)),
        k.info.status,
        json.loads(t.get(OVERRIDES_TAG, "[]")),
        dict(k.data.params),
        _rows_or_none(uri, k) if rows else None,
        RunTags.of(t),
        dict(k.data.metrics),
        int(step) if step not in (None, "None", "") else None,
        t.get(CHECKPOINT_SHA_TAG),
        t.get(SUPERSEDED_TAG),
        dict(t),
    )


def children(uri: str, parent_id: str, rows: bool = True) -> list[ChildRun]:
    """A parent's children, in job order, then by step (`rows`: with their per-prompt rows)."""
    client = mlflow_client(uri)
    exp = client.get_run(parent_id).info.experiment_id
    kids = [
        _child(uri, k, rows)
        for k in client.search_runs([exp], f"tags.`{PARENT_TAG}` = '{parent_id}'", max_results=5000)
    ]
    return sorted(kids, key=lambda c: (c.job, c.step if c.step is not None else -1))


def sweep_parents(uri: str, sweep_id: str) -> list[ParentRun]:
    """Every parent of the sweep (one per experiment) with its children, in job order."""
    client = mlflow_client(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    found = (
        client.search_runs(exps, f"tags.`{SWEEP_TAG}` = '{sweep_id}' and tags.`{ROLE_TAG}` = '{SWEEP}'") if exps else []
    )
    return [ParentRun(p.info.run_name, p.info.run_id, children(uri, p.info.run_id)) for p in found]


def series_children(uri: str, parent_id: str) -> list[ChildRun]:
    """A training run's children, of every lineage (found by the series tag the parent and its children share), by
    step; no per-prompt rows."""
    client = mlflow_client(uri)
    p = client.get_run(parent_id)
    sid = p.data.tags.get(SERIES_TAG)
    if sid is None:
        return children(uri, parent_id, rows=False)
    found = client.search_runs([p.info.experiment_id], f"tags.`{SERIES_TAG}` = '{sid}'", max_results=5000)
    kids = [_child(uri, k, False) for k in found if k.data.tags.get(ROLE_TAG) is None]
    return sorted(kids, key=lambda c: (c.step if c.step is not None else -1, c.run_id))


def evaluated_steps(uri: str, parent_id: str) -> dict[str, tuple[int, str]]:
    """A training run's parent: checkpoint digest -> (step, child run id), over its FINISHED children of every
    lineage that no rewind superseded (what a new invocation skips)."""
    return {
        c.sha256: (c.step, c.run_id)
        for c in series_children(uri, parent_id)
        if c.status == "FINISHED" and c.sha256 and c.step is not None and c.superseded_by is None
    }


def supersede(uri: str, run_ids: list[str], by: str) -> None:
    """Mark children superseded (the trainer rewrote or dropped their step in a rewind): `by`, what replaced them."""
    client = mlflow_client(uri)
    for r in run_ids:
        client.set_tag(r, SUPERSEDED_TAG, by)


def new_lineage(uri: str, parent_id: str, below: int, note: str) -> str:
    """A rewind: a new parent for the training run (lineage + 1), holding the old parent's points at steps below
    `below` (MLflow's curves only grow, so the rewound steps' points cannot leave the old one), which ends FINISHED
    tagged with its successor -> the new parent's id."""
    from mlflow.entities import Metric

    with store_lock(uri):
        client = open_store(uri)
        old = client.get_run(parent_id)
        t = old.data.tags
        n = int(t.get(LINEAGE_TAG, 0)) + 1
        keep = {k: t[k] for k in (SERIES_TAG, ROLE_TAG, RUN_DIR_TAG) if k in t}
        tags = {**keep, LINEAGE_TAG: str(n), **source_tags(), **process_tags(), NOTE_TAG: note}
        new = client.create_run(old.info.experiment_id, run_name=old.info.run_name, tags=tags).info.run_id
    points = [
        Metric(k, m.value, m.timestamp, m.step)
        for k in old.data.metrics
        for m in client.get_metric_history(parent_id, k)
        if m.step < below
    ]
    for i in range(0, len(points), 1000):
        client.log_batch(new, metrics=points[i : i + 1000])
    client.set_tag(parent_id, REPLACED_BY_TAG, new)
    client.set_tag(parent_id, NOTE_TAG, f"Rewound at step {below}: the run goes on in parent {new} (lineage {n}).")
    client.set_terminated(parent_id, "FINISHED")
    return new


def adopt(uri: str, child_id: str, parent_id: str) -> None:
    """Move a child under another parent (a step evaluated just before its run's new lineage began)."""
    mlflow_client(uri).set_tag(child_id, PARENT_TAG, parent_id)


def finish_parent(
    uri: str,
    parent_id: str,
    status: str,
    files: dict[str, bytes],
    best_child: tuple[str, str] | None,
    tags: dict[str, Any],
    note: str,
) -> None:
    """Log the comparison to the parent and end it `status`; `best_child` (name, run id): its τ metrics become the
    parent's."""
    run = Run.attach(uri, parent_id)
    if files:
        run.log_files(files)
    if best_child is not None:
        m = run.client.get_run(best_child[1]).data.metrics
        run.log_metrics({k: v for k, v in m.items() if k.startswith((TAU, f"expected_{TAU}"))})
        tags = {**tags, BEST_CHILD_TAG: f"{best_child[0]} ({best_child[1]})"}
    run.set_tags(tags)
    run.set_note(note)
    run.end(status)


def _rows_or_none(uri: str, run) -> list[dict[str, Any]] | None:
    if run.info.status != "FINISHED":
        return None
    try:
        return load_per_prompt(uri, run.info.run_id)
    except TrackingError:
        return None
