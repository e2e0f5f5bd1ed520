"""SpecForge's training runs evaluated as SpecForge writes them (docs/specforge-runs.md) on the tiny target.

The writers below write what SpecForge's trainers write, with their key names, file order, temporary files and links:
- `unified_save` / `unified_best`: `specforge train`'s `<run_id>-step<N>/` (rank files, then training_state.pt, each
  through `<name>.tmp` + rename; a save first deletes every step >= N: the rewind; `max_checkpoints` rotation;
  `-latest` / `-best` relative symlinks; `<run_id>.best_meta.json`);
- `legacy_step`: `scripts/train_dflash.py`'s `epoch_<e>_step_<s>/` (training_state.pt with an argparse Namespace,
  config.json, model.safetensors through a safetensors-0.8 `.tmpXXXXXX` file, dflash.py);
- `tensorboard_runs` and `mlflow_runs`: the trackers' `<output_dir>/runs` event files and MLflow runs named after
  the run.
Each evaluated step's τ is checked against the same weights read from an HF-format folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_training_run import family, history, overrides

from dflash.config.compose import compose
from dflash.models.drafter import layouts
from dflash.models.drafter.checkpoint import init_config
from dflash.models.drafter.model import DFlashDrafter
from dflash.runs import trainlog
from dflash.util.errors import CheckpointError, exit_code

MASK = 250
RUN_ID = "specforge-run"  # SpecForge's default run_id: also the default MLflow run name, shared by unrelated runs
OLD = time.time() - 3600  # legacy steps written an hour ago: settled


def tiny(target, seed: int, block: int = 4) -> tuple[dict[str, torch.Tensor], dict]:
    """A 1-layer drafter's weights as SpecForge keeps them (bf16, public names) and the launch JSON describing it, in
    the form of SpecForge's configs/*-dflash.json (legacy rope keys, block_size at the top level, auto_map)."""
    cfg = init_config(target, 1, 2, MASK, block)
    sd = {k: v.to(torch.bfloat16) for k, v in DFlashDrafter(cfg).init_weights(seed, std=0.02).state_dict().items()}
    raw = cfg.to_hf()
    raw.pop("rope_parameters")
    raw.update(rope_theta=10000.0, rope_scaling=None, auto_map={"AutoModel": "dflash.DFlashDraftModel"})
    raw.update(tie_word_embeddings=False, vocab_size=256, initializer_range=0.02, attention_dropout=0.0, use_cache=True)
    return sd, raw


def contract(raw: dict) -> dict:
    """The payload's DFlash contract as SpecForge's provider records it (taps as a tuple)."""
    dc = raw["dflash_config"]
    return {
        "dflash_draft_num_hidden_layers": raw["num_hidden_layers"],
        "dflash_target_layer_ids": tuple(dc["target_layer_ids"]),
        "dflash_block_size": raw["block_size"],
        "dflash_mask_token_id": dc["mask_token_id"],
        "dflash_attention_backend": "flex_attention",
        "dflash_num_anchors": 512,
        "dflash_loss_decay_gamma": None,
        "dflash_loss_type": "ce",
        "dflash_dpace_alpha": 0.0,
    }


def _atomic(obj, path: Path) -> None:
    torch.save(obj, str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)


def _relink(out: Path, name: str, step_dir: str) -> None:
    link = out / name
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(step_dir, link)  # relative, as SpecForge's _point


