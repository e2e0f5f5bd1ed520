"""dflash.tracking in process, on a temporary SQLite store: stale runs and the reap command, what a
run logs (undefined values skipped, curves beside scalars), the ending of a run on each kind of exit,
and the evaluation experiment's saved view."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess

import pytest

from dflash import tracking
from dflash.util.errors import Terminated


@pytest.fixture
def uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # ./mlruns
    return f"sqlite:///{tmp_path}/mlflow.db"


def _running(client, exp_id: str, name: str, **tags: str) -> str:
    return client.create_run(exp_id, run_name=name, tags=tags).info.run_id


def test_reap_ends_only_runs_whose_process_is_gone(uri, capsys):
    with tracking.store_lock(uri):
        client = tracking.open_store(uri)
        exp = tracking.ensure_experiment(client, "x", None)
    host, me = socket.gethostname(), os.getpid()
    dead = subprocess.Popen(["true"])
    dead.wait()
    ids = {
        "dead": _running(client, exp, "dead", **{tracking.HOST_TAG: host, tracking.PID_TAG: str(dead.pid)}),
        "alive": _running(
            client,
            exp,
            "alive",
            **{
                tracking.HOST_TAG: host,
                tracking.PID_TAG: str(me),
                tracking.PID_START_TAG: tracking.start_ticks(me) or "",
            },
        ),
        "reused pid": _running(
            client, exp, "reused", **{tracking.HOST_TAG: host, tracking.PID_TAG: str(me), tracking.PID_START_TAG: "1"}
        ),
        "other host": _running(client, exp, "other", **{tracking.HOST_TAG: host + "-elsewhere", tracking.PID_TAG: "1"}),
    }
    assert tracking.main(["reap", "--uri", uri]) == 0
    status = {k: client.get_run(v).info.status for k, v in ids.items()}
    assert status == {"dead": "KILLED", "alive": "RUNNING", "reused pid": "KILLED", "other host": "RUNNING"}
    assert f"process {dead.pid} on {host} is gone" in client.get_run(ids["dead"]).data.tags["dflash.killed"]
    assert "2 run(s) ended KILLED" in capsys.readouterr().out
    assert (
        tracking.main(["reap", "--uri", uri, "--run", ids["other host"]]) == 0
    )  # what this host cannot see, on demand
    assert (
        client.get_run(ids["other host"]).info.status == "KILLED"
        and client.get_run(ids["alive"]).info.status == "RUNNING"
    )
    assert tracking.main(["reap", "--uri", uri, "--run", "0" * 32]) == 2


def test_a_run_logs_what_is_defined_and_records_its_process(uri):
    with tracking.Run(uri, "dflash/x", "d@step_1", tags={"group.drafter": "fixed", "nothing": None}) as run:
        run.log_params({"drafter": {"step": None, "kind": "training"}, "taps": [1, 2]})
        run.log_params({"drafter.step": 7, "drafter.kind": "ignored: logged already"})
        run.log_metrics(
            {"acceptance_length": 1.5, "undefined": None, "nan": math.nan},
            curves={"by_position/accept_rate": [0.5, None, 0.1]},
        )
    r = tracking.mlflow_client(uri).get_run(run.run_id)
    assert r.info.status == "FINISHED" and r.data.params == {
        "drafter.kind": "training",
        "taps": "[1, 2]",
        "drafter.step": "7",
    }
    assert set(r.data.metrics) == {"acceptance_length", "by_position/accept_rate"}
    hist = tracking.mlflow_client(uri).get_metric_history(run.run_id, "by_position/accept_rate")
    assert sorted((m.step, m.value) for m in hist) == [(1, 0.5), (3, 0.1)]  # slot 2 undefined: no point, not 0
    t = r.data.tags
    assert t["dflash.pid"] == str(os.getpid()) and t["dflash.host"] == socket.gethostname() and "nothing" not in t
    assert t["mlflow.source.git.commit"] and t["mlflow.source.git.dirty"] in ("true", "false") and "git_commit" not in t
    exp = tracking.mlflow_client(uri).get_experiment(run.experiment_id)
    assert (
        exp.tags["mlflow.experimentKind"] == "custom_model_development"
    )  # MLflow 3 opens it as model training, not GenAI


@pytest.mark.parametrize(
    "exc, status, tag",
    [
        (ValueError("boom"), "FAILED", "error"),
        (KeyboardInterrupt(), "KILLED", "dflash.killed"),
        (Terminated("terminated by signal 15"), "KILLED", "dflash.killed"),
    ],
)
def test_every_exit_ends_the_run_and_a_signal_its_sweep_parent(uri, exc, status, tag):
    sweep = tracking.SweepFamily("abc123", "sweep drafter.seed=0,1", "/tmp/multi")
    with pytest.raises(type(exc)):
        with tracking.Run(uri, "dflash/x", "d@step_1", parent=sweep) as run:
            raise exc
    c = tracking.mlflow_client(uri)
    r, parent = c.get_run(run.run_id), c.get_run(run.parent_id)
    assert r.info.status == status and tag in r.data.tags and r.data.tags[tracking.SWEEP_TAG] == "abc123"
    assert parent.info.status == ("KILLED" if status == "KILLED" else "RUNNING")  # a failed job leaves the sweep going
    assert parent.info.run_name == "sweep drafter.seed=0,1" and parent.data.tags[tracking.SWEEP_TAG] == "abc123"


def test_a_signal_during_a_store_write_waits_for_the_write(uri):
    """SIGTERM arriving inside an MLflow write is held back until the write returns (MLflow's sessions roll
    back on Exception only: a BaseException raised mid-write can leave the SQLite store locked), then raised;
    the write is whole and the store takes the run's closing writes at once."""
    import signal
    import time

    from dflash.util.errors import install_signal_handlers

    old = signal.getsignal(signal.SIGTERM)
    install_signal_handlers()
    try:
        with tracking.Run(uri, "dflash/x", "r") as run:
            c = tracking.mlflow_client(uri)
            real = c._client.set_tag

            def signalled_mid_write(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGTERM)  # delivered now, unless held back
                time.sleep(0.05)
                return real(*args, **kwargs)

            c._client.set_tag = signalled_mid_write
            with pytest.raises(Terminated):
                c.set_tag(run.run_id, "written", "yes")
    finally:
        signal.signal(signal.SIGTERM, old)
    r = tracking.mlflow_client(uri).get_run(run.run_id)
    assert (
        r.data.tags["written"] == "yes" and r.info.status == "FINISHED"
    )  # the write, then the signal, outside the run's block


