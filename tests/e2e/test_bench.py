"""`dflash-bench` end to end on the tiny Qwen3 target: every section prints its ratios.
No timing is asserted (the figures are the benchmark's output, not a test's)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_prints_every_section(tmp_path, qwen3_dir):
    env = {**os.environ, "DFLASH_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "dflash.bench",
        "--online",
        "2",
        "--online-eager",
        "--sweep-profile",
        "--skip",
        "scale",
        "target=local",
        f"target.path={qwen3_dir}",
        "drafter=init",
        "target.mask_token_id=3",
        "target.template.use_chat_template=false",
        "prompts.num_prompts=3",
        "prompts.max_new_tokens=12",
        "tracking.enabled=false",
    ]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = r.stdout.split("== summary")[1]
    assert "LOOP COUNTERS DIFFER" not in summary  # every replay mode walks the same loop
    for line in [
        "sweep of 2 checkpoints",
        "x one run",
        "of the first run's",
        "warm per checkpoint",
        "online, batch 1",
        "x target-only",
        "cheaper",
        "generation (cpu",
        "engine",
        "replay modes",
        "replay.anchors=visited replay.tf_stride=4",
        "replay.anchors=all replay.tf_stride=4",
        "bound: each further checkpoint pays its drafter's load and replay",
    ]:
        assert line in summary, (line, summary)
    profile = summary.split("profile of one more warm run", 1)[1]
    assert (
        "cumulative" in profile and "dflash/evaluation/pipeline.py" in profile and "(replay_prompts)" in profile
    )  # the stage's own seconds


@pytest.mark.slow
@pytest.mark.parametrize(
    "drafter, kind",
    [
        ("dflash", "DFlashDraftModel, block 16, sliding layers []"),
        ("dflash2", "DFlash2DraftModel, block 8, sliding layers [0, 1, 2, 3, 4] (window 2048), causal layers []"),
    ],
)
def test_bench_scale_vl_prints_every_stage(tmp_path, drafter, kind):
    """The 27B path on a tiny VL shape (SmolLM2's tokenizer, as at 27B): folder built and saved by shards, a child per
    device, the
    table; `--scale-drafter dflash2`: the 5-layer DFlash2 drafter of SpecForge's 27B example (saved and read back as a
    folder too).
    Issue 29.4: references and features at first use and steady (run again in the child: every reference regenerated,
    every
    feature computed), each steady stage over its floor measured on the device, and `--scale-profile`'s tables."""
    import json

    from dflash.bench.steady import per_step

    env = {**os.environ, "DFLASH_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "dflash.bench",
        "--skip",
        "sweep,online,generation",
        "--scale",
        "tiny_vl",
        "--scale-devices",
        "cpu",
        "--scale-cpu",
        "2x4",
        "--scale-drafter",
        drafter,
        "--scale-profile",
        "target.mask_token_id=100",
        "target.default_taps=null",
        "tracking.enabled=false",
    ]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for line in [
        "load target",
        "references",
        "features",
        "replay",
        "loaded from a saved HF folder",
        "peak RSS",
        "replay per token / feature pass per token",
        "projected",
        "linear attention: torch fallback",
        "replay again, replay.anchors=visited replay.tf_stride=4",
        f"drafter: drafter=init, 5 layers, {kind}",
        "references, first use in the process",
        "references, steady (again: a new engine, kernels warm)",
        "features, first use in the process",
        "features, steady (caches emptied, kernels warm; one sequence per pass)",
        "features, steady, batched, features.batch_tokens=16384",
        "floors on cpu: bf16 GEMM",
        "profile, feature pass, steady (top ops by self CPU time):",
        "profile, feature pass with features.batch_tokens=16384, steady",
        "profile, 8 decode steps (eager) at batch 2",
        "aten::mm",
        "per token, steady, beside the matrix-product floor on cpu: features",
        "x the weights'",
    ]:
        assert line in r.stdout, (line, r.stdout)
    (res,) = json.loads(r.stdout.split("raw: ", 1)[1].splitlines()[0])
    s, f = res["steady"], res["floors"]
    assert (
        s["generated"] == res["prompts"] and s["feature_tokens"] == res["prompt_tokens"] + res["new_tokens"]
    )  # recomputed, not cached
    assert (
        s["batch_tokens"] is None and s["batch_tokens_other"] == 16384 and s["features_other"] > 0
    )  # both batchings timed
    assert (
        min(
            f["gemm_tflops"],
            f["copy_gbps"],
            f["arithmetic_s"],
            f["weight_read_s"],
            f["forward_flops"],
            f["weight_bytes"],
        )
        > 0
    )
    assert res["replay_flops"] > 0 and res["weight_bytes"] > 0
    if res["threads"] > 1:  # the thread-scaling row: half the threads against all of them
        assert res["half_threads"]["threads"] == res["threads"] // 2 and f"threads {res['threads'] // 2} vs" in r.stdout
    step = per_step(s["references"], s["references_setup"], res["reference_steps"])
    assert (
        f"features steady / arithmetic floor = {s['features']:.3f} / {f['arithmetic_s']:.3f} s = "
        f"{s['features'] / f['arithmetic_s']:.1f}x" in r.stdout
    )
    assert (
        f"references per step / weight-read floor = {step * 1e3:.2f} / {f['weight_read_s'] * 1e3:.2f} ms = "
        f"{step / f['weight_read_s']:.1f}x" in r.stdout
    )