def unified_save(
    out: Path,
    n: int,
    sd: dict,
    terms: dict,
    launch: Path | None = None,
    world: int = 2,
    max_checkpoints: int = 0,
    mid_write: bool = False,
) -> Path:
    """One `specforge train` save of step n: rewind (delete steps >= n, forget a best >= n), rank files, the shared
    payload, -latest, rotation."""
    out.mkdir(parents=True, exist_ok=True)
    for d in out.glob(f"{RUN_ID}-step*"):
        if not d.is_symlink() and int(d.name.rsplit("step", 1)[1]) >= n:
            shutil.rmtree(d)
    meta = out / f"{RUN_ID}.best_meta.json"
    if meta.exists() and json.loads(meta.read_text())["step"] >= n:
        meta.unlink()
        (out / f"{RUN_ID}-best").unlink(missing_ok=True)
    d = out / f"{RUN_ID}-step{n}"
    d.mkdir()
    for r in range(world):
        rng = {"torch": torch.get_rng_state(), "device_type": "cuda", "cuda": None, "npu": None}
        opt = {"optimizer_state_dict": {"state": {}, "param_groups": [{"lr": 1e-4, "params": [0]}]}, "max_grad_norm": 1}
        _atomic({"optimizer": opt, "rng": rng}, d / f"training_state_rank{r}.pt")
    prov = [("source_identity_format", "stat-v2"), ("target_model", "tiny"), ("capture_layers", (1, 3))]
    if launch is not None:
        digest = ("sha256", "", launch.stat().st_size, __import__("hashlib").sha256(launch.read_bytes()).hexdigest())
        prov.append(("draft_config", ("file-stat-v2", str(launch), digest)))
    payload = {
        "draft_state_dict": sd,
        "global_step": n,
        "epoch": 0,
        "epoch_batch": n,
        "epoch_samples": 4 * n,
        "strategy": "dflash",
        "run_id": RUN_ID,
        "world_size": world,
        "dataset_size": 4000,
        "batch_size": 4,
        "accumulation_steps": 1,
        "num_epochs": 1,
        "effective_total_steps": 1000,
        "tp_size": 1,
        "sp_ulysses_size": 1,
        "sp_ring_size": 1,
        **terms,
        "specforge_step_options": (),
        "specforge_model_provenance": tuple(prov),
    }
    if mid_write:  # the shared payload half written: training_state.pt.tmp, not renamed yet
        torch.save(payload, d / "whole.pt")
        data = (d / "whole.pt").read_bytes()
        (d / "whole.pt").unlink()
        (d / "training_state.pt.tmp").write_bytes(data[: len(data) // 2])
        return d
    _atomic(payload, d / "training_state.pt")
    _relink(out, f"{RUN_ID}-latest", d.name)
    if max_checkpoints:
        best = json.loads(meta.read_text())["step"] if meta.exists() else None
        done = sorted(int(p.name.rsplit("step", 1)[1]) for p in out.glob(f"{RUN_ID}-step*") if not p.is_symlink())
        for m in done[:-max_checkpoints]:
            if m not in (best, n):
                shutil.rmtree(out / f"{RUN_ID}-step{m}")
    return d


def unified_best(out: Path, n: int, acc: float) -> None:
    """SpecForge's update_best: the -best link first, then best_meta.json through .tmp + rename."""
    _relink(out, f"{RUN_ID}-best", f"{RUN_ID}-step{n}")
    metrics = {"eval/avg_loss": 2.0 - acc, "eval/avg_acc": acc, "eval/simulated_acc_len": acc}
    meta = {"run_id": RUN_ID, "step": n, "score": acc, "metric": "eval/simulated_acc_len", "metrics": metrics}
    tmp = out / f"{RUN_ID}.best_meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, out / f"{RUN_ID}.best_meta.json")


def legacy_step(out: Path, e: int, s: int, sd: dict, raw: dict, mid_write: bool = False, age: float | None = OLD):
    """scripts/train_dflash.py's save_checkpoint: training_state.pt, config.json, the safetensors (safetensors 0.8: a
    .tmpXXXXXX file in the folder, 0600, full size, then renamed), dflash.py; in place, rank 0."""
    d = out / f"epoch_{e}_step_{s}"
    d.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(output_dir=str(out), accumulation_steps=2, save_interval=2)
    fp32 = [v.float() for v in sd.values()]
    torch.save(
        {
            "epoch": e,
            "global_step": s,
            "args": args,
            "optimizer_state_dict": {},
            "scheduler_state_dict": {},
            "fp32_params": fp32,
        },
        d / "training_state.pt",
    )
    cfg = {**raw, "dtype": "bfloat16", "transformers_version": "4.57.1"}
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(sd, str(d / ".tmpAb12Cd"), metadata={"format": "pt"})
    os.chmod(d / ".tmpAb12Cd", 0o600)
    if mid_write:
        return d
    os.replace(d / ".tmpAb12Cd", d / "model.safetensors")
    (d / "dflash.py").write_text("from .dspark_heads import DSparkHeads  # never imported\n")
    if age is not None:
        for f in d.iterdir():
            os.utime(f, (age, age))
    return d


def hf_folder(folder: Path, sd: dict, raw: dict) -> Path:
    """The same weights as an HF-format folder (what `specforge export --to hf` writes)."""
    folder.mkdir(parents=True)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def tau_of_hf(tmp: Path, qwen3_dir: Path, folder: Path) -> float:
    import dflash

    extra = [o for o in overrides(tmp, qwen3_dir, folder) if not o.startswith(("drafter", "tracking"))]
    res = dflash.evaluate(folder, overrides=[o for o in extra if not o.startswith("progress")])
    return res.metrics["acceptance_length"]


def tensorboard_runs(out: Path, name: str, parts: list[list[int]]) -> None:
    """<output_dir>/runs: one event file per trainer process (a restart: a new file), `name` logged at each step."""
    from torch.utils.tensorboard import SummaryWriter

    for i, steps in enumerate(parts):
        w = SummaryWriter(str(out / "runs"), filename_suffix=f".p{i}")
        for s in steps:
            w.add_scalar(name, 0.1 * i + s / 1000, s)
            w.add_scalar("train/loss", 3 - s / 1000, s)
            w.add_scalar("train/lr", 1e-4, s)
        w.close()
        f = next(p for p in (out / "runs").iterdir() if p.name.endswith(f".p{i}"))  # the name's time: process start
        t = int(f.name.split(".")[3])
        f.rename(f.with_name(f.name.replace(f".{t}.", f".{t + 10 * i}.", 1)))


# --- the layouts, read -------------------------------------------------------------------------------


def test_legacy_steps_complete_only_when_the_weights_are_renamed_and_the_index_whole(tmp_path, qwen3_target):
    sd, raw = tiny(qwen3_target, 1)
    d = legacy_step(tmp_path, 0, 6, sd, raw, mid_write=True)
    assert ".tmpAb12Cd" in layouts.legacy_incomplete(d)  # safetensors 0.8's temporary name
    os.replace(d / ".tmpAb12Cd", d / "model.safetensors")
    assert layouts.legacy_incomplete(d) is None  # training_state.pt (a pickle) beside it is not the drafter
    sharded = tmp_path / "epoch_0_step_8"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(raw))
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[:5]}, str(sharded / "model-00001-of-00002.safetensors"))
    assert "index" in layouts.legacy_incomplete(sharded)  # shard 2 and the index are still to come
    index = {
        "metadata": {},
        "weight_map": {k: f"model-0000{1 + (i >= 5)}-of-00002.safetensors" for i, k in enumerate(keys)},
    }
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "model-00002-of-00002.safetensors" in layouts.legacy_incomplete(sharded)
    save_file({k: sd[k] for k in keys[5:]}, str(sharded / "model-00002-of-00002.safetensors"))
    assert layouts.legacy_incomplete(sharded) is None