def test_a_new_store_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """A new SQLite store is built under a temporary name and renamed into place: creation that stops midway (here
    an error after MLflow made some tables) leaves neither the store nor the temporary file, and the next run
    creates it whole. A store already broken is a TrackingError (exit 2), not a traceback."""
    from dflash.tracking import store
    from dflash.util.errors import TrackingError

    db = tmp_path / "mlflow.db"
    real = store.mlflow_client

    def dies_after_creating(uri):
        real(uri)  # the tables exist in the temporary file
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "mlflow_client", dies_after_creating)
    with pytest.raises(KeyboardInterrupt):
        store.open_store(f"sqlite:///{db}")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(store, "mlflow_client", real)
    store.open_store(f"sqlite:///{db}").search_experiments()
    assert [p.name for p in tmp_path.iterdir()] == ["mlflow.db"]

    def no_hard_links(src, dst):
        raise PermissionError(1, "Operation not permitted")  # e.g. some network or FUSE filesystems

    monkeypatch.setattr(store.os, "link", no_hard_links)
    renamed = tmp_path / "renamed.db"
    store.open_store(f"sqlite:///{renamed}").search_experiments()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "renamed.db"]

    broken = tmp_path / "broken.db"
    broken.write_bytes(b"not a database" * 100)
    with pytest.raises(TrackingError, match="cannot open the MLflow store .*move it aside"):
        store.open_store(f"sqlite:///{broken}")