def test_bench_bad_override_exits_2_naming_the_key(tmp_path):
    """A typo in the bench's overrides is a user error: exit 2, the key and its neighbours named, no traceback."""
    env = {**os.environ, "DFLASH_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash.bench",
            "--skip",
            "sweep,replay,online,generation,scale",
            "prompts.num_promts=3",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "dflash-bench: error: prompts.num_promts is not a config key" in r.stderr and "num_prompts" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_scale_bench_frees_its_random_model_before_the_child(tmp_path, monkeypatch):
    """Issue 29.4: the random 27B model the parent builds (on the GPU where there is one) is gone, and the CUDA cache
    emptied on CUDA, before the child that loads the target on the same device starts. Here the tiny shape on CPU:
    when the child is spawned no VL model object is alive; `release` empties the CUDA cache for a CUDA build."""
    import weakref

    from conftest import make_tokenizer
    from transformers import Qwen3_5ForConditionalGeneration

    from dflash.bench import scale as bench_scale

    made, alive, emptied = [], [], []
    build = Qwen3_5ForConditionalGeneration._from_config

    def spy(*a, **kw):  # every model build_vl makes, watched
        m = build(*a, **kw)
        made.append(weakref.ref(m))
        return m

    def child(spec):
        alive.append([r() is not None for r in made])
        raise RuntimeError("stop here")

    monkeypatch.setattr(Qwen3_5ForConditionalGeneration, "_from_config", staticmethod(spy))
    monkeypatch.setattr(bench_scale, "_child", child)
    with pytest.raises(RuntimeError, match="stop here"):
        bench_scale.report("tiny_vl", str(tmp_path), make_tokenizer(), ["cpu"], {"cpu": (1, 2)}, False, [], "dflash2")
    assert alive == [[False]]  # one model built, gone when the child is spawned
    monkeypatch.setattr("torch.cuda.empty_cache", lambda: emptied.append(True))
    bench_scale.release("cpu")
    bench_scale.release("cuda")
    assert emptied == [True]


def test_the_scale_bench_reports_steady_costs_per_token_and_first_use_once():
    """Per-token costs (the replay's ratio to the feature pass, the protocol's projection) come from the stages run
    again
    in the child (steady), not from their first use, which pays compilation and autotuning once; without a steady run
    they fall back to first use and nothing is counted once."""
    from dflash.bench.scale import STEADY_REPLAY, _first_use, _per_token

    r = dict(
        timings=dict(references=30.0, references_setup=20.0, features=12.0, replay=5.0),
        new_tokens=100,
        prompt_tokens=100,
        steady=dict(references=6.0, references_setup=1.0, features=2.0),
        replay_modes={STEADY_REPLAY: 1.0},
    )
    pt = _per_token(r)
    assert pt == dict(references=0.05, features=0.01, replay=0.01)  # (6 - 1) / 100, 2 / 200, 1 / 100
    assert _first_use(r) == (10.0 - 5.0) + (12.0 - 2.0) + (5.0 - 1.0)  # references after set-up, features, replay
    first = {k: v for k, v in r.items() if k not in ("steady", "replay_modes")}
    assert _per_token(first) == dict(references=0.1, features=0.06, replay=0.05) and _first_use(first) == 0.0