def test_unified_steps_links_best_and_the_refusals(tmp_path, qwen3_target):
    sd, raw = tiny(qwen3_target, 1)
    terms = contract(raw)
    for n in (100, 200):
        unified_save(tmp_path, n, sd, terms)
    unified_best(tmp_path, 100, 0.4)
    unified_save(tmp_path, 300, sd, terms, mid_write=True)
    (tmp_path / f"{RUN_ID}-step200" / "training_state_rank1.pt.tmp").write_bytes(b"x")  # a rank file: not the drafter
    run = layouts.scan(tmp_path)
    assert run.layout == layouts.UNIFIED and [f.step for f in run.steps] == [100, 200, 300]  # links are not steps
    assert [f.why_not is None for f in run.steps] == [True, True, False] and "is not in place" in run.steps[2].why_not
    assert run.links == {"latest": 200, "best": 100} and run.best.step == 100 and run.best.score == 0.4
    assert layouts.find_step(tmp_path, None)[1].step == 200 and layouts.find_step(tmp_path, "best")[1].step == 100
    assert layouts.find_step(tmp_path / f"{RUN_ID}-best", None)[1].step == 100  # a link names its run (and step)
    assert layouts.scan(tmp_path / f"{RUN_ID}-latest").root == tmp_path
    other = tmp_path / "other-step5"
    other.mkdir()
    with pytest.raises(CheckpointError, match=r"several SpecForge runs \(other, specforge-run\).*-latest"):
        layouts.scan(tmp_path)
    assert layouts.scan(tmp_path / f"{RUN_ID}-latest").run_id == RUN_ID
    (tmp_path / "step_7").mkdir()
    with pytest.raises(CheckpointError, match="several layouts"):
        layouts.scan(tmp_path / f"{RUN_ID}-latest")