def test_a_store_created_meanwhile_is_kept_under_its_open_client(tmp_path, monkeypatch):
    """A client that opens the store outside store_lock while this process builds it under a temporary name: its
    store is kept (not swapped under its connection, which SQLite would then refuse to write through)."""
    from dflash.tracking import store

    db, real, other = tmp_path / "mlflow.db", store.mlflow_client, []

    def meanwhile(uri):
        if not other:
            other.append(real(f"sqlite:///{db}"))  # the other process's client creates the store first
            other[0].create_experiment("other")
        return real(uri)

    monkeypatch.setattr(store, "mlflow_client", meanwhile)
    store.open_store(f"sqlite:///{db}")
    other[0].create_experiment("still writable")
    assert {e.name for e in real(f"sqlite:///{db}").search_experiments()} >= {"other", "still writable"}
    assert [p.name for p in tmp_path.iterdir()] == ["mlflow.db"]


def test_unwritable_store_is_a_tracking_error(tmp_path):
    from dflash.util.errors import TrackingError

    with pytest.raises(TrackingError, match="cannot write beside the MLflow store"):
        tracking.Run("sqlite:////proc/dflash-nope/mlflow.db", "x", "r")


def test_saved_view_puts_tau_and_curves_first_and_learns_new_subsets(uri):
    with tracking.Run(uri, "dflash/x", "r") as run:
        run.setup_eval_experiment(["fresh", "train_like"])
        run.setup_eval_experiment(["fresh"])  # nothing new: unchanged
        run.setup_eval_experiment(["humaneval"])
    tags = tracking.mlflow_client(uri).get_experiment(run.experiment_id).tags
    view = json.loads(tags["mlflow.sharedViewState.dflash"])
    state = json.loads(view["state"])
    assert view["name"] == "dflash: τ and curves" and "τ" in tags["mlflow.note.content"]
    assert state["selectedColumns"][:3] == [
        "attributes.`Dataset`",
        "metrics.`acceptance_length`",
        "metrics.`acceptance_length_se`",
    ]
    assert (
        "metrics.`acceptance_length/humaneval`" in state["selectedColumns"]
        and "metrics.`acceptance_length/train_like`" in state["selectedColumns"]
    )
    first = [
        c["metricKey"]
        for c in state["compareRunCharts"]
        if c["metricSectionId"] == state["compareRunSections"][0]["uuid"]
    ]
    assert first == [
        "acceptance_length",
        "by_position/accept_rate",
        "by_position/accept_rate_cond",
        "by_position/accuracy",
        "by_commit/share",
    ]
    assert state["isAccordionReordered"] and [s["display"] for s in state["compareRunSections"][:2]] == [True, True]
    assert not any(s["display"] for s in state["compareRunSections"][2:])  # the rest collapsed


def test_metrics_are_logged_at_full_precision(uri):
    """What MLflow stores is the measured float, not a rounded one: two runs equal to 4 decimals stay apart."""
    a, b = 1 / 3, 1 / 3 + 1e-9
    with tracking.Run(uri, "dflash/x", "d@step_1") as run:
        run.log_metrics({"acceptance_length": a, "other": b}, curves={"by_position/accuracy": [a]})
    c = tracking.mlflow_client(uri)
    m = c.get_run(run.run_id).data.metrics
    assert m["acceptance_length"] == a and m["other"] == b and m["acceptance_length"] != m["other"]
    assert [h.value for h in c.get_metric_history(run.run_id, "by_position/accuracy")] == [a]


def test_a_run_is_renamed_and_its_per_prompt_rows_read_back(uri):
    """The run name and the per-prompt artifact's name are dflash.tracking's (evaluate.py names neither): a renamed run
    is found
    by its new name, and what log_per_prompt logs is what load_per_prompt reads."""
    rows = [{"id": "p0", "steps": 3, "acceptance_length": 1.5}, {"id": "p1", "steps": 0, "acceptance_length": None}]
    with tracking.Run(uri, "dflash/x", "d@step_") as run:
        run.set_run_name("d@step_7")
        run.log_per_prompt(rows)
    assert (
        tracking.find_runs(uri, "d@step_7") == [(run.run_id, "d@step_7")] and tracking.find_runs(uri, "d@step_") == []
    )
    assert tracking.load_per_prompt(uri, run.run_id) == rows
    assert {a.path for a in tracking.mlflow_client(uri).list_artifacts(run.run_id)} == {tracking.PER_PROMPT}
