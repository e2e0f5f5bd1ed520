"""The evaluation experiment as MLflow's UI shows it: its description and the saved view (τ columns,
headline charts first, the rest collapsed), and the link that opens it.

`DFLASH2_SPECFORGE`: DFlash2's MLflow names (scalars, and `by_position/<kind>` curves with step = draft
slot) and the SpecForge training metric each one answers (DFLASH.md §8.5; docs/dflash2.md). SpecForge's
are teacher-forced on sampled training anchors; these on every anchor of the evaluation references."""

from __future__ import annotations

import json
import time
from typing import Any, Sequence

from dflash.tracking.store import NOTE_TAG, VIEW_KEY, mlflow_client, store_lock


def view_url(experiment_id: str, base: str = "http://127.0.0.1:5000") -> str:
    """The experiment's runs table through its saved view (τ columns; add &compareRunsMode=CHART for the charts)."""
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"


EXPERIMENT_NOTE = """Evaluations of DFlash drafters on this target (dflash-eval, `python evaluate.py`).

- **τ** = `acceptance_length`: committed tokens per verify step, bonus included (plain decoding = 1), \
with `acceptance_length_se` (SE over prompts) and `acceptance_length/<subset>`.
- Curves over the draft slots (x = slot k, 1 = first drafted token): `by_position/accept_rate` (cumulative), \
`by_position/accept_rate_cond` (conditional), `by_position/accuracy` (teacher-forced); `by_commit/share`: \
share of verify steps committing x tokens. The table view shows a curve's last point: read curves in the chart view.
- DFlash2 drafters also log the unary τ (`acceptance_length_unary`: the drafter without its selector), \
`selector_gain` ± `selector_gain_se` (paired over prompts), `by_position/unary_accuracy` and `by_position/topk_recall` \
(section "DFlash2"; SpecForge's names for them: docs/dflash2.md).
- Each run: description (overview), `samples.html`, `plots/`, `per_position.json`, `per_prompt.json`. A `-m` sweep: \
one parent per sweep with `sweep/children.csv` and `sweep/*.png`.
- Open the saved view **dflash: τ and curves** (Saved views, or `...&viewStateShareKey=dflash` in the URL) for τ \
in the table and these charts first. Pair two runs by prompt: `python -m dflash.compare A B`.
"""

DFLASH2_SPECFORGE = {  # our MLflow name -> SpecForge's training metric (K = selector_top_k)
    "acceptance_length": "dflash2/selector/walk_accepted_length (there: over sampled anchors)",
    "acceptance_length_unary": "dflash/hard_label/walk_accepted_length",
    "selector_gain": "the difference of the two walk_accepted_length",
    "expected_acceptance_length_unary": "dflash/hard_label/*_accepted_length of the unary argmax (1 + Σ Π unary accuracy)",
    "expected_acceptance_length_topk": "dflash/hard_label/unary_topK_oracle_accepted_length",
    "by_position/unary_accuracy": "dflash/hard_label/unary_top1_accuracy, position_<j>",
    "by_position/accuracy": "dflash2/selector/self_conditioned_marginal_accuracy, position_<j> (the walk's)",
    "by_position/topk_recall": "dflash/hard_label/unary_topK_recall, position_<j>",
}
DFLASH2_CHARTS = [("acceptance_length_unary", "BAR"), ("selector_gain", "BAR"), ("by_position/unary_accuracy", "LINE"),
                  ("by_position/topk_recall", "LINE")]
HEADLINE = [("acceptance_length", "BAR"), ("by_position/accept_rate", "LINE"), ("by_position/accept_rate_cond", "LINE"),
            ("by_position/accuracy", "LINE"), ("by_commit/share", "LINE")]
COLLAPSED = ["by_position", "expected_acceptance_length", "leak_probe", "time", "Model metrics", "System metrics"]


def eval_view(subsets: Sequence[str]) -> dict[str, Any]:
    """The saved view's state (MLflow 3 ExperimentPageUIState): τ columns in the runs table; charts: the
    headline section (τ, the per-position curves, commits per step), τ per subset, the rest collapsed."""
    def chart(i: int, key: str, kind: str, section: str) -> dict[str, Any]:
        c: dict[str, Any] = {"uuid": f"dflash-{i}", "type": kind, "runsCountToCompare": 10, "metricSectionId": section, "deleted": False,
                             "isGenerated": False, "metricKey": key}
        if kind == "LINE":
            c.update(selectedMetricKeys=[key], xAxisKey="step", useGlobalXaxisKey=False, lineSmoothness=0, useGlobalLineSmoothing=False,
                     scaleType="linear", xAxisScaleType="linear", displayPoints=True, selectedXAxisMetricKey="",
                     range={"yMin": 0, "yMax": 1} if "/accept" in key or "accuracy" in key or "recall" in key else {})
        return c

    sections = [("dflash-headline", "τ, acceptance by draft slot, commits per step", True), ("dflash-subsets", "acceptance_length", True)]
    sections += [(f"dflash-s{i}", name, False) for i, name in enumerate(COLLAPSED)] + [("dflash-dflash2", "DFlash2", False)]
    charts = [chart(i, k, t, "dflash-headline") for i, (k, t) in enumerate(HEADLINE)]
    charts += [chart(len(charts) + i, k, t, "dflash-dflash2") for i, (k, t) in enumerate(DFLASH2_CHARTS)]
    charts += [chart(len(charts) + i, f"acceptance_length/{s}", "BAR", "dflash-subsets") for i, s in enumerate(subsets)]
    metric_cols = ["acceptance_length", "acceptance_length_se", *[f"acceptance_length/{s}" for s in subsets], "expected_acceptance_length"]
    return {
        "selectedColumns": ["attributes.`Dataset`", *[f"metrics.`{m}`" for m in metric_cols]],
        "compareRunCharts": charts,
        "compareRunSections": [
            {"uuid": u, "name": n, "display": d, "isReordered": False, "deleted": False, "isGenerated": False} for u, n, d in sections
        ],
        "isAccordionReordered": True,
        "hideEmptyCharts": True,
        "runsExpanded": {},
        "runsPinned": [],
        "runsHidden": [],
        "groupBy": None,
        "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0, "selectedXAxisMetricKey": ""},
    }


def setup_eval_experiment(uri: str, experiment_id: str, subsets: Sequence[str]) -> None:
    """Description and saved view on an evaluation experiment; the view gains the τ of each new prompt subset."""
    key = f"mlflow.sharedViewState.{VIEW_KEY}"
    client = mlflow_client(uri)
    with store_lock(uri):
        tags = client.get_experiment(experiment_id).tags
        try:
            known = [c["metricKey"].split("/", 1)[1] for c in json.loads(json.loads(tags[key])["state"])["compareRunCharts"]
                     if c["metricKey"].startswith("acceptance_length/")]
        except (KeyError, ValueError, TypeError):
            known = []
        if NOTE_TAG not in tags:
            client.set_experiment_tag(experiment_id, NOTE_TAG, EXPERIMENT_NOTE)
        if key in tags and set(subsets) <= set(known):
            return
        state = json.dumps(eval_view(sorted(set(known) | set(subsets))))
        envelope = {"name": "dflash: τ and curves", "createdAt": int(time.time() * 1000), "state": state}
        client.set_experiment_tag(experiment_id, key, json.dumps(envelope))