def test_pick_runs_keeps_the_runs_alive_at_this_folders_saves():
    S = trainlog.RunSpan
    saves = [1000.0, 2000.0, 3000.0]
    runs = [
        S("a", RUN_ID, 500_000, 2_100_000),  # wrote the first two steps
        S("b", RUN_ID, 2_500_000, 3_200_000),  # a restart: wrote the third
        S("old", RUN_ID, 10_000, 90_000),  # another run of the default name, long before
        S("live", RUN_ID, 3_500_000, None),  # a restart running that has not saved yet
    ]
    assert [r.run_id for r in trainlog.pick_runs(runs, saves)] == ["a", "b", "live"]
    legacy = [S("x", "r1", 0, 1, "/data/out/run7"), S("y", "r2", 0, 1, "./run7"), S("z", "r3", 0, 1, "/o/run8")]
    assert [r.run_id for r in trainlog.pick_runs(legacy, saves, Path("/data/out/run7"))] == ["x", "y"]


# --- whole runs on the tiny target -------------------------------------------------------------------


def test_unified_run_step_all_then_a_rewind(tmp_path, qwen3_dir, qwen3_target):
    """`<run_id>-step<N>/training_state.pt` with the launch JSON: each complete step once (links and the mid-write
    step not), τ equal to the same weights in an HF folder, SpecForge's best beside τ, its TensorBoard metrics under
    train/ (not train/train/); a rewind supersedes steps 200 and 300."""
    from dflash import tracking
    from dflash.evaluation import series

    run = tmp_path / "out"
    weights = {n: tiny(qwen3_target, seed) for n, seed in ((100, 1), (200, 2), (300, 3))}
    launch = tmp_path / "qwen3-tiny-dflash.json"
    launch.write_text(json.dumps(weights[100][1], indent=2))
    for n, (sd, raw) in weights.items():
        unified_save(run, n, sd, contract(raw), launch)
    unified_best(run, 200, 0.55)
    unified_save(run, 400, weights[100][0], contract(weights[100][1]), launch, mid_write=True)
    tensorboard_runs(run, "train/acc", [[50, 100, 150, 200, 250, 300]])
    cfg = compose(overrides(tmp_path, qwen3_dir, run, "drafter.step=all", f"drafter.config={launch}"))
    out = series.evaluate_training_run(cfg, "")
    (parent,), kids = family(tmp_path)
    steps = sorted(int(k.data.tags["drafter_step"]) for k in kids)
    assert steps == [100, 200, 300] and all(k.info.status == "FINISHED" for k in kids)
    for k in kids:
        n = int(k.data.tags["drafter_step"])
        assert (
            k.data.tags["checkpoint.layout"] == "specforge" and k.data.tags["checkpoint.step_unit"] == "optimizer_step"
        )
        assert k.data.tags["checkpoint_path"].endswith(f"{RUN_ID}-step{n}/training_state.pt")
        hf = hf_folder(tmp_path / f"hf{n}", *weights[n])
        assert k.data.metrics["acceptance_length"] == tau_of_hf(tmp_path, qwen3_dir, hf), n
    assert [s for s, _ in history(tmp_path, parent.info.run_id, "train/acc")] == [50, 100, 150, 200, 250, 300]
    assert not history(tmp_path, parent.info.run_id, "train/train/acc")
    assert parent.data.tags[tracking.TRAINER_BEST_TAG] == "200"
    note = parent.data.tags["mlflow.note.content"]
    assert "the trainer's best: step 200 by eval/simulated_acc_len" in note and "| 200 (trainer's best) |" in note
    art = tracking.mlflow_client(f"sqlite:///{tmp_path}/mlflow.db").list_artifacts(parent.info.run_id, "training_run")
    assert [a.path for a in art] == [tracking.TRAINING_CHART]
    assert out.parent_id == parent.info.run_id

    unified_save(run, 200, tiny(qwen3_target, 9)[0], contract(weights[100][1]), launch)  # restarted from step 100
    out = series.evaluate_training_run(cfg, "")
    assert [r.info.drafter_step for r in out.results] == [200] and out.superseded == [200, 300] and out.skipped == [100]
    parents, kids = family(tmp_path)
    live = next(p for p in parents if tracking.REPLACED_BY_TAG not in p.data.tags)
    assert [s for s, _ in history(tmp_path, live.info.run_id, "acceptance_length")] == [100, 200]
    assert sorted((int(k.data.tags["drafter_step"]), tracking.SUPERSEDED_TAG in k.data.tags) for k in kids) == [
        (100, False),
        (200, False),
        (200, True),
        (300, True),
    ]
    assert tracking.TRAINER_BEST_TAG not in live.data.tags  # the rewind dropped SpecForge's best


