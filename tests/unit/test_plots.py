"""dflash.report.plots: PNG figures from the counters a replay produces (no model), undefined rates as gaps."""

from __future__ import annotations

import io
import math
import random

import pytest
from PIL import Image

from dflash.report import plots
from dflash.stages.metrics import Counters, position_curves
from dflash.stages.replay.loop import replay, teacher_forced


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    img = Image.open(io.BytesIO(data))
    img.verify()  # a complete, uncorrupted PNG
    return img.size


@pytest.fixture(scope="module")
def counters() -> Counters:
    """Counters of a replay over a random reference whose drafter is right less often at later slots."""
    rng, B, P = random.Random(0), 16, 10
    seq = [rng.randrange(50) for _ in range(200)]
    props = [
        [seq[p + k] if p + k < len(seq) and rng.random() < 0.9 * 0.8**k else -1 for k in range(1, B)]
        for p in range(P, len(seq) - 1)
    ]
    c, _ = replay(seq, P, props, B)
    teacher_forced(seq, P, props, c)
    return c


def test_position_rates_leave_undefined_points_out(counters):
    r = position_curves(counters)
    last = max(k for k, n in enumerate(counters.accepted_at_pos) if n)  # the last slot any step accepted
    assert r["accept_rate"] == [n / counters.steps for n in counters.accepted_at_pos]
    assert r["accept_rate_cond"][0] == counters.accepted_at_pos[0] / counters.steps
    assert r["accept_rate_cond"][last + 1] == 0.0  # reached, never accepted: a real 0
    assert all(v is None for v in r["accept_rate_cond"][last + 2 :]) and last + 2 < 15  # never reached: 0/0, undefined
    assert r["accuracy"] == [h / t for h, t in zip(counters.tf_correct, counters.tf_total)]
    empty = position_curves(Counters(block_size=4))
    assert "nll" not in empty
    assert all(v is None for curve in empty.values() for v in curve)


def test_run_plots_are_pngs(counters):
    figs = plots.run_plots(counters, "fixed@step_5037")
    assert set(figs) == {"plots/per_position.png", "plots/commit_hist.png"}
    for data in figs.values():
        w, h = png_size(data)
        assert 500 < w < 1200 and 250 < h < 800 and len(data) < 200_000
    for data in plots.run_plots(Counters(block_size=4)).values():  # no step at all: still a figure, all gaps
        png_size(data)


def test_sweep_and_compare_plots_are_pngs(counters):
    png_size(
        plots.tau_png(
            ["a@step_1", "a@step_2", "failed"], [1.5, 1.7, None], [0.05, 0.06, None], x=[1, 2, 3], xlabel="drafter.step"
        )
    )
    png_size(plots.tau_png(["fixed", "final_layer"], [1.79, 1.56], [0.07, 0.06]))
    png_size(
        plots.curves_png(
            {"a": position_curves(counters)["accept_rate"], "b": [0.4, math.nan, None] + [0.0] * 12},
            "cumulative acceptance",
        )
    )
    png_size(
        plots.gaps_png(["acceptance_length", "accuracy/pos_01", "nll_mean"], [-0.2, 0.01, None], [0.02, 0.0, None])
    )


@pytest.mark.parametrize("swept", [True, False])
def test_tau_plot_leaves_a_gap_where_tau_is_undefined(swept):
    """tau.png over steps (x = the swept value) or over runs: a run with no verify step (τ None, SE None) is a gap
    in the line, with no point, no error bar and no label; nothing is drawn at 0 for it."""
    labels, taus, ses = (
        ["a@step_1", "a@step_2", "a@step_3", "a@step_4"],
        [1.5, None, 1.7, 1.6],
        [0.05, None, 0.06, None],
    )
    fig = plots.tau_figure(labels, taus, ses, x=[1, 2, 3, 4] if swept else None, xlabel="drafter.step")
    ax = fig.axes[0]
    line, caps, (bars,) = ax.containers[0].lines
    y = list(line.get_ydata())
    assert (
        y[0] == 1.5 and y[2:] == [1.7, 1.6] and math.isnan(y[1])
    )  # the undefined point: NaN, which matplotlib leaves out
    assert list(line.get_xdata()) == ([1, 2, 3, 4] if swept else [0, 1, 2, 3])  # every run keeps its place on the axis
    assert [len(s) for s in bars.get_segments()] == [2, 0, 2, 0]  # an error bar only where an SE is defined
    assert ax.get_ylim()[0] > 0.5  # nothing at 0: the axis spans the measured τ (and the 1 = plain decoding line) only
    if swept:
        assert [t.get_text() for t in ax.texts] == ["a@step_1", "a@step_3", "a@step_4"]  # no label on the gap
    png_size(plots.tau_png(labels, taus, ses, x=[1, 2, 3, 4] if swept else None))
