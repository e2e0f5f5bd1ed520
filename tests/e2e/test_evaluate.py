"""evaluate.py end to end on the real SmolLM2 target, as a user runs it (subprocess, CPU).

Each run gets its own MLflow store in a temp folder; the converted target and the reference
cache are shared through DFLASH_CACHE_DIR so only the first run pays for them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash.models.drafter.files import save_training_checkpoint
from dflash.models.drafter.model import DFlashDrafter, DrafterConfig

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
FAST = ["prompts.num_prompts=2", "prompts.max_new_tokens=24"]


def evaluate(tmp: Path, *args: str, store: Path | None = None) -> subprocess.CompletedProcess:
    store = store or tmp
    env = {
        **os.environ,
        "DFLASH_CACHE_DIR": str(ROOT / ".cache"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{store}/mlflow.db",
        "PYTHONPATH": str(ROOT),
    }
    cmd = [sys.executable, str(ROOT / "evaluate.py"), *args, f"hydra.run.dir={tmp}/out", f"hydra.sweep.dir={tmp}/multi"]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)


def runs(tmp: Path):
    from mlflow.tracking import MlflowClient

    if not (tmp / "mlflow.db").exists():
        return []
    c = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    exps = [e.experiment_id for e in c.search_experiments()]
    return c.search_runs(exps) if exps else []


def test_default_evaluation_logs_everything(tmp_path):
    r = evaluate(tmp_path, *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "acceptance length τ" in r.stdout and "τ per subset" in r.stdout and "MLflow: run" in r.stdout
    for stage in ("target:", "prompts:", "references (local):", "features:", "replay:"):  # each stage announces itself,
        assert stage in r.stderr and stage in (tmp_path / "out" / "evaluate.log").read_text()  # in Hydra's job log too
    (run,) = runs(tmp_path)
    assert run.info.status == "FINISHED"
    m = run.data.metrics
    for k in [
        "acceptance_length",
        "acceptance_length_se",
        "acceptance_length_macro",
        "expected_acceptance_length",
        "acceptance_length/train_like",
    ]:
        assert k in m
    assert not any("/pos_" in k for k in m)  # per-slot values are curves, never scalars under a scalar-looking name
    assert m["acceptance_length"] > 1.0  # the shipped drafter accepts tokens
    assert (
        m["prompt_lookup/acceptance_length"] >= 1.0
        and "prompt_lookup/gain" in m
        and "prompt lookup (vLLM's ngram" in r.stdout
    )  # the yardstick
    assert run.info.run_name == "fixed-l4-dflash2-warm@step_5000" and run.data.tags["checkpoint_sha256"]
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for kind in ["accept_rate", "accuracy"]:  # defined at every slot here
        assert sorted(x.step for x in c.get_metric_history(run.info.run_id, f"by_position/{kind}")) == list(
            range(1, 16)
        )
    cond = c.get_metric_history(
        run.info.run_id, "by_position/accept_rate_cond"
    )  # slots no step reached are left out (0/0)
    assert {x.step for x in cond} <= set(range(1, 16)) and 1 in {x.step for x in cond}
    share = c.get_metric_history(run.info.run_id, "by_commit/share")
    assert sum(x.value for x in share) == pytest.approx(1.0, abs=1e-3) and min(x.step for x in share) >= 1
    t, p = run.data.tags, run.data.params
    assert (
        t["group.target"] == "smollm2_135m"
        and t["group.drafter"] == "fixed-l4-dflash2-warm"
        and t["version.torch"]
        and t["device"] == "cpu"
    )
    assert t["mlflow.source.git.commit"] and t["mlflow.source.name"].endswith("evaluate.py") and "git_commit" not in t
    assert (
        t["dflash.host"]
        and t["dflash.pid"]
        and t["mlflow.note.content"].startswith(f"**τ = {m['acceptance_length']:.3f}")
    )
    assert p["prompts.max_new_tokens"] == "24" and p["target.template.enable_thinking"] == "False"
    assert (
        p["drafter.step"] == "5000"
        and p["drafter.target_layer_ids"] == "[1, 14, 27]"
        and p["device.dtype"] == "float32"
    )  # as resolved
    (ds,) = run.inputs.dataset_inputs
    assert ds.dataset.name == "prompts:builtin" and len(ds.dataset.digest) == 12
    arts = {a.path for a in c.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "samples.json", "samples.html", "per_prompt.json", "per_position.json", "plots"} <= arts
    samples = json.loads(Path(c.download_artifacts(run.info.run_id, "samples.json", str(tmp_path))).read_text())
    assert len(samples) == 2 and {s["subset"] for s in samples} == {
        "train_like",
        "fresh",
    }  # one record per prompt, every subset
    assert all({"prompt", "reference", "acceptance_length", "blocks"} <= set(s) for s in samples)
    assert {"anchor_pos", "proposal", "accepted", "bonus"} <= set(samples[0]["blocks"][0])


def test_two_job_sweep_is_one_parent_with_two_children(tmp_path):
    r = evaluate(
        tmp_path, "-m", "drafter=fixed", "drafter.step=1633,5037", "scores=true", "progress=false", *FAST
    )  # two steps of one run
    assert r.returncode == 0, r.stderr[-3000:]
    assert "features:" not in r.stderr and "replay:" not in r.stderr  # progress=false: no stage lines
    all_runs = runs(tmp_path)
    parents = [x for x in all_runs if x.data.tags.get("dflash.role") == "sweep"]
    assert (
        len(parents) == 1
        and parents[0].info.status == "FINISHED"
        and parents[0].info.run_name == "sweep drafter.step=1633,5037"
    )
    kids = [x for x in all_runs if x.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(k.info.run_name for k in kids) == ["fixed@step_1633", "fixed@step_5037"]
    assert {k.data.tags["checkpoint_path"] for k in kids} == {
        str(ROOT / "checkpoints/fixed" / f"step_{s}") for s in (1633, 5037)
    }
    assert all(k.info.status == "FINISHED" for k in kids)
    best = max(kids, key=lambda k: k.data.metrics["acceptance_length"])
    assert parents[0].data.metrics["acceptance_length"] == pytest.approx(
        best.data.metrics["acceptance_length"]
    )  # the parent holds the best τ
    assert (
        best.info.run_name in parents[0].data.tags["dflash.best_child"]
        and "| fixed@step_1633 | 1633 |" in parents[0].data.tags["mlflow.note.content"]
    )
    # the two steps side by side, paired by prompt, read back from the store by run name
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "PYTHONPATH": str(ROOT)}
    cmp = subprocess.run(
        [sys.executable, "-m", "dflash.cli.compare", "fixed@step_1633", "fixed@step_5037"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert cmp.returncode == 0, cmp.stderr
    tau = {k.info.run_name: k.data.metrics["acceptance_length"] for k in kids}
    line = next(x for x in cmp.stdout.splitlines() if x.startswith("acceptance_length "))
    a, b, d = (float(v) for v in line.split()[1:4])
    assert (a, b) == pytest.approx((tau["fixed@step_1633"], tau["fixed@step_5037"]), abs=6e-4) and d == pytest.approx(
        b - a, abs=2e-3
    )
    nll = {k.info.run_name: k.data.metrics["nll_mean"] for k in kids}  # scores=true: NLL logged and compared
    line = next(x for x in cmp.stdout.splitlines() if x.startswith("nll_mean "))
    assert [float(v) for v in line.split()[1:3]] == pytest.approx(
        [nll["fixed@step_1633"], nll["fixed@step_5037"]], abs=6e-4
    )
    missing = subprocess.run(
        [sys.executable, "-m", "dflash.cli.compare", "fixed@step_1633", "nope@step_1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "no finished run with id or name 'nope@step_1'" in missing.stderr


def _ckpt(run_dir: Path, step: int, hidden: int = 576) -> None:
    cfg = DrafterConfig(
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        num_target_layers=30,
        target_layer_ids=[1, 7, 14, 20, 27],
        mask_token_id=16,
    )
    m = DFlashDrafter(cfg)
    save_training_checkpoint(run_dir / f"step_{step}" / "checkpoint.pt", m, torch.optim.AdamW(m.parameters()), step)


def _bad_inputs(tmp: Path):
    (tmp / "run").mkdir()
    for s in (10, 20):
        (tmp / "run" / f"step_{s}").mkdir()
        (tmp / "run" / f"step_{s}" / "checkpoint.pt").write_bytes(b"PK\x03\x04 this is not a checkpoint")
    _ckpt(tmp / "other", 5, hidden=64)
    (tmp / "empty.jsonl").write_text("\n")
    (tmp / "bad.jsonl").write_text('{"prompt": "fine"}\n{"prompt": oops}\n')
    return {
        "missing step": (
            ["drafter=training", f"drafter.run_dir={tmp}/run", "drafter.step=15"],
            "steps that exist: 10, 20",
        ),
        "corrupt checkpoint": (["drafter=training", f"drafter.run_dir={tmp}/run", "drafter.step=10"], "corrupt"),
        "shapes do not fit": (
            ["drafter=training", f"drafter.run_dir={tmp}/other"],
            "hidden size 64 != the target's 576",
        ),
        "mask id out of range": (["drafter=init", "drafter.mask_token_id=99999"], "mask_token_id 99999 is not a row"),
        "tap out of range": (["drafter=init", "drafter.target_layer_ids=[1,14,40]"], "taps [40] are outside"),
        "flex on cpu": (["attention=flex"], "needs a CUDA device"),
        "empty prompt set": (["prompts=jsonl", f"prompts.path={tmp}/empty.jsonl"], "empty"),
        "malformed jsonl": (["prompts=jsonl", f"prompts.path={tmp}/bad.jsonl"], "bad.jsonl line 2"),
        "prompt beyond context": (["target.max_context=40"], "exceeds the target's context"),
    }


CASES = [
    "missing step",
    "corrupt checkpoint",
    "shapes do not fit",
    "mask id out of range",
    "tap out of range",
    "flex on cpu",
    "empty prompt set",
    "malformed jsonl",
    "prompt beyond context",
]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """One MLflow store for the bad-input cases (creating a SQLite store costs seconds)."""
    return tmp_path_factory.mktemp("store")


@pytest.mark.parametrize("case", CASES)
def test_bad_input_fails_clearly(tmp_path, store, case):
    args, message = _bad_inputs(tmp_path)[case]
    before = len(runs(store))
    r = evaluate(tmp_path, *args, *FAST, store=store)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    after = runs(store)
    assert len(after) <= before + 1
    assert all(x.info.status == "FAILED" for x in after)  # never left RUNNING


@pytest.mark.parametrize(
    "args, message",
    [
        (["prompts=jsonl", "prompts.path=/nope.jsonl"], "prompt file /nope.jsonl does not exist"),
        (["prompts=gsm8k", "prompts.path=/nope/gsm8k"], "prompts.path=/nope/gsm8k does not exist"),
        (["drafter=training", "drafter.run_dir=/nope/run"], "drafter.run_dir=/nope/run does not exist"),
    ],
)
def test_a_wrong_path_exits_2_before_torch_transformers_or_mlflow_load(tmp_path, args, message):
    """The cheap checks run before the heavy imports (python -X importtime lists every module imported)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-X", "importtime", str(ROOT / "evaluate.py"), *args, "tracking.enabled=false"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "transformers", "mlflow"}