def test_unified_follow_evaluates_each_complete_step_once_through_rotation(tmp_path, qwen3_dir, qwen3_target):
    """follow=true beside a SpecForge trainer keeping 2 checkpoints: each step once when its payload is renamed into
    place, a step rotation deletes stays in the series, never an error."""
    from dflash.evaluation import series

    run = tmp_path / "out"
    weights = {n: tiny(qwen3_target, n) for n in (10, 20, 30, 40)}
    launch = tmp_path / "launch.json"
    launch.write_text(json.dumps(weights[10][1]))
    terms = contract(weights[10][1])
    unified_save(run, 10, weights[10][0], terms, launch, max_checkpoints=2)

    def finished() -> set[int]:
        return {int(k.data.tags["drafter_step"]) for k in family(tmp_path)[1] if k.info.status == "FINISHED"}

    def trainer():
        time.sleep(0.5)
        unified_save(run, 20, weights[20][0], terms, launch, max_checkpoints=2, mid_write=True)
        while 10 not in finished():  # the follower saw the half-written step 20 beside a complete one
            time.sleep(0.2)
        time.sleep(0.5)
        unified_save(run, 20, weights[20][0], terms, launch, max_checkpoints=2)
        while 20 not in finished():
            time.sleep(0.2)
        unified_save(run, 30, weights[30][0], terms, launch, max_checkpoints=2)  # rotation deletes step 10
        while 30 not in finished():
            time.sleep(0.2)
        unified_save(run, 40, weights[40][0], terms, launch, max_checkpoints=2)

    writer = threading.Thread(target=trainer)
    writer.start()
    cfg = compose(
        overrides(
            tmp_path,
            qwen3_dir,
            run,
            "follow=true",
            "watch.poll_s=0.1",
            "watch.settle_s=0",
            "watch.last_step=40",
            f"drafter.config={launch}",
        )
    )
    try:
        out = series.evaluate_training_run(cfg, "")
    finally:
        writer.join()
    (parent,), kids = family(tmp_path)
    assert sorted(int(k.data.tags["drafter_step"]) for k in kids) == [10, 20, 30, 40]  # each once
    assert all(k.info.status == "FINISHED" for k in kids) and parent.info.status == "FINISHED"
    assert [s for s, _ in history(tmp_path, parent.info.run_id, "acceptance_length")] == [10, 20, 30, 40]
    assert "| 10 |" in parent.data.tags["mlflow.note.content"] and not out.failed  # rotated away, still measured


