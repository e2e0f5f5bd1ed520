"""The evaluation experiment as MLflow's UI shows it: its description and the saved view (τ columns,
headline charts first, the rest collapsed), and the link that opens it.
A "DFlash2" section holds DFlash2's names (dflash.tracking.record.DFLASH2_SPECFORGE), a "DSpark" section DSpark's and
the convention check's, both collapsed."""

from __future__ import annotations

import json
import time
from typing import Any, Sequence

from dflash.tracking.record import (
    BRIER,
    BY_POSITION,
    CONVENTION,
    MARKOV_GAIN,
    SELECTOR_GAIN,
    TAU,
    TAU_UNARY,
    train_name,
)
from dflash.tracking.store import NOTE_TAG, VIEW_KEY, mlflow_client, store_lock


def view_url(experiment_id: str, base: str = "http://127.0.0.1:5000") -> str:
    """The experiment's runs table through its saved view (τ columns; add &compareRunsMode=CHART for the charts)."""
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"


EXPERIMENT_NOTE = """Evaluations of DFlash drafters on this target (`dflash-eval`).

- **τ** = `acceptance_length`: committed tokens per verify step, bonus included (plain decoding = 1), \
with `acceptance_length_se` (SE over prompts) and `acceptance_length/<subset>`.
- Curves over the draft slots (x = slot k, 1 = first drafted token): `by_position/accept_rate` (cumulative), \
`by_position/accept_rate_cond` (conditional), `by_position/accuracy` (teacher-forced); `by_commit/share`: \
share of verify steps committing x tokens. The table view shows a curve's last point: read curves in the chart view.
- DFlash2 drafters also log the unary τ (`acceptance_length_unary`: the drafter without its selector), \
`selector_gain` ± `selector_gain_se` (paired over prompts), `by_position/unary_accuracy` and `by_position/topk_recall` \
(section "DFlash2"; SpecForge's names for them: docs/dflash2.md).
- DSpark drafters also log `markov_gain` ± `markov_gain_se` (τ over the same block without its Markov head), \
`confidence_threshold/<t>/acceptance_length` (verifying the drafts before the first slot whose confidence is below \
t), `confidence_brier` and `by_position/acceptance_predicted` / `acceptance_realised` (calibration; \
`calibration.json`). Every drafter logs `convention_check/acceptance_length_other`: τ read in the other slot \
convention (docs/dspark.md).
- Each run: description (overview), `samples.html`, `plots/`, `per_position.json`, `per_prompt.json`. A `-m` sweep: \
one parent per sweep with `sweep/children.csv` and `sweep/*.png`.
- Open the saved view **dflash: τ and curves** (Saved views, or `...&viewStateShareKey=dflash` in the URL) for τ \
in the table and these charts first. Pair two runs by prompt: `dflash-compare A B`.
"""

DFLASH2_CHARTS = [
    (TAU_UNARY, "BAR"),
    (SELECTOR_GAIN, "BAR"),
    (f"{BY_POSITION}unary_accuracy", "LINE"),
    (f"{BY_POSITION}topk_recall", "LINE"),
]
DSPARK_CHARTS = [
    (MARKOV_GAIN, "BAR"),
    (BRIER, "BAR"),
    (f"{BY_POSITION}acceptance_predicted", "LINE"),
    (f"{BY_POSITION}acceptance_realised", "LINE"),
    (f"{CONVENTION}{TAU}_other", "BAR"),
]
HEADLINE = [
    ("acceptance_length", "BAR"),
    ("by_position/accept_rate", "LINE"),
    ("by_position/accept_rate_cond", "LINE"),
    ("by_position/accuracy", "LINE"),
    ("by_commit/share", "LINE"),
]
COLLAPSED = ["by_position", "expected_acceptance_length", "leak_probe", "time", "Model metrics", "System metrics"]


