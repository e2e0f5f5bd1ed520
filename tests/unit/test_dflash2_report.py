"""What a DFlash2 run reports (issue 27 part 3): samples.html marks where the selector's walk chose other than
the unary top-1; the MLflow names of dflash.tracking are the ones the summary and the curves carry (SpecForge's
names beside them); end to end on SmolLM2 (slow), `evaluate.py drafter=hf drafter.path=<DFlash2 folder>` prints τ,
the unary τ, the selector's gain and the top-k recall, and logs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_dflash2_online import as_dflash2, smollm2  # noqa: F401 (fixture)
from test_evaluate import FAST, evaluate, runs
from test_samples import _run, byte_tok, ids, parse  # noqa: F401 (fixture)

from dflash.report.plots import position_curves_png
from dflash.report.samples import sample_record, samples_html
from dflash.stages.metrics import Counters, count_step, position_curves, summarize
from dflash.tracking import DFLASH2_SPECFORGE, series_point
from dflash.tracking.record import SELECTOR_GAIN, TAU_UNARY

ROOT = Path(__file__).resolve().parents[2]


def test_samples_mark_the_selector_choice(byte_tok):  # noqa: F811
    c, blocks, rec = _run(byte_tok, "abcdefg", wrong={0: 3})
    bad = ids(byte_tok, "#")[0]
    blocks[0].unary = [
        bad,
        blocks[0].proposal[1],
        blocks[0].proposal[2],
    ]  # the walk overrode slot 1's unary top-1 ("#")
    blocks[1].unary = list(blocks[1].proposal)
    from dflash.stages.prompts.sets import Prompt

    p = Prompt(id="p<1>", subset="fresh", messages=(("user", "hi"),))
    x, r = ids(byte_tok, "hi"), ids(byte_tok, "abcdefg")
    rec = sample_record(p, x, r, blocks, byte_tok)
    assert rec.blocks[0].reranked == [0] and rec.blocks[1].reranked == [] and rec.blocks[0].unary[0] == "#"
    page = samples_html([rec])
    assert (
        parse(page).spans[1] == ("acc sel", "b") and "the selector chose it over the unary top-1 &#x27;#&#x27;" in page
    )
    assert "selector&#x27;s choice" in page
    assert "selector&#x27;s choice" not in samples_html([_run(byte_tok, "abcdefg")[2]])  # DFlash: no such legend


def test_mlflow_names_are_the_summary_and_curve_names():
    c = Counters(block_size=4, selector=True)
    count_step(c, 1, 2)
    c.unary_steps, c.unary_committed = 1, 1
    c.tf_total, c.tf_correct, c.tf_unary_correct, c.tf_topk_hit = [2, 2, 2], [1, 1, 0], [1, 0, 0], [2, 1, 1]
    names = set(summarize([("s", c), ("s", c)])) | {f"by_position/{k}" for k in position_curves(c)}
    assert set(DFLASH2_SPECFORGE) <= names
    assert position_curves_png(c)[:4] == b"\x89PNG"  # the figure draws the DFlash2 curves too
    plain = Counters(block_size=4)
    count_step(plain, 1, 2)
    dflash = set(summarize([("s", plain)])) | {f"by_position/{k}" for k in position_curves(plain)}
    assert not (
        {"acceptance_length_unary", "selector_gain", "by_position/topk_recall", "by_position/unary_accuracy"} & dflash
    )


def test_per_prompt_rows_carry_the_unary_counters():
    """per_prompt.json (what dflash-compare pairs) holds a DFlash2 prompt's unary walk and top-k hits; a DFlash
    prompt's row has no such keys."""
    from dflash.result import PromptResult, per_prompt_row
    from dflash.stages.prompts.sets import Prompt

    c = Counters(block_size=4, selector=True)
    count_step(c, 1, 2)
    c.unary_steps, c.unary_committed = 2, 3
    c.tf_total, c.tf_correct, c.tf_unary_correct, c.tf_topk_hit = [2, 2, 2], [1, 1, 0], [1, 0, 0], [2, 1, 1]
    p = Prompt(id="p", subset="s", messages=(("user", "hi"),))
    row = per_prompt_row(PromptResult(p, [1, 2], [3, 4, 5], c, [])).to_dict()
    assert (row["unary_steps"], row["unary_committed"], row["tf_unary_correct"], row["tf_topk_hit"]) == (
        2,
        3,
        [1, 0, 0],
        [2, 1, 1],
    )
    plain = Counters(block_size=4)
    count_step(plain, 1, 2)
    assert not {"unary_steps", "tf_topk_hit"} & set(
        per_prompt_row(PromptResult(p, [1, 2], [3, 4, 5], plain, [])).to_dict()
    )


