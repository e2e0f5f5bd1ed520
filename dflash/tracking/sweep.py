"""A `-m` sweep's parent run: opened at the sweep's start, closed at its end with the comparison of
its children (table, plots, best τ, description) and its status."""

from __future__ import annotations

import json
from typing import Any, Sequence

from dflash.errors import TrackingError
from dflash.tracking.run import Run
from dflash.tracking.store import (PARENT_TAG, ROLE_TAG, SWEEP_TAG, ensure_experiment, load_per_prompt, mlflow_client, open_store, reap,
                                   store_lock, sweep_parent)


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

    client = mlflow_client(uri)
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


