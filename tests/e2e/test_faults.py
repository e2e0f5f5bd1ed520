"""Faults an operator meets, as real `evaluate.py` processes on the tiny random target (tests/conftest.py):
signals mid-generation, a hard kill, a sweep with a failing job, a re-used sweep folder, and user errors.

Every fault must end with the right exit code (2 user error, 130 SIGINT, 143 SIGTERM, 1 a sweep with a
failed job), no traceback for a user error, and no MLflow run left RUNNING. "Mid-generation" is made
deterministic with a reference server (standard library, in the test) that takes the request and never
answers: the signal is sent once the evaluator is waiting on it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # ~3 minutes of evaluate.py processes on 2 cores


def _args(target: Path, tmp: Path) -> list[str]:
    return [
        "target=local",
        "drafter=init",
        f"target.path={target}",
        "target.mask_token_id=3",
        "target.template.use_chat_template=false",
        "prompts.num_prompts=2",
        "prompts.max_new_tokens=8",
        f"hydra.run.dir={tmp}/out",
        f"hydra.sweep.dir={tmp}/multi",
    ]


def start(tmp: Path, target: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {
        **os.environ,
        "DFLASH_CACHE_DIR": str(tmp / "cache"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db",
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    flags = [a for a in args if a == "-m"]  # Hydra's flags before the overrides
    cmd = [sys.executable, str(ROOT / "evaluate.py"), *flags, *_args(target, tmp), *[a for a in args if a != "-m"]]
    # SIGINT at its default (a shell running the tests in the background would leave it ignored)
    return subprocess.Popen(
        cmd,
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def evaluate(tmp: Path, target: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    p = start(tmp, target, *args, env=env)
    out, err = p.communicate(timeout=600)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def runs(tmp: Path):
    from mlflow.tracking import MlflowClient

    if not (tmp / "mlflow.db").exists():
        return []
    c = MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    exps = [e.experiment_id for e in c.search_experiments()]
    return c.search_runs(exps, order_by=["attributes.start_time ASC"]) if exps else []


def family(tmp: Path):
    everything = runs(tmp)
    parents = [r for r in everything if r.data.tags.get("dflash.role") == "sweep"]
    return parents, {
        p.info.run_id: [r for r in everything if r.data.tags.get("mlflow.parentRunId") == p.info.run_id]
        for p in parents
    }


class _Hang(BaseHTTPRequestHandler):
    """An SGLang server that says what it serves and never answers a generation (until the test ends)."""

    def do_GET(self):
        body = json.dumps({"model_path": "tiny-random-qwen3", "is_generation": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.server.hit.set()  # type: ignore[attr-defined]
        self.server.release.wait(600)  # type: ignore[attr-defined]

    def log_message(self, *args):
        pass


@pytest.fixture
def hanging_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Hang)
    srv.hit, srv.release = threading.Event(), threading.Event()  # type: ignore[attr-defined]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.release.set()  # type: ignore[attr-defined]
    srv.shutdown()
    srv.server_close()


def stuck_in_generation(tmp: Path, target: Path, srv, *args: str) -> subprocess.Popen:
    """An evaluation waiting on the reference server: mid-generation, its run RUNNING."""
    p = start(
        tmp,
        target,
        "references=sglang",
        f"references.url=http://127.0.0.1:{srv.server_port}",
        "references.use_cache=false",
        *args,
    )
    if not srv.hit.wait(180):
        p.kill()
        pytest.fail(f"the evaluator never asked the server: {p.communicate()[1][-3000:]}")
    assert p.poll() is None
    return p


@pytest.mark.parametrize("sig, code, name", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "SIGINT")])
def test_signal_mid_generation_ends_the_run_killed(tmp_path, qwen3_dir, hanging_server, sig, code, name):
    p = stuck_in_generation(tmp_path, qwen3_dir, hanging_server)
    assert [r.info.status for r in runs(tmp_path)] == ["RUNNING"]
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == code, err[-3000:]
    assert "Traceback" not in err and f"interrupted ({name})" in err, err[-3000:]
    (run,) = runs(tmp_path)
    assert run.info.status == "KILLED" and name in run.data.tags["dflash.killed"]


def test_signal_in_a_sweep_ends_the_child_and_the_parent_killed(tmp_path, qwen3_dir, hanging_server):
    p = stuck_in_generation(tmp_path, qwen3_dir, hanging_server, "-m", "drafter.seed=0,1")
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143 and "Traceback" not in err, err[-3000:]
    (parent,), kids = family(tmp_path)
    assert parent.info.status == "KILLED" and [k.info.status for k in kids[parent.info.run_id]] == [
        "KILLED"
    ]  # job 1 never started
    assert all(r.info.status != "RUNNING" for r in runs(tmp_path))


def test_a_hard_kill_is_found_at_the_next_start(tmp_path, qwen3_dir, hanging_server):
    p = stuck_in_generation(tmp_path, qwen3_dir, hanging_server)
    p.kill()  # SIGKILL: nothing in the process runs
    p.communicate(timeout=60)
    (stale,) = runs(tmp_path)
    assert stale.info.status == "RUNNING" and stale.data.tags["dflash.pid"] == str(p.pid)
    r = evaluate(tmp_path, qwen3_dir)  # a normal run, same store and host
    assert r.returncode == 0, r.stderr[-3000:]
    old, new = runs(tmp_path)
    assert old.info.run_id == stale.info.run_id and old.info.status == "KILLED" and new.info.status == "FINISHED"
    assert f"process {p.pid} on " in old.data.tags["dflash.killed"] and "is gone" in old.data.tags["dflash.killed"]


@pytest.mark.parametrize(
    "launcher", [[], ["hydra/launcher=joblib", "hydra.launcher.n_jobs=3"]], ids=["basic", "joblib"]
)
def test_a_failing_job_does_not_stop_the_sweep(tmp_path, qwen3_dir, launcher):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(
        json.dumps({"id": "a", "prompt": "t7 t8 t9"})
        + "\n"
        + json.dumps({"id": "b", "subset": "other", "prompt": "t10 t11"})
        + "\n"
    )
    bad.write_text('{"prompt": oops}\n')
    r = evaluate(tmp_path, qwen3_dir, "-m", "prompts=jsonl", f"prompts.path={good},{bad},{good}", *launcher)
    assert r.returncode == 1, r.stderr[-3000:]
    assert f"job 1 (prompts.path={bad}): PromptError" in r.stderr
    (parent,), kids = family(tmp_path)
    children = sorted(kids[parent.info.run_id], key=lambda k: int(k.data.tags["dflash.job"]))
    assert [k.info.status for k in children] == ["FINISHED", "FAILED", "FINISHED"]  # job 2 ran after job 1 failed
    assert children[1].data.tags["error"].startswith("PromptError") and parent.info.status == "FAILED"
    assert parent.data.tags["dflash.failed_jobs"].startswith(f"job 1 (prompts.path={bad})")
    assert parent.info.run_name == f"sweep prompts.path={good},{bad},{good}"
    assert (
        parent.data.metrics["acceptance_length"] == children[0].data.metrics["acceptance_length"]
    )  # the best child's τ
    from mlflow.tracking import MlflowClient

    arts = {a.path for a in MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").list_artifacts(parent.info.run_id, "sweep")}
    assert {"sweep/children.csv", "sweep/tau.png", "sweep/per_position.png"} <= arts
    assert "Failed jobs (1)" in parent.data.tags["mlflow.note.content"]


def test_a_reused_sweep_folder_starts_a_new_parent(tmp_path, qwen3_dir):
    for _ in range(2):
        r = evaluate(tmp_path, qwen3_dir, "-m", "drafter.seed=0,1")
        assert r.returncode == 0, r.stderr[-3000:]
    parents, kids = family(tmp_path)
    assert len(parents) == 2 and len({p.data.tags["dflash.sweep_id"] for p in parents}) == 2
    assert all(p.info.status == "FINISHED" and len(kids[p.info.run_id]) == 2 for p in parents)


def _hf_drafter_with(tmp: Path, target: Path, key: str, value) -> Path:
    from dflash.models.drafter.checkpoint import init_config
    from dflash.models.drafter.files import save_hf_folder
    from dflash.models.drafter.model import DFlashDrafter
    from dflash.models.target.model import load_target

    t = load_target("hf", str(target), dtype="float32", device="cpu", attn="sdpa")
    folder = tmp / "drafter"
    save_hf_folder(DFlashDrafter(init_config(t, 1, 2, 250, 4)).init_weights(0), folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, key: value}))
    return folder


USER_ERRORS = {
    "unknown key": (
        ["prompts.num_prompt=3"],
        "prompts.num_prompt is not a config key (did you mean prompts.num_prompts?)",
    ),
    "unknown key added with +": (
        ["+prompts.num_prompt=3"],
        "prompts.num_prompt is not a config key (did you mean prompts.num_prompts?)",
    ),
    "unknown key in a sweep": (["-m", "prompts.num_prompt=3,4"], "prompts.num_prompt is not a config key"),
    "unknown group": (["nosuch=x"], "nosuch is not a config key"),
    "unknown group option": (["attention=flash"], "Could not find 'attention/flash'"),
    "wrong value type": (["prompts.max_new_tokens=abc"], "could not be converted to Integer"),
    "unknown device": (["device.name=tpu"], "device.name='tpu' is not a device"),
    "unwritable store": (
        ["tracking.uri=sqlite:////proc/dflash-nope/mlflow.db"],
        "cannot write beside the MLflow store",
    ),
    "unwritable artifact folder": (
        ["tracking.artifact_location=file:///proc/dflash-nope"],
        "cannot write MLflow artifacts to /proc/dflash-nope",
    ),
    "max_new_tokens 0": (["prompts.max_new_tokens=0"], "prompts.max_new_tokens=0: use 2 or more"),
    "max_new_tokens negative": (["prompts.max_new_tokens=-5"], "prompts.max_new_tokens=-5: use 2 or more"),
    "max_new_tokens 1": (["prompts.max_new_tokens=1"], "prompts.max_new_tokens=1: use 2 or more"),
    "config.json value of the wrong type": (
        ["drafter=hf", "drafter.path={drafter}"],
        "config field block_size='4' should be an integer; fix config.json",
    ),
}


@pytest.mark.parametrize("case", list(USER_ERRORS))
def test_user_errors_exit_2_without_a_traceback(tmp_path, qwen3_dir, case):
    args, message = USER_ERRORS[case]
    if "{drafter}" in " ".join(args):
        args = [a.format(drafter=_hf_drafter_with(tmp_path, qwen3_dir, "block_size", "4")) for a in args]
    r = evaluate(tmp_path, qwen3_dir, *args)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert all(x.info.status != "RUNNING" for x in runs(tmp_path))


def test_verbose_shows_the_traceback_of_a_user_error(tmp_path, qwen3_dir):
    r = evaluate(tmp_path, qwen3_dir, "prompts.num_prompt=3", env={"DFLASH_VERBOSE": "1"})
    assert (
        r.returncode == 2
        and "Traceback" in r.stderr
        and "ConfigError: prompts.num_prompt is not a config key" in r.stderr
    )
