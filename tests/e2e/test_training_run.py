"""A training run evaluated step by step (dflash/evaluation/series.py) on the tiny target: `drafter.step=all`,
follow=true
with step folders written while it runs, SIGTERM and a restart, the trainer's metrics under train/, the stall
check, the step syntax, the completeness of a step folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dflash.config.compose import compose
from dflash.config.schema import StepSelection
from dflash.models.drafter.checkpoint import init_config
from dflash.models.drafter.files import incomplete, save_training_checkpoint
from dflash.models.drafter.model import DFlashDrafter
from dflash.models.target.weights import sha256_file
from dflash.runs import trainlog
from dflash.runs.watch import Settle, scan
from dflash.util.errors import CheckpointError, ConfigError

ROOT = Path(__file__).resolve().parents[2]
MASK = 250


def write_step(run: Path, target, step: int, seed: int | None = None) -> Path:
    """A tiny drafter's step as dflash.train writes it (atomic: the file appears whole)."""
    m = DFlashDrafter(init_config(target, 1, 2, MASK, 4)).init_weights(step if seed is None else seed, std=0.02)
    path = run / f"step_{step}" / "checkpoint.pt"
    save_training_checkpoint(path, m, None, step)
    return path


def overrides(tmp: Path, target_dir: Path, run: Path, *extra: str) -> list[str]:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "prompt": " ".join(f"t{40 + i + j}" for j in range(6))}) + "\n" for i in range(2)
        )
    )
    return [
        "target=local",
        f"target.path={target_dir}",
        f"target.mask_token_id={MASK}",
        "drafter=training",
        f"drafter.run_dir={run}",
        "prompts=jsonl",
        f"prompts.path={prompts}",
        "prompts.max_new_tokens=6",
        f"cache_dir={tmp / 'cache'}",
        f"tracking.uri=sqlite:///{tmp}/mlflow.db",
        f"tracking.artifact_location={(tmp / 'mlruns').as_uri()}",
        "progress=false",
        "num_samples=0",
        *extra,
    ]


def family(tmp: Path):
    """-> (training-run parents, their children) in the test's store."""
    from dflash import tracking

    c = tracking.mlflow_client(f"sqlite:///{tmp}/mlflow.db")
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()])
    parents = [r for r in runs if r.data.tags.get(tracking.ROLE_TAG) == tracking.TRAINING_RUN]
    kids = [r for r in runs if tracking.SERIES_TAG in r.data.tags and r.data.tags.get(tracking.ROLE_TAG) is None]
    return parents, kids


def history(tmp: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    from dflash import tracking

    return sorted(
        (m.step, m.value) for m in tracking.mlflow_client(f"sqlite:///{tmp}/mlflow.db").get_metric_history(run_id, key)
    )


# --- pure parts ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, steps",
    [
        (None, [30]),
        (20, [20]),
        ("all", [10, 20, 30]),
        ("all/2", [10, 30]),
        ([30, 10, 99], [10, 30]),
        ("15..30", [20, 30]),
        ("..20", [10, 20]),
        ("20..", [20, 30]),
        ("latest", [30]),
        ("best", [20]),  # the trainer's recorded best (passed by the run folder)
    ],
)
def test_step_selection(value, steps):
    assert StepSelection.parse(value).select([10, 20, 30], best=20) == steps


@pytest.mark.parametrize("value", ["newest", "30..10", "all/0", "5/2", -3, [], ["a"]])
def test_a_bad_step_selection_names_the_syntax(value):
    with pytest.raises(ConfigError, match="drafter.step=.*(not a step selection|past its end)"):
        StepSelection.parse(value)


def test_several_steps_need_a_training_run():
    with pytest.raises(ConfigError, match="needs drafter=training"):
        compose(["drafter=init", "drafter.step=all"])


def test_stall_on_a_made_up_series():
    P = trainlog.Point
    rising = [P(1000, 2.0, 0.05, 0.40), P(2000, 2.6, 0.05, 0.50), P(3000, 2.62, 0.05, 0.60), P(4000, 2.50, 0.05, 0.70)]
    s = trainlog.stall(rising, "acc", 0.01)
    assert s is not None and (s.best_step, s.last_step) == (3000, 4000) and (s.acc_from, s.acc_to) == (0.60, 0.70)
    assert (s.tau_best, s.tau_last) == (2.62, 2.50)
    from dflash.report.training_run import stall_text

    assert "0.600 -> 0.700" in stall_text(s) and "2.620 -> 2.500" in stall_text(s) and "τ fell" in stall_text(s)
    improving = [P(1000, 2.0, 0.05, 0.40), P(2000, 2.6, 0.05, 0.50)]  # τ rose past its best by more than 2 SE: no stall
    assert trainlog.stall(improving, "acc", 0.01) is None
    flat_acc = [P(1000, 2.6, 0.05, 0.50), P(2000, 2.5, 0.05, 0.505)]  # accuracy did not rise enough
    assert trainlog.stall(flat_acc, "acc", 0.01) is None
    assert trainlog.stall(rising[:1], "acc", 0.01) is None  # one step says nothing