def test_legacy_run_step_all_and_follow(tmp_path, qwen3_dir, qwen3_target):
    """epoch_<e>_step_<s>/: micro-batch steps, the final save repeating step 4 evaluated once, a step whose weights
    are still a .tmpXXXXXX file not evaluated; then follow=true while the trainer writes in place."""
    from dflash.evaluation import series

    run = tmp_path / "out"
    weights = {s: tiny(qwen3_target, s) for s in (2, 4, 6, 8)}
    legacy_step(run, 0, 2, *weights[2])
    legacy_step(run, 0, 4, *weights[4])
    legacy_step(run, 1, 4, *weights[4])  # the final save after the loop: the last step again, next epoch
    legacy_step(run, 1, 6, *weights[6], mid_write=True)
    tensorboard_runs(run, "train/accuracy", [[1, 2, 3, 4]])
    cfg = compose(overrides(tmp_path, qwen3_dir, run, "drafter.step=all"))
    series.evaluate_training_run(cfg, "")
    (parent,), kids = family(tmp_path)
    assert sorted(int(k.data.tags["drafter_step"]) for k in kids) == [2, 4]
    for k in kids:
        s = int(k.data.tags["drafter_step"])
        assert (
            k.data.tags["checkpoint.step_unit"] == "micro_batch"
            and k.data.tags["checkpoint.layout"] == "specforge-legacy"
        )
        assert k.data.tags["checkpoint.epoch"] == ("1" if s == 4 else "0")
        assert k.data.metrics["acceptance_length"] == tau_of_hf(
            tmp_path, qwen3_dir, hf_folder(tmp_path / f"hf{s}", *weights[s])
        )
    assert "micro-batches" in parent.data.tags["mlflow.note.content"]
    assert [s for s, _ in history(tmp_path, parent.info.run_id, "train/accuracy")] == [1, 2, 3, 4]

    def trainer():  # step 6's weights land, then step 8 is written in place, file by file, then its final repeat
        time.sleep(0.5)
        os.replace(run / "epoch_1_step_6" / ".tmpAb12Cd", run / "epoch_1_step_6" / "model.safetensors")
        time.sleep(0.3)
        legacy_step(run, 1, 8, *weights[8], mid_write=True, age=None)
        time.sleep(1.0)
        os.replace(run / "epoch_1_step_8" / ".tmpAb12Cd", run / "epoch_1_step_8" / "model.safetensors")
        legacy_step(run, 2, 8, *weights[8], age=None)

    writer = threading.Thread(target=trainer)
    writer.start()
    follow = compose(
        overrides(tmp_path, qwen3_dir, run, "follow=true", "watch.poll_s=0.1", "watch.settle_s=0.5", "watch.quiet_s=6")
    )
    try:
        out = series.evaluate_training_run(follow, "")
    finally:
        writer.join()
    assert sorted(r.info.drafter_step for r in out.results) == [6, 8] and sorted(out.skipped) == [2, 4]
    (parent,), kids = family(tmp_path)
    assert sorted(int(k.data.tags["drafter_step"]) for k in kids) == [2, 4, 6, 8]  # step 8 once (two folders)


def test_launch_json_that_differs_from_the_payloads_contract_is_reported_and_the_contract_wins(
    tmp_path, qwen3_dir, qwen3_target
):
    """The JSON says block_size 8 and other taps; the payload trained block 4 with taps [1, 3]: a warning names both
    values, the trained ones are evaluated (τ as the HF folder of the trained config)."""
    from dflash.evaluation import series

    sd, raw = tiny(qwen3_target, 5)
    run = tmp_path / "out"
    unified_save(run, 100, sd, contract(raw))
    edited = {**raw, "block_size": 8, "dflash_config": {**raw["dflash_config"], "target_layer_ids": [2, 4]}}
    launch = tmp_path / "edited.json"
    launch.write_text(json.dumps(edited))
    cfg = compose(overrides(tmp_path, qwen3_dir, run, "drafter.step=all", f"drafter.config={launch}"))
    out = series.evaluate_training_run(cfg, "")
    (res,) = out.results
    warned = " | ".join(res.warnings)
    assert "block_size=8, but the run trained dflash_block_size=4" in warned
    assert "target_layer_ids=[2, 4], but the run trained dflash_target_layer_ids=[1, 3]" in warned
    assert res.info.block_size == 4 and res.info.target_layer_ids == [1, 3]
    assert res.metrics["acceptance_length"] == tau_of_hf(tmp_path, qwen3_dir, hf_folder(tmp_path / "hf", sd, raw))


def test_a_unified_run_without_its_config_and_an_unreadable_folder_exit_2_naming_what_is_missing(
    tmp_path, qwen3_dir, qwen3_target
):
    from dflash.evaluation import series

    sd, raw = tiny(qwen3_target, 1)
    run = tmp_path / "out"
    launch = tmp_path / "launch.json"  # the payload names the JSON it was launched with; it was moved since
    launch.write_text(json.dumps(raw))
    unified_save(run, 100, sd, contract(raw), launch)
    launch.unlink()
    with pytest.raises(CheckpointError) as e:
        series.evaluate_training_run(compose(overrides(tmp_path, qwen3_dir, run, "drafter.step=all")), "")
    assert exit_code(e.value) == 2
    assert "holds no config.json" in str(e.value) and "pass drafter.config=" in str(e.value)
    assert f"training_state.pt names {launch}, which is not there" in str(e.value)
    (parent,), (kid,) = family(tmp_path)
    assert kid.info.status == "FAILED" and parent.info.status == "FAILED"  # nothing left RUNNING
    empty = tmp_path / "empty"
    (empty / "runs").mkdir(parents=True)
    with pytest.raises(CheckpointError) as e:
        series.evaluate_training_run(compose(overrides(tmp_path, qwen3_dir, empty, "drafter.step=all")), "")
    assert exit_code(e.value) == 2
    for words in ("step_<N>/", "epoch_<e>_step_<s>/", "<run_id>-step<N>/training_state.pt", "found runs/"):
        assert words in str(e.value), words


