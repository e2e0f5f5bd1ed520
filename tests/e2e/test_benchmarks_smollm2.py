"""The field's benchmarks end to end on the real SmolLM2 target, as a user runs them (evaluate.py in a
subprocess, local copies in the hub's schema from tests/hub_copies.py): one data set with its wording,
the z-lab suite with its parent's table per data set, τ at T = 0 and T = 1 in one sweep, and served τ
beside offline τ against a fake SGLang server that reports speculative counters."""

import json
import uuid
from pathlib import Path

import hub_copies
import pytest
from test_evaluate import evaluate, runs
from test_reference_server import SPELLINGS, Fake, _steps, serve

pytestmark = pytest.mark.slow
SHORT = ["prompts.max_new_tokens=16", "progress=false"]
SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def _kids(tmp: Path):
    all_runs = runs(tmp)
    (parent,) = [r for r in all_runs if r.data.tags.get("dflash.role") == "sweep"]
    return parent, [r for r in all_runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]


def test_gsm8k_from_a_local_copy_in_the_fields_wording(tmp_path):
    rows = hub_copies.write(tmp_path / "data", "gsm8k", 12)
    r = evaluate(
        tmp_path,
        "prompts=gsm8k",
        f"prompts.path={tmp_path}/data/gsm8k",
        "prompts.num_prompts=2",
        "prompts.max_new_tokens=24",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "τ per subset: gsm8k " in r.stdout and "2 prompts" in r.stdout
    (run,) = runs(tmp_path)
    assert run.info.status == "FINISHED" and "acceptance_length/gsm8k" in run.data.metrics
    assert run.data.params["prompts.source"] == "gsm8k" and run.data.params["prompts.max_new_tokens"] == "24"
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    per_prompt = json.loads(Path(c.download_artifacts(run.info.run_id, "per_prompt.json", str(tmp_path))).read_text())
    samples = json.loads(Path(c.download_artifacts(run.info.run_id, "samples.json", str(tmp_path))).read_text())
    by_q = {rw["question"] + SUFFIX for rw in rows}
    assert len(per_prompt) == 2 and all(
        s["prompt"] in by_q for s in samples
    )  # the user message exactly, nothing around it


def test_the_zlab_suite_is_one_sweep_with_tau_per_data_set(tmp_path):
    hub_copies.write_all(tmp_path / "data", 6)
    r = evaluate(tmp_path, "-m", "suite=zlab", f"prompts.data_dir={tmp_path}/data", "prompts.num_prompts=1", *SHORT)
    assert r.returncode == 0, r.stderr[-3000:]
    parent, kids = _kids(tmp_path)
    names = ["gsm8k", "math500", "humaneval", "mbpp", "mt_bench"]
    assert parent.info.status == "FINISHED" and sorted(k.data.params["prompts.source"] for k in kids) == sorted(names)
    assert all(k.info.status == "FINISHED" for k in kids)
    mt = next(k for k in kids if k.data.params["prompts.source"] == "mt_bench")
    assert {"acceptance_length/mt_bench/turn_1", "acceptance_length/mt_bench/turn_2"} <= set(
        mt.data.metrics
    )  # both turns replayed
    note = parent.data.tags["mlflow.note.content"]
    assert "| run | prompts | τ ± SE | published τ |" in note
    for k in kids:  # one line per data set with its τ; SmolLM2 and this drafter: nothing published to set beside it
        name = k.data.params["prompts.source"]
        line = next(x for x in note.splitlines() if f"| {name} |" in x)
        assert f"{k.data.metrics['acceptance_length']:.3f}" in line and line.split("|")[4].strip() == "-"
    assert note in r.stdout  # the parent's table on the console too


def test_tau_at_t0_and_t1_in_one_sweep(tmp_path):
    hub_copies.write(tmp_path / "data", "gsm8k", 6)
    r = evaluate(
        tmp_path,
        "-m",
        "references.temperature=0,1",
        "prompts=gsm8k",
        f"prompts.path={tmp_path}/data/gsm8k",
        "prompts.num_prompts=2",
        *SHORT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "greedy" in r.stdout and "z-lab sampled (T=1, top_p=1, top_k=0, seed=0;" in r.stdout
    parent, kids = _kids(tmp_path)
    assert parent.info.status == "FINISHED" and sorted(k.data.params["references.temperature"] for k in kids) == [
        "0.0",
        "1.0",
    ]
    note = parent.data.tags["mlflow.note.content"]
    assert "| run | references.temperature | data set | τ ± SE | published τ |" in note
    for k in kids:
        t = k.data.params["references.temperature"].rstrip("0").rstrip(".")
        line = next(x for x in note.splitlines() if f"| {t} | gsm8k |" in x)
        assert f"{k.data.metrics['acceptance_length']:.3f}" in line


@pytest.fixture
def dflash_server():
    """The fake SGLang server of tests/unit/test_reference_server.py, reporting speculative counters (today's
    spelling)."""
    fake = Fake()
    # a server never seen: evaluate() shares the project's .cache, references included
    fake.model = f"org/model-{uuid.uuid4().hex[:8]}"
    fake.spec = lambda kind, ids, comp: SPELLINGS["sglang_correct_drafts"](ids, comp)
    srv = serve(fake)
    fake.url = f"http://127.0.0.1:{srv.server_port}"
    yield fake
    srv.shutdown()
    srv.server_close()


def test_served_and_offline_tau_side_by_side(tmp_path, dflash_server):
    hub_copies.write(tmp_path / "data", "gsm8k", 6)
    r = evaluate(
        tmp_path,
        "prompts=gsm8k",
        f"prompts.path={tmp_path}/data/gsm8k",
        "prompts.num_prompts=3",
        "prompts.max_new_tokens=24",
        "references=sglang",
        f"references.url={dflash_server.url}",
        "references.backoff_s=0.01",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = runs(tmp_path)
    m = run.data.metrics
    posts = dflash_server.posts  # what the server was asked and answered: Σ completion tokens / Σ verify steps
    from test_reference_server import honest

    comps = [honest(p["input_ids"], p["sampling_params"]["max_new_tokens"]) for p in posts]
    served = sum(map(len, comps)) / sum(_steps(p["input_ids"], c) for p, c in zip(posts, comps))
    assert m["served/acceptance_length"] == pytest.approx(served) and m["served/prompts"] == 3
    assert m["served/gap"] == pytest.approx(m["served/offline_like"] - served) and "acceptance_length" in m
    line = next(x for x in r.stdout.splitlines() if x.startswith("served τ"))
    assert f"{served:.3f} pooled" in line and f"{m['served/offline_like']:.3f}" in line
    assert f"{m['acceptance_length']:.3f}" in r.stdout  # the offline τ, above it
