"""What a DSpark run reports (issue 41 part 3): the console's τ with the whole block, at each confidence threshold,
the calibration table and the Markov gain; the MLflow names (dflash/tracking/record.py) and a training series'
point; per_prompt.json rows and dflash-compare's paired rows; samples.html's marks; end to end on SmolLM2 (slow),
`evaluate.py` on a DSpark folder prints and logs them."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_dspark_replay import hand_case
from test_evaluate import FAST, evaluate, runs
from test_samples import _run, byte_tok, ids, parse  # noqa: F401 (fixture)

from dflash.report.console import convention_line, dspark_lines
from dflash.report.pairs import compare
from dflash.report.samples import sample_record, samples_html
from dflash.result import PromptResult, per_prompt_row
from dflash.stages.metrics import PromptRow, convention_check, dspark_summary, position_curves
from dflash.stages.prompts.sets import Prompt
from dflash.tracking import dspark_metrics, series_point
from dflash.tracking.record import BRIER, CONVENTION, MARKOV_GAIN, TAU, TAU_UNARY, calibration_table, threshold_name

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {
    "dspark_gamma": 3,
    "dspark_markov_head_type": "vanilla",
    "dspark_markov_rank": 8,
    "dspark_sample_from_anchor": True,
}


def result():
    c, blocks = hand_case()
    other = dataclasses.replace(c, committed=c.committed + 1, other_committed=c.other_committed + 2)
    per = [c, other]
    total = c + other
    info = SimpleNamespace(drafter_config=CONFIG)
    return (
        SimpleNamespace(
            dspark=dspark_summary(per, total),
            convention=convention_check(per),
            metrics={"acceptance_length": 15 / 6, "acceptance_length_se": 0.1},
            info=info,
        ),
        per,
        blocks,
    )


def test_console_prints_tau_thresholds_calibration_and_gain():
    res, _, _ = result()
    text = "\n".join(dspark_lines(res))
    assert "τ with the whole block verified (SGLang's default) 2.500" in text and "Markov gain" in text
    assert "  0.7   1.750" in text  # t, τ at that threshold
    assert "Brier" in text and "  slot       n  predicted  realised   brier" in text and "[0.9, 1.0)" in text
    line = convention_line(res)
    assert "read in DFlash's (row 0 dropped) (2 drafts) τ" in line and "paired SE" in line


def test_mlflow_names_and_the_training_series():
    res, _, _ = result()
    m = dspark_metrics(res)
    assert {TAU_UNARY, MARKOV_GAIN, f"{MARKOV_GAIN}_se", BRIER, f"{BRIER}_se", f"{CONVENTION}{TAU}_other"} <= set(m)
    assert m[threshold_name(0.7, "tau")] == pytest.approx(7 / 4) and threshold_name(0.5, "tau").endswith("/0.5/" + TAU)
    assert all(isinstance(k, str) and "@" not in k for k in m)  # MLflow's name rule
    point = series_point({TAU: 2.5, **m}, {})
    assert threshold_name(0.7, "tau") in point and threshold_name(0.7, "gain") not in point
    assert {MARKOV_GAIN, BRIER, f"{CONVENTION}{TAU}_other"} <= set(point)
    cal = calibration_table(res)
    assert [s["realised"] for s in cal["slots"]] == [1.0, 1.0, 0.0] and len(cal["bins"]) == 10
    none = SimpleNamespace(dspark=None, convention=None)
    assert dspark_metrics(none) == {} and calibration_table(none) is None


def test_calibration_curves():
    c, _ = hand_case()
    curves = position_curves(c)
    assert curves["acceptance_realised"] == [1.0, 1.0, 0.0]
    assert curves["acceptance_predicted"] == pytest.approx([0.92, 0.552, 0.2208])


def test_per_prompt_rows_and_compare():
    """per_prompt.json rows hold the threshold walks, the Brier counts and the other convention's walk, and
    dflash-compare pairs them (only thresholds both runs walked)."""
    _, per, _ = result()
    p = Prompt(id="p", subset="s", messages=(("user", "hi"),))
    rows = []
    for i, c in enumerate(per):
        d = per_prompt_row(PromptResult(dataclasses.replace(p, id=f"p{i}"), [1, 2], [3, 4, 5], c, [])).to_dict()
        assert {"thresholds", "thr_steps", "thr_committed", "cal_sq", "cal_total", "other_steps"} <= set(d)
        rows.append(PromptRow.from_dict(json.loads(json.dumps(d))))
    b = [
        dataclasses.replace(r, thresholds=[0.5, 0.7], thr_steps=r.thr_steps[1:3], thr_committed=r.thr_committed[1:3])
        for r in rows
    ]
    names = [x.metric for x in compare(list(zip(rows, b)))]
    assert "confidence_threshold/0.5" in names and "confidence_threshold/0.7" in names
    assert "confidence_threshold/0.95" not in names and "confidence_brier" in names
    assert (
        "acceptance_length_other" in names
        and "acceptance_length_unary" in names
        and not [n for n in names if "topk" in n]
    )


def test_samples_mark_the_markov_choice_and_the_confidence(byte_tok):  # noqa: F811
    c, blocks, rec = _run(byte_tok, "abcdefg", wrong={0: 3})
    for b in blocks:
        b.unary, b.accept_p = list(b.proposal), [0.9, 0.5, 0.25][: len(b.proposal)]
    blocks[0].unary[0] = ids(byte_tok, "#")[0]
    p = Prompt(id="p", subset="fresh", messages=(("user", "hi"),))
    page = samples_html([sample_record(p, ids(byte_tok, "hi"), ids(byte_tok, "abcdefg"), blocks, byte_tok)])
    assert "the Markov head chose it over the unary top-1 &#x27;#&#x27;" in page and "confidence 0.900" in page
    assert "Markov head&#x27;s choice" in page and parse(page).spans[1][0] == "acc sel"


@pytest.mark.slow
def test_evaluate_a_dspark_folder_end_to_end(tmp_path):
    """scripts/make_dspark.py's folder evaluated as a user would: the console shows τ with the whole block and at
    each threshold, the calibration table and the Markov gain, MLflow holds them and calibration.json (the same
    folder saved with the other sample_from_anchor: test_dspark_replay.py's convention check)."""
    out = tmp_path / "dspark"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_dspark.py"), str(out)], check=True)
    r = evaluate(tmp_path, *FAST, "drafter=hf", f"drafter.path={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    for words in ("τ with the whole block verified", "Markov gain", "confidence threshold t", "Brier", "reliability"):
        assert words in r.stdout, r.stdout
    (run,) = runs(tmp_path)
    m = run.data.metrics
    assert {TAU, MARKOV_GAIN, BRIER, threshold_name(0.5, "tau"), threshold_name(0.9, "tau")} <= set(m)
    assert f"{CONVENTION}{TAU}_other" in m
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    cal = json.loads(Path(client.download_artifacts(run.info.run_id, "calibration.json", str(tmp_path))).read_text())
    assert len(cal["slots"]) == 15 and cal["brier"] == pytest.approx(m[BRIER])
