"""Sweeps launched in parallel (joblib: jobs as processes at once; submitit: the SLURM launcher's
local twin) on a tiny target: MLflow parent/children intact, no race on the tracking store."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from dflash.config.compose import CONF_DIR, register
from dflash.evaluation.pipeline import job_device

ROOT = Path(__file__).resolve().parents[2]


def sweep(tmp: Path, target_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "DFLASH_CACHE_DIR": str(tmp / "cache"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db",
        "PYTHONPATH": str(ROOT),
    }
    cmd = [
        sys.executable,
        str(ROOT / "evaluate.py"),
        "-m",
        "target=local",
        "drafter=init",
        f"target.path={target_dir}",
        "target.mask_token_id=3",
        "target.template.use_chat_template=false",
        "prompts.num_prompts=2",
        "prompts.max_new_tokens=12",
        "drafter.seed=0,1,2",
        f"hydra.sweep.dir={tmp}/multi",
        *args,
    ]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)


def family(tmp: Path):
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()])
    parents = [r for r in runs if r.data.tags.get("dflash.role") == "sweep"]
    kids = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return parents, kids


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher",
    [
        ["hydra/launcher=joblib", "hydra.launcher.n_jobs=3"],
        ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10"],
    ],
)
def test_parallel_sweep_keeps_one_parent(tmp_path, qwen3_dir, launcher):
    r = sweep(tmp_path, qwen3_dir, *launcher)
    assert r.returncode == 0, r.stderr[-3000:]
    parents, kids = family(tmp_path)
    assert len(parents) == 1, [p.info.run_name for p in parents]  # jobs started together, one parent
    assert sorted(k.info.run_name for k in kids) == ["init@seed_0", "init@seed_1", "init@seed_2"]
    assert all(k.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for k in kids)
    assert all(k.info.status == "FINISHED" for k in kids) and parents[0].info.status == "FINISHED"


def test_slurm_launcher_config_composes():
    register()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "device=gpu_per_job"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.gpus_per_node == 1 and cfg.device.gpu_per_job


def test_job_device_round_robin(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [job_device("cuda", j) for j in range(6)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0", "cuda:1"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert job_device("cpu", 3) == "cpu"