def mlflow_runs(uri: str, run: Path, weights: dict, launch: Path) -> dict[str, list[tuple[int, float]]]:
    """SpecForge's unified tracker into an MLflow store (experiment `specforge`, run name = run_id, a new run per
    start, train/optimizer_step in every row, eval rows at evaluations): a first process saving steps 100-300, then
    a restart from step 100 that saves 200 again (a rewind); also an unrelated run of the default name from the day
    before. -> the train/acc points of the timeline that stands."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    exp = mlflow.set_experiment("specforge")
    client = mlflow.MlflowClient(uri)
    day = int(time.time() * 1000) - 86_400_000
    other = client.create_run(exp.experiment_id, start_time=day, run_name=RUN_ID)
    client.log_metric(other.info.run_id, "train/acc", 0.99, step=100, timestamp=day)
    client.set_terminated(other.info.run_id, end_time=day + 3_600_000)

    def row(n: int, acc: float) -> dict[str, float]:
        return {
            "train/loss": 2.0 - acc,
            "train/acc": acc,
            "train/lr": 1e-4,
            "train/optimizer_step": float(n),
            "train/dflash/hard_label/unary_top1_accuracy": acc * 0.9,
            "perf/optimizer_steps_per_hour": 1000.0,
        }

    stands = []
    with mlflow.start_run(run_name=RUN_ID):
        mlflow.log_params({"report_to": "mlflow", "mlflow_experiment_name": "None", "mlflow_run_name": "None"})
        for n in (50, 100, 150, 200, 250, 300):
            mlflow.log_metrics(row(n, n / 1000), step=n)
            if n % 100 == 0:
                mlflow.log_metrics(
                    {"eval/avg_acc": n / 900, "eval/simulated_acc_len": n / 900, "train/optimizer_step": float(n)},
                    step=n,
                )
                unified_save(run, n, weights[n][0], contract(weights[n][1]), launch)
            if n <= 100:
                stands.append((n, n / 1000))
    time.sleep(1.1)
    with mlflow.start_run(run_name=RUN_ID):  # restarted from step 100: a new run of the same name
        for n in (150, 200):
            mlflow.log_metrics(row(n, n / 2000), step=n)
            stands.append((n, n / 2000))
        unified_save(run, 200, weights[200][0], contract(weights[200][1]), launch)
        mlflow.log_metrics(
            {"eval/avg_acc": 0.3, "eval/simulated_acc_len": 0.3, "train/optimizer_step": 200.0}, step=200
        )
    return {"train/acc": stands}


def test_unified_run_beside_its_mlflow_runs_on_one_chart(tmp_path, qwen3_dir, qwen3_target):
    """train_metrics.source=mlflow on a unified run: every MLflow run SpecForge started under the run's name that
    was alive while this folder's steps were saved, stitched (the rewound timeline's points go), the unrelated run
    of the same default name left out; SpecForge's names under train/ once; τ and train/acc on the saved view's
    first chart and on the parent's PNG."""
    from dflash import tracking
    from dflash.evaluation import series

    run = tmp_path / "out"
    weights = {n: tiny(qwen3_target, n) for n in (100, 200, 300)}
    launch = tmp_path / "launch.json"
    launch.write_text(json.dumps(weights[100][1]))
    uri = f"sqlite:///{tmp_path}/specforge.db"
    stands = mlflow_runs(uri, run, weights, launch)
    extra = ["drafter.step=all", f"drafter.config={launch}", "train_metrics.source=mlflow", f"train_metrics.uri={uri}"]
    series.evaluate_training_run(compose(overrides(tmp_path, qwen3_dir, run, *extra)), "")
    (parent,), kids = family(tmp_path)
    assert sorted(int(k.data.tags["drafter_step"]) for k in kids) == [100, 200]
    got = history(tmp_path, parent.info.run_id, "train/acc")
    assert [s for s, _ in got] == [s for s, _ in stands["train/acc"]]
    assert [v for _, v in got] == pytest.approx([v for _, v in stands["train/acc"]])  # 0.99 (unrelated run) absent
    for name in ("train/dflash/hard_label/unary_top1_accuracy", "train/eval/simulated_acc_len", "train/loss"):
        assert history(tmp_path, parent.info.run_id, name), name
    assert not history(tmp_path, parent.info.run_id, "train/train/acc")
    assert not history(tmp_path, parent.info.run_id, "train/train/optimizer_step")  # the join key is no metric
    client = tracking.mlflow_client(f"sqlite:///{tmp_path}/mlflow.db")
    view = json.loads(client.get_experiment(parent.info.experiment_id).tags["mlflow.sharedViewState.dflash-training"])
    first = json.loads(view["state"])["compareRunCharts"][0]
    assert first["selectedMetricKeys"] == ["acceptance_length", "train/acc"]
    png = Path(client.download_artifacts(parent.info.run_id, tracking.TRAINING_CHART, str(tmp_path)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("DFLASH_SPECFORGE_CHART"):  # keep the chart to look at
        shutil.copy(png, os.environ["DFLASH_SPECFORGE_CHART"])


# --- the payload's refusals and the contract, without a target ---------------------------------------


def test_a_payload_is_read_weights_only_and_other_strategies_are_refused_by_name(tmp_path, qwen3_target):
    from dflash.models.drafter import specforge

    sd, raw = tiny(qwen3_target, 1)
    unified_save(tmp_path, 10, sd, contract(raw))
    path = tmp_path / f"{RUN_ID}-step10" / "training_state.pt"
    got, meta = specforge.read_payload(path)
    assert sorted(got) == sorted(sd) and meta["dflash_target_layer_ids"] == [1, 3] and meta["global_step"] == 10
    torch.save({"draft_state_dict": sd, "strategy": "dspark"}, path)
    with pytest.raises(CheckpointError, match="'dspark' strategy \\(DSpark drafter\\)"):
        specforge.read_payload(path)
    torch.save({"draft_state_dict": sd, "strategy": "dflash", "args": argparse.Namespace(lr=1)}, path)
    with pytest.raises(CheckpointError, match="weights-only load refuses it.*specforge export --to hf"):
        specforge.read_payload(path)
    torch.save({"model": sd}, path)
    with pytest.raises(CheckpointError, match="has no draft_state_dict"):
        specforge.read_payload(path)


def test_the_contract_over_the_launch_json():
    from dflash.models.drafter.specforge import apply_contract

    raw = {"num_hidden_layers": 2, "layer_types": ["sliding_attention"] * 2, "block_size": 16,
           "dflash_config": {"mask_token": "<|mask|>", "target_layer_ids": [1, 9]}}  # fmt: skip
    terms = {"dflash_draft_num_hidden_layers": 3, "dflash_block_size": 8, "dflash_mask_token_id": 7,
             "dflash_target_layer_ids": [1, 9]}  # fmt: skip
    out, warns = apply_contract(raw, terms, Path("l.json"))
    assert out["num_hidden_layers"] == 3 and out["layer_types"] == ["sliding_attention"] * 3
    assert out["dflash_config"] == {"target_layer_ids": [1, 9], "block_size": 8, "mask_token_id": 7}
    assert "block_size" not in out and len(warns) == 2  # layers 2 -> 3, block 16 -> 8; the mask filled, taps agree
    assert "num_hidden_layers=2, but the run trained dflash_draft_num_hidden_layers=3" in warns[0]
    mixed = {**raw, "layer_types": ["sliding_attention", "full_attention"]}
    with pytest.raises(CheckpointError, match="which kind is each"):
        apply_contract(mixed, terms, Path("l.json"))
    with pytest.raises(CheckpointError, match="trained as DFlash2 \\(dflash2_selector_rank=16\\).*DFlashDraftModel"):
        apply_contract(raw, {**terms, "dflash2_selector_rank": 16}, Path("l.json"))


def test_drafter_config_is_for_a_training_run():
    from dflash.util.errors import ConfigError

    with pytest.raises(ConfigError, match="drafter.config is the launch JSON of a SpecForge training run"):
        compose(["drafter=hf", "drafter.path=x", "drafter.config=launch.json"])
    assert compose(["drafter=training", "drafter.run_dir=x", "drafter.config=l.json"]).drafter.config == "l.json"