def test_choose_and_the_accuracy_name():
    names = ["acc", "acc_1", "loss", "loss_avg", "lr", "grad_norm", "train/ploss_0", "tokens_per_s"]
    assert trainlog.choose(names, None) == ["acc", "acc_1", "loss", "loss_avg", "train/ploss_0"]
    assert trainlog.choose(names, ["^lr$"]) == ["lr"]
    assert trainlog.accuracy_name(names, None) == "acc" and trainlog.accuracy_name(["loss"], None) is None
    with pytest.raises(ConfigError, match="accuracy_key='nope'"):
        trainlog.accuracy_name(names, "nope")


def test_a_step_folder_is_complete_only_when_its_files_are_whole(tmp_path, qwen3_target):
    whole = write_step(tmp_path, qwen3_target, 10)
    assert incomplete(whole.parent) is None
    part = tmp_path / "step_20"
    part.mkdir()
    (part / "checkpoint.pt").write_bytes(
        whole.read_bytes()[: whole.stat().st_size // 2]
    )  # a trainer writing in place, halfway
    assert "not a whole torch (zip) file" in incomplete(part)
    (part / "checkpoint.pt.tmp-host-1-ab").write_bytes(b"x")
    assert "temporary file" in incomplete(part)
    hf = tmp_path / "step_30"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(64)}, str(hf / "model.safetensors"))
    assert incomplete(hf) is None
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[:-16])
    assert "holds" in incomplete(hf)


def test_settle_waits_for_unchanged_files(tmp_path, qwen3_target):
    write_step(tmp_path, qwen3_target, 10)
    settle = Settle(5.0)
    assert settle.ready(scan(tmp_path).steps, now=100.0) == []  # first seen
    assert settle.ready(scan(tmp_path).steps, now=104.0) == []
    assert [f.step for f in settle.ready(scan(tmp_path).steps, now=105.0)] == [10]
    write_step(tmp_path, qwen3_target, 10, seed=7)  # rewritten: the clock starts again
    os.utime(tmp_path / "step_10" / "checkpoint.pt", ns=(1, 1))
    assert settle.ready(scan(tmp_path).steps, now=106.0) == []


# --- whole runs on the tiny target -------------------------------------------------------------------


def test_step_all_is_one_parent_with_curves_at_the_training_steps_and_a_rerun_adds_only_what_is_new(
    tmp_path, qwen3_dir, qwen3_target
):
    """... and a rewind (a step rewritten with other weights, the later ones deleted) supersedes the old timeline's
    evaluations, kept and tagged, and the parent goes on as a new lineage holding the points before it."""
    from dflash import tracking
    from dflash.evaluation import series

    run = tmp_path / "run"
    for s in (10, 20):
        write_step(run, qwen3_target, s)
    rows = [
        {"step": s, "acc": s / 100, "loss": 3 - s / 20, "lr": 1e-4} for s in (5, 10, 15, 20)
    ]  # dflash.train's metrics.jsonl
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose(overrides(tmp_path, qwen3_dir, run, "drafter.step=all"))
    out = series.evaluate_training_run(cfg, "")
    (parent,), kids = family(tmp_path)
    assert sorted(int(k.data.tags["drafter_step"]) for k in kids) == [10, 20] and parent.info.status == "FINISHED"
    for key in (
        "acceptance_length",
        "acceptance_length_macro",
        "acceptance_length/prompts",
        "expected_acceptance_length",
        "accuracy/slot_1",
        "accuracy/slot_3",
    ):
        assert [s for s, _ in history(tmp_path, parent.info.run_id, key)] == [10, 20], key
    tau = {int(k.data.tags["drafter_step"]): k.data.metrics["acceptance_length"] for k in kids}
    assert history(tmp_path, parent.info.run_id, "acceptance_length") == [(10, tau[10]), (20, tau[20])]
    assert history(tmp_path, parent.info.run_id, "train/acc") == [(5, 0.05), (10, 0.1), (15, 0.15), (20, 0.2)]
    assert [s for s, _ in history(tmp_path, parent.info.run_id, "train/loss")] == [5, 10, 15, 20]
    assert not history(tmp_path, parent.info.run_id, "train/lr")  # not accuracy- nor loss-like
    assert out.parent_id == parent.info.run_id and "| 20 |" in parent.data.tags["mlflow.note.content"]

    write_step(run, qwen3_target, 30)  # a new step: only it is evaluated, steps 10 and 20 skipped (same digests)
    out = series.evaluate_training_run(cfg, "")
    assert out.skipped == [10, 20] and [r.info.drafter_step for r in out.results] == [30]
    (parent2,), kids = family(tmp_path)
    assert parent2.info.run_id == parent.info.run_id and parent2.info.status == "FINISHED"
    assert sorted(int(k.data.tags["drafter_step"]) for k in kids) == [10, 20, 30]
    assert history(tmp_path, parent.info.run_id, "train/acc") == [(5, 0.05), (10, 0.1), (15, 0.15), (20, 0.2)]

    write_step(run, qwen3_target, 20, seed=99)  # step 20 rewritten with other weights, 30 gone: a rewind
    (run / "step_30" / "checkpoint.pt").unlink()
    (run / "step_30").rmdir()
    out = series.evaluate_training_run(cfg, "")
    assert out.skipped == [10] and [r.info.drafter_step for r in out.results] == [20] and out.superseded == [20, 30]
    parents, kids = family(tmp_path)
    old, live = sorted(parents, key=lambda p: int(p.data.tags.get(tracking.LINEAGE_TAG, 0)))
    assert old.info.run_id == parent.info.run_id and old.data.tags[tracking.REPLACED_BY_TAG] == live.info.run_id
    assert live.info.status == old.info.status == "FINISHED" and out.parent_id == live.info.run_id
    by_step = sorted((int(k.data.tags["drafter_step"]), k.data.tags.get(tracking.SUPERSEDED_TAG, "")) for k in kids)
    new20 = next(r for r in out.results).run_id
    assert by_step == sorted([(10, ""), (20, ""), (20, new20), (30, new20)])  # the old timeline kept, marked
    tau20 = out.results[0].metrics["acceptance_length"]
    assert history(tmp_path, live.info.run_id, "acceptance_length") == [(10, tau[10]), (20, tau20)]  # 30: superseded
    assert history(tmp_path, live.info.run_id, "train/acc") == [(5, 0.05), (10, 0.1), (15, 0.15), (20, 0.2)]
    assert "Superseded" in live.data.tags["mlflow.note.content"]


