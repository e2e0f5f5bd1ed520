"""A `-m` sweep's parent run: opened at the sweep's start; at its end its children are read back
(`sweep_parents`) and the parent is given what the caller made of them (`finish_parent`: files, the
best child's τ, tags, a description, its status). No report code here: dflash/entry.py composes the
comparison (dflash.report.sweep) between the two calls."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dflash.tracking.run import Run
from dflash.tracking.store import (
    PARENT_TAG,
    ROLE_TAG,
    SWEEP_TAG,
    ensure_experiment,
    load_per_prompt,
    mlflow_client,
    open_store,
    reap,
    store_lock,
    sweep_parent,
)
from dflash.tracking.yardstick import PROMPT_LOOKUP_TAU
from dflash.util.errors import TrackingError


def open_sweep(uri: str, experiment: str, sweep: Any, artifact_location: str | None = None) -> str:
    """Create the sweep's parent at its start (in the experiment of the sweep's base config)."""
    with store_lock(uri):
        client = open_store(uri)
        reap(client)
        return sweep_parent(client, ensure_experiment(client, experiment, artifact_location), sweep)


@dataclass
class ChildRun:
    """A sweep child as the store holds it."""

    name: str
    run_id: str
    job: int
    status: str  # FINISHED, FAILED, KILLED, RUNNING
    overrides: list[str]
    params: dict[str, str]
    rows: list[dict[str, Any]] | None  # per_prompt.json; None: it logged none (failed)
    tags: dict[str, str] = field(default_factory=dict)  # the child run's tags (target_identity, dtype, ...)
    prompt_lookup_tau: float | None = None  # the yardstick's τ it logged (dflash.tracking.yardstick); None: none


@dataclass
class ParentRun:
    name: str
    run_id: str
    children: list[ChildRun] = field(default_factory=list)  # in job order


def sweep_parents(uri: str, sweep_id: str) -> list[ParentRun]:
    """Every parent of the sweep (one per experiment) with its children, in job order."""
    client = mlflow_client(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    parents = client.search_runs(exps, f"tags.`{SWEEP_TAG}` = '{sweep_id}' and tags.`{ROLE_TAG}` = 'sweep'") if exps else []
    out = []
    for parent in parents:
        kids = client.search_runs([parent.info.experiment_id], f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'", max_results=5000)
        kids.sort(key=lambda k: int(k.data.tags.get("dflash.job", "0")))
        children = [ChildRun(k.info.run_name, k.info.run_id, int(k.data.tags.get("dflash.job", -1)), k.info.status,
                             json.loads(k.data.tags.get("overrides", "[]")), dict(k.data.params), _rows_or_none(uri, k), dict(k.data.tags),
                             k.data.metrics.get(PROMPT_LOOKUP_TAU))
                    for k in kids]
        out.append(ParentRun(parent.info.run_name, parent.info.run_id, children))
    return out


def finish_parent(uri: str, parent_id: str, status: str, files: dict[str, bytes], best_child: tuple[str, str] | None,
                  tags: dict[str, Any], note: str) -> None:
    """Log the comparison to the parent and end it `status`; `best_child` (name, run id): its τ metrics become the parent's."""
    client = mlflow_client(uri)
    run = Run.__new__(Run)  # log through Run's methods on the existing parent
    run.client, run.run_id, run._params = client, parent_id, set()
    if files:
        run.log_files(files)
    if best_child is not None:
        m = client.get_run(best_child[1]).data.metrics
        run.log_metrics({k: v for k, v in m.items() if k.startswith(("acceptance_length", "expected_acceptance_length"))})
        tags = {**tags, "dflash.best_child": f"{best_child[0]} ({best_child[1]})"}
    run.set_tags(tags)
    run.set_note(note)
    client.set_terminated(parent_id, status)


def _rows_or_none(uri: str, run) -> list[dict[str, Any]] | None:
    if run.info.status != "FINISHED":
        return None
    try:
        return load_per_prompt(uri, run.info.run_id)
    except TrackingError:
        return None
