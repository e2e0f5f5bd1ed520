"""The package as a user installs it: the wheel built from this clone (`pip wheel --no-deps`), installed `--no-deps`
into a fresh venv that sees the dependencies already installed beside this interpreter, runs every console command
from a directory outside the clone, and a tiny evaluation lands in that directory's mlflow.db.

The new venv reaches the dependencies through a `.pth` line naming this interpreter's site-packages as a plain path:
the `.pth` files there (among them the clone's editable install) are not run, so `dflash` can only come from the
wheel, which the test checks (`dflash.__file__` inside the new venv)."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # builds and installs a wheel, then starts seven processes: about a minute


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("install")
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", ROOT], check=True)
    (wheel,) = (tmp / "dist").glob("dflash_eval-*.whl")
    base = getattr(sys, "_base_executable", sys.executable)  # the interpreter this venv was made from
    subprocess.run([base, "-m", "venv", "--without-pip", tmp / "venv"], check=True)
    py = tmp / "venv" / "bin" / "python"
    purelib = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True,
        capture_output=True,
        check=True,
    ).stdout.strip()
    # installed before the dependencies are visible: pip would otherwise see the clone's editable install as the same
    # distribution and either skip the wheel or uninstall that install
    subprocess.run(
        [*pip, "--python", py, "install", "-q", "--no-deps", "--no-index", wheel], env=clean_env(), check=True
    )
    (Path(purelib) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return tmp / "venv"


def clean_env() -> dict[str, str]:
    """The environment without what points at the clone or its stores (PYTHONPATH would import the clone's dflash)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI", "DFLASH_CACHE_DIR")}


def run(venv: Path, cwd: Path, *cmd: str) -> subprocess.CompletedProcess:
    env = clean_env()
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_dflash_is_imported_from_the_wheel_not_from_the_clone(venv, tmp_path):
    r = run(venv, tmp_path, str(venv / "bin" / "python"), "-c", "import dflash; print(dflash.__file__)")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).is_relative_to(venv) and not Path(r.stdout.strip()).is_relative_to(ROOT / "dflash")


@pytest.mark.parametrize(
    "cmd, expect",
    [
        (["dflash-eval", "--cfg", "job"], "drafter:"),
        (["python", "-m", "dflash", "--cfg", "job"], "drafter:"),
        (["dflash-train", "--cfg", "job"], "optim:"),
        (["dflash-compare", "--help"], "usage"),
        (["dflash-bench", "--help"], "usage"),
    ],
)
def test_every_console_command_runs_from_outside_the_clone(venv, tmp_path, cmd, expect):
    r = run(venv, tmp_path, *cmd)
    assert r.returncode == 0 and expect in r.stdout, (r.stdout[-2000:], r.stderr[-2000:])


def test_a_tiny_evaluation_lands_in_the_working_directory(venv, tmp_path, qwen3_dir):
    work = tmp_path / "work"
    work.mkdir()
    r = run(
        venv,
        work,
        "dflash-eval",
        "target=local",
        f"target.path={qwen3_dir}",
        "target.mask_token_id=3",
        "target.template.use_chat_template=false",
        "drafter=init",
        "prompts.num_prompts=2",
        "prompts.max_new_tokens=8",
        f"cache_dir={work / 'cache'}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "acceptance length τ" in r.stdout and "MLflow: run" in r.stdout
    assert (work / "mlflow.db").is_file() and list((work / "outputs").glob("*/*/evaluate.log"))
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{work}/mlflow.db")
    (run_,) = c.search_runs([e.experiment_id for e in c.search_experiments()])
    assert run_.info.status == "FINISHED" and run_.data.metrics["acceptance_length"] >= 1.0