def test_follow_evaluates_each_complete_step_once_and_a_partial_one_only_when_done(tmp_path, qwen3_dir, qwen3_target):
    from dflash import tracking
    from dflash.evaluation import series

    run = tmp_path / "run"
    write_step(run, qwen3_target, 10)
    final = {}

    def finished_steps() -> set[int]:
        return {int(k.data.tags["drafter_step"]) for k in family(tmp_path)[1] if k.info.status == "FINISHED"}

    def trainer():
        time.sleep(0.5)
        part = run / "step_20"
        part.mkdir(parents=True)
        whole = write_step(tmp_path / "staging", qwen3_target, 20)
        (part / "checkpoint.pt").write_bytes(
            whole.read_bytes()[: whole.stat().st_size // 3]
        )  # written in place: partial for a while
        write_step(run, qwen3_target, 30)
        while not {10, 30} <= finished_steps():  # the follower saw the partial step 20 beside complete ones
            time.sleep(0.2)
        (part / "checkpoint.pt").write_bytes(whole.read_bytes())
        final[20] = sha256_file(part / "checkpoint.pt")
        time.sleep(0.3)
        write_step(run, qwen3_target, 40)

    writer = threading.Thread(target=trainer)
    writer.start()
    cfg = compose(
        overrides(
            tmp_path, qwen3_dir, run, "follow=true", "watch.poll_s=0.1", "watch.settle_s=0.3", "watch.last_step=40"
        )
    )
    try:
        out = series.evaluate_training_run(cfg, "")
    finally:
        writer.join()
    (parent,), kids = family(tmp_path)
    steps = sorted(int(k.data.tags["drafter_step"]) for k in kids)
    assert steps == [10, 20, 30, 40] and all(k.info.status == "FINISHED" for k in kids)  # each once
    k20 = next(k for k in kids if k.data.tags["drafter_step"] == "20")
    assert k20.data.tags[tracking.CHECKPOINT_SHA_TAG] == final[20]  # read once whole, never the partial file
    assert parent.info.status == "FINISHED" and "watch.last_step=40" in out.ended
    assert [s for s, _ in history(tmp_path, parent.info.run_id, "acceptance_length")] == [10, 20, 30, 40]


def test_follow_starts_before_the_trainer_made_its_run_folder(tmp_path, qwen3_dir, qwen3_target):
    from dflash.evaluation import series
    from dflash.evaluation.preflight import check_inputs

    run = tmp_path / "not_yet"  # follow=true started beside a trainer that has not written anything yet
    cfg = compose(overrides(tmp_path, qwen3_dir, run, "follow=true", "watch.poll_s=0.1", "watch.last_step=10"))
    check_inputs(cfg)  # no "does not exist": the folder comes with the first step
    writer = threading.Thread(target=lambda: (time.sleep(0.5), write_step(run, qwen3_target, 10)))
    writer.start()
    try:
        out = series.evaluate_training_run(cfg, "")
    finally:
        writer.join()
    (parent,), kids = family(tmp_path)
    assert (
        [k.data.tags["drafter_step"] for k in kids] == ["10"]
        and parent.info.status == "FINISHED"
        and "watch.last_step=10" in out.ended
    )
    with pytest.raises(CheckpointError, match="does not exist"):  # without follow the folder must be there
        check_inputs(compose(overrides(tmp_path, qwen3_dir, run.with_name("never"), "drafter.step=all")))


def _cli(tmp: Path, args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "evaluate.py"), *args, f"hydra.run.dir={tmp}/out"]
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # two evaluate.py processes
def test_sigterm_while_following_then_a_restart_evaluates_no_step_twice_and_leaves_nothing_running(
    tmp_path, qwen3_dir, qwen3_target
):
    run = tmp_path / "run"
    for s in (10, 20):
        write_step(run, qwen3_target, s)
    args = overrides(tmp_path, qwen3_dir, run, "follow=true", "watch.poll_s=0.2", "watch.settle_s=0")
    p = _cli(tmp_path, args)
    try:
        deadline = time.monotonic() + 600
        while not any(k.info.status == "FINISHED" for k in family(tmp_path)[1] if (tmp_path / "mlflow.db").exists()):
            assert p.poll() is None, p.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no step evaluated"
            time.sleep(0.3)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode in (0, 143), err[-3000:]  # waiting: a clean end; during a step: that step ended KILLED
    parents, kids = family(tmp_path)
    assert all(r.info.status != "RUNNING" for r in parents + kids)
    write_step(run, qwen3_target, 30)
    p = _cli(tmp_path, [*args, "watch.last_step=30"])
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    parents, kids = family(tmp_path)
    done = sorted(int(k.data.tags["drafter_step"]) for k in kids if k.info.status == "FINISHED")
    assert done == [10, 20, 30]  # none twice
    assert len(parents) == 1 and all(r.info.status != "RUNNING" for r in parents + kids)


