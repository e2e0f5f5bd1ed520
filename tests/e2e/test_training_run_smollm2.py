"""A training run on the real SmolLM2 target: `drafter.step=all` on the shipped run folder (one parent, its curves
at the training steps, the trainer's metrics.jsonl under train/), and `dflash.evaluate(...)` from plain Python
against the CLI on the same inputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
FAST = ["prompts.num_prompts=2", "prompts.max_new_tokens=24"]


def evaluate(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "DFLASH_CACHE_DIR": str(ROOT / ".cache"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db",
        "PYTHONPATH": str(ROOT),
    }
    cmd = [sys.executable, str(ROOT / "evaluate.py"), *args, f"hydra.run.dir={tmp}/out"]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)


def test_step_all_on_the_shipped_run_is_one_parent_with_curves_at_its_training_steps(tmp_path):
    from dflash import tracking

    r = evaluate(tmp_path, "drafter=fixed", "drafter.step=all", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 step(s) evaluated" in r.stdout and "MLflow: training run parent" in r.stdout
    c = tracking.mlflow_client(f"sqlite:///{tmp_path}/mlflow.db")
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()])
    (parent,) = [x for x in runs if x.data.tags.get(tracking.ROLE_TAG) == tracking.TRAINING_RUN]
    kids = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert (
        sorted(k.info.run_name for k in kids) == ["fixed@step_1633", "fixed@step_5037"]
        and parent.info.status == "FINISHED"
    )
    assert all(k.data.params["drafter.step"] == k.data.tags["drafter_step"] for k in kids)  # the step, not "all"
    tau = {int(k.data.tags["drafter_step"]): k.data.metrics["acceptance_length"] for k in kids}
    hist = sorted((m.step, m.value) for m in c.get_metric_history(parent.info.run_id, "acceptance_length"))
    assert hist == [(1633, tau[1633]), (5037, tau[5037])]
    for key in (
        "expected_acceptance_length",
        "acceptance_length_macro",
        "accuracy/slot_1",
        "accuracy/slot_2",
        "accuracy/slot_3",
    ):
        assert sorted(m.step for m in c.get_metric_history(parent.info.run_id, key)) == [1633, 5037], key
    acc = c.get_metric_history(
        parent.info.run_id, "train/acc"
    )  # checkpoints/fixed/metrics.jsonl, at the trainer's steps
    assert len(acc) > 10 and max(m.step for m in acc) >= 5000 and all(m.step % 50 == 0 for m in acc)
    again = evaluate(
        tmp_path, "drafter=fixed", "drafter.step=all", *FAST
    )  # nothing new: both steps skipped, no child added
    assert again.returncode == 0 and "0 step(s) evaluated, 2 already in its parent" in again.stdout, again.stderr[
        -3000:
    ]


def test_the_python_api_gives_the_clis_tau(tmp_path, monkeypatch):
    import dflash
    from dflash import tracking

    r = evaluate(tmp_path, "drafter=fixed", "drafter.step=1633", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    c = tracking.mlflow_client(f"sqlite:///{tmp_path}/mlflow.db")
    (cli,) = c.search_runs([e.experiment_id for e in c.search_experiments()])
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(ROOT / ".cache"))
    res = dflash.evaluate(
        ROOT / "checkpoints/fixed/step_1633", overrides=FAST, log=True, tracking_uri=f"sqlite:///{tmp_path}/api.db"
    )
    assert res.info.drafter_step == 1633 and res.metrics["acceptance_length"] > 1.0
    assert res.metrics["acceptance_length"] == pytest.approx(cli.data.metrics["acceptance_length"], abs=1e-9)
    assert res.metrics["expected_acceptance_length"] == pytest.approx(
        cli.data.metrics["expected_acceptance_length"], abs=1e-9
    )
    logged = tracking.mlflow_client(f"sqlite:///{tmp_path}/api.db").get_run(res.run_id)
    assert logged.info.status == "FINISHED" and logged.data.metrics["acceptance_length"] == pytest.approx(
        res.metrics["acceptance_length"]
    )