def test_a_training_run_curves_carry_the_unary_tau_gain_and_recall():
    """A DFlash2 child's point on its training run's curves: the unary τ, the selector's gain, and per slot the
    unary accuracy and top-k recall beside the accuracy (none of them for a DFlash child)."""
    c = Counters(block_size=4, selector=True)
    count_step(c, 1, 2)
    c.unary_steps, c.unary_committed = 1, 1
    c.tf_total, c.tf_correct, c.tf_unary_correct, c.tf_topk_hit = [2, 2, 2], [1, 1, 0], [1, 0, 0], [2, 1, 1]
    point = series_point(summarize([("s", c)]), position_curves(c))
    assert {TAU_UNARY, SELECTOR_GAIN, "expected_acceptance_length_topk"} <= set(point)
    assert [point[f"topk_recall/slot_{k}"] for k in (1, 2, 3)] == [1.0, 0.5, 0.5]
    assert [point[f"unary_accuracy/slot_{k}"] for k in (1, 2, 3)] == [0.5, 0.0, 0.0] and point["accuracy/slot_1"] == 0.5
    plain = Counters(block_size=4)
    count_step(plain, 1, 2)
    assert not any(
        "unary" in k or "recall" in k or "selector" in k
        for k in series_point(summarize([("s", plain)]), position_curves(plain))
    )


@pytest.mark.slow
def test_evaluate_a_dflash2_folder_end_to_end(smollm2, tmp_path):  # noqa: F811
    """A DFlash2 folder (the shipped drafter with random convolutions and selector), evaluated as a user would."""
    from shortcuts import load_drafter

    from dflash.models.drafter.files import save_hf_folder

    fixed = ROOT / "checkpoints" / "fixed"
    if not fixed.is_dir():
        pytest.skip("needs the shipped drafter checkpoints/fixed")
    base = load_drafter(smollm2, "training", "fixed", run_dir=str(fixed)).model.float()
    save_hf_folder(
        as_dflash2(base, 16, smollm2.vocab_size, 3, 64, seed=1, scale=0.2), tmp_path / "d2", dtype=torch.float32
    )
    r = evaluate(tmp_path, *FAST, "drafter=hf", f"drafter.path={tmp_path / 'd2'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "unary τ (argmax, no selector)" in r.stdout and "selector gain" in r.stdout and "top-k recall" in r.stdout, (
        r.stdout
    )
    (run,) = runs(tmp_path)
    m = run.data.metrics
    assert {"acceptance_length", "acceptance_length_unary", "selector_gain", "expected_acceptance_length_topk"} <= set(
        m
    )
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for kind in ("unary_accuracy", "topk_recall"):
        assert sorted(x.step for x in c.get_metric_history(run.info.run_id, f"by_position/{kind}")) == list(
            range(1, 16)
        )
    page = Path(c.download_artifacts(run.info.run_id, "samples.html", str(tmp_path))).read_text()
    assert "DFlash2" in page and json.loads((tmp_path / "d2" / "config.json").read_text())["architectures"] == [
        "DFlash2DraftModel"
    ]