# --- the trainer's metrics from each source ----------------------------------------------------------


def _tensorboard(folder: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(folder))
    for s in (5, 10, 15, 20):
        w.add_scalar("train/acc_0", s / 100, s)
        w.add_scalar("train/ploss_0", 3 - s / 20, s)
        w.add_scalar("lr", 1e-4, s)
    w.close()


def _mlflow_run(tmp: Path) -> str:
    from dflash import tracking

    with tracking.Run(
        f"sqlite:///{tmp}/trainer.db", "trainer", "specforge-run", artifact_location=(tmp / "trainer_mlruns").as_uri()
    ) as r:
        for s in (5, 10, 15, 20):
            r.log_metrics({"train/acc_0": s / 100, "train/ploss_0": 3 - s / 20, "lr": 1e-4}, step=s)
    return r.run_id


@pytest.mark.parametrize("source", ["tensorboard", "mlflow_id", "mlflow_name"])
def test_train_metrics_from_tensorboard_and_mlflow_land_under_train_at_their_steps(
    tmp_path, qwen3_dir, qwen3_target, source
):
    from dflash.evaluation import series

    run = tmp_path / "run"
    for s in (10, 20):
        write_step(run, qwen3_target, s)
    if source == "tensorboard":
        _tensorboard(tmp_path / "tb" / "logs")
        extra = ["train_metrics.source=tensorboard", f"train_metrics.path={tmp_path / 'tb'}"]
        # one folder of event files: its tags as they are (several subfolders: <subfolder>/<tag>)
    else:
        rid = _mlflow_run(tmp_path)
        extra = [
            "train_metrics.source=mlflow",
            f"train_metrics.uri=sqlite:///{tmp_path}/trainer.db",
            f"train_metrics.run={rid if source == 'mlflow_id' else 'specforge-run'}",
        ]
    out = series.evaluate_training_run(compose(overrides(tmp_path, qwen3_dir, run, "drafter.step=all", *extra)), "")
    (parent,), _ = family(tmp_path)
    acc = history(tmp_path, parent.info.run_id, "train/acc_0")  # the trainer's train/ names kept, not train/train/
    assert [s for s, _ in acc] == [5, 10, 15, 20] and [v for _, v in acc] == pytest.approx(
        [0.05, 0.1, 0.15, 0.2]
    )  # TensorBoard: float32
    assert [s for s, _ in history(tmp_path, parent.info.run_id, "train/ploss_0")] == [5, 10, 15, 20]
    assert not history(tmp_path, parent.info.run_id, "train/lr")
    assert out.stall is not None and out.stall.accuracy == "train/acc_0"  # random drafters: τ flat, accuracy rising