def eval_view(subsets: Sequence[str]) -> dict[str, Any]:
    """The saved view's state (MLflow 3 ExperimentPageUIState): τ columns in the runs table; charts: the
    headline section (τ, the per-position curves, commits per step), τ per subset, the rest collapsed."""

    def chart(i: int, key: str, kind: str, section: str) -> dict[str, Any]:
        c: dict[str, Any] = {
            "uuid": f"dflash-{i}",
            "type": kind,
            "runsCountToCompare": 10,
            "metricSectionId": section,
            "deleted": False,
            "isGenerated": False,
            "metricKey": key,
        }
        if kind == "LINE":
            c.update(
                selectedMetricKeys=[key],
                xAxisKey="step",
                useGlobalXaxisKey=False,
                lineSmoothness=0,
                useGlobalLineSmoothing=False,
                scaleType="linear",
                xAxisScaleType="linear",
                displayPoints=True,
                selectedXAxisMetricKey="",
                range={"yMin": 0, "yMax": 1} if "/accept" in key or "accuracy" in key or "recall" in key else {},
            )
        return c

    sections = [
        ("dflash-headline", "τ, acceptance by draft slot, commits per step", True),
        ("dflash-subsets", "acceptance_length", True),
    ]
    sections += [(f"dflash-s{i}", name, False) for i, name in enumerate(COLLAPSED)] + [
        ("dflash-dflash2", "DFlash2", False),
        ("dflash-dspark", "DSpark and the slot convention", False),
    ]
    charts = [chart(i, k, t, "dflash-headline") for i, (k, t) in enumerate(HEADLINE)]
    charts += [chart(len(charts) + i, k, t, "dflash-dflash2") for i, (k, t) in enumerate(DFLASH2_CHARTS)]
    charts += [chart(len(charts) + i, k, t, "dflash-dspark") for i, (k, t) in enumerate(DSPARK_CHARTS)]
    charts += [chart(len(charts) + i, f"acceptance_length/{s}", "BAR", "dflash-subsets") for i, s in enumerate(subsets)]
    metric_cols = [
        "acceptance_length",
        "acceptance_length_se",
        *[f"acceptance_length/{s}" for s in subsets],
        "expected_acceptance_length",
    ]
    return {
        "selectedColumns": ["attributes.`Dataset`", *[f"metrics.`{m}`" for m in metric_cols]],
        "compareRunCharts": charts,
        "compareRunSections": [
            {"uuid": u, "name": n, "display": d, "isReordered": False, "deleted": False, "isGenerated": False}
            for u, n, d in sections
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
            known = [
                c["metricKey"].split("/", 1)[1]
                for c in json.loads(json.loads(tags[key])["state"])["compareRunCharts"]
                if c["metricKey"].startswith("acceptance_length/")
            ]
        except (KeyError, ValueError, TypeError):
            known = []
        if NOTE_TAG not in tags:
            client.set_experiment_tag(experiment_id, NOTE_TAG, EXPERIMENT_NOTE)
        if key in tags and set(subsets) <= set(known):
            return
        state = json.dumps(eval_view(sorted(set(known) | set(subsets))))
        envelope = {"name": "dflash: τ and curves", "createdAt": int(time.time() * 1000), "state": state}
        client.set_experiment_tag(experiment_id, key, json.dumps(envelope))


TRAINING_VIEW_KEY = "dflash-training"  # a training run's parent: mlflow.sharedViewState.dflash-training


def training_view(train_accuracy: str | None) -> dict[str, Any]:
    """The saved view of training-run parents: first chart τ and the trainer's accuracy (`train_name`) against the
    training step, on one chart; then expected τ with the teacher-forced accuracy at slots 1-3; the rest collapsed."""

    def line(i: int, keys: list[str]) -> dict[str, Any]:
        return {
            "uuid": f"dflash-training-{i}",
            "type": "LINE",
            "runsCountToCompare": 10,
            "metricSectionId": "dflash-training",
            "deleted": False,
            "isGenerated": False,
            "metricKey": keys[0],
            "selectedMetricKeys": keys,
            "xAxisKey": "step",
            "useGlobalXaxisKey": False,
            "lineSmoothness": 0,
            "useGlobalLineSmoothing": False,
            "scaleType": "linear",
            "xAxisScaleType": "linear",
            "displayPoints": True,
            "selectedXAxisMetricKey": "",
            "range": {},
        }

    first = ["acceptance_length", *([train_name(train_accuracy)] if train_accuracy else [])]
    charts = [
        line(0, first),
        line(1, ["expected_acceptance_length", "accuracy/slot_1", "accuracy/slot_2", "accuracy/slot_3"]),
    ]
    sections = [("dflash-training", "τ and the trainer's accuracy by training step", True)] + [
        (f"dflash-t{i}", name, False) for i, name in enumerate(["acceptance_length", "accuracy", "train", *COLLAPSED])
    ]
    return {
        "selectedColumns": [
            "attributes.`Dataset`",
            "metrics.`acceptance_length`",
            "metrics.`acceptance_length_se`",
            "metrics.`expected_acceptance_length`",
        ],
        "compareRunCharts": charts,
        "compareRunSections": [
            {"uuid": u, "name": n, "display": d, "isReordered": False, "deleted": False, "isGenerated": False}
            for u, n, d in sections
        ],
        "isAccordionReordered": True,
        "hideEmptyCharts": True,
        "runsExpanded": {},
        "runsPinned": [],
        "runsHidden": [],
        "groupBy": None,
        "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0, "selectedXAxisMetricKey": ""},
    }


def setup_training_view(uri: str, experiment_id: str, train_accuracy: str | None) -> None:
    """The saved view "dflash: τ by training step" on the experiment (its first chart: τ and
    `train/<train_accuracy>`)."""
    key = f"mlflow.sharedViewState.{TRAINING_VIEW_KEY}"
    client = mlflow_client(uri)
    state = json.dumps(training_view(train_accuracy))
    with store_lock(uri):
        old = client.get_experiment(experiment_id).tags.get(key)
        if old and json.loads(old).get("state") == state:
            return
        envelope = {"name": "dflash: τ by training step", "createdAt": int(time.time() * 1000), "state": state}
        client.set_experiment_tag(experiment_id, key, json.dumps(envelope))


def training_view_url(experiment_id: str, base: str = "http://127.0.0.1:5000") -> str:
    """The experiment's chart view through the training-run view: τ and training accuracy by step on one chart."""
    return (
        f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&"
        f"viewStateShareKey={TRAINING_VIEW_KEY}&compareRunsMode=CHART"
    )
