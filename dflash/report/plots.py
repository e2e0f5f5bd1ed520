"""Plots: PNG figures of one run and of several runs side by side, from plain data.

Pure functions from counters or lists to PNG bytes (matplotlib, Agg backend: no display, no
global figure left open). Conventions are those of dflash/stages/metrics.py and are written on each
figure: τ counts the bonus token (plain decoding = 1); slot k = 1..B-1 is the k-th drafted token.

One run (`dflash.stages.metrics.Counters` summed over prompts):
- `position_curves_png`: per slot k, cumulative acceptance (steps whose slot k was accepted /
  steps, vLLM's), conditional acceptance (accepted at k / accepted at k-1) and teacher-forced
  accuracy (slot k right whatever the earlier slots, over every anchor); DFlash2 also the unary top-1
  accuracy and the unary top-k recall. A 0/0 rate is undefined:
  a gap in the line, never a 0.
- `commit_hist_png`: verify steps by tokens committed (accepted + bonus), τ marked.
- `run_plots`: both, by artifact path (`plots/per_position.png`, `plots/commit_hist.png`).

Several runs (a sweep's children, two compared runs):
- `tau_png` (`tau_figure`): τ ± SE per run, against the swept value where it is one number per run;
  an undefined τ is a gap.
- `curves_png`: one per-position curve per run, overlaid.
- `gaps_png`: paired gaps B − A per metric with ±2 SE bars (two compared runs).

A training run (dflash.report.training_run): `training_run_figure_png`, τ ± SE by training step beside the
trainer's own metrics on a second axis, the trainer's best step and the step of best τ marked.
"""

from __future__ import annotations

import io
import math
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402  (after the backend is chosen)

from dflash.stages.metrics import Counters, acceptance_length, position_curves  # noqa: E402

Curve = Sequence[float | None]  # index k-1 for slot k; None (or NaN) where undefined


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


def _y(curve: Curve) -> list[float]:
    return [math.nan if v is None else float(v) for v in curve]  # NaN: matplotlib leaves a gap


def _slots_axis(ax, n: int, ylabel: str) -> None:
    ax.set_xlabel("draft slot k (1 = first drafted token after the anchor)")
    ax.set_ylabel(ylabel)
    ax.set_xticks(range(1, n + 1))
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)


def position_curves_png(c: Counters, title: str = "") -> bytes:
    r = position_curves(c)
    k = list(range(1, c.block_size))
    fig = Figure(figsize=(7.5, 4.2))
    ax = fig.add_subplot()
    ax.plot(k, _y(r["accept_rate"]), "o-", label="cumulative acceptance: steps with slot k accepted / steps")
    ax.plot(k, _y(r["accept_rate_cond"]), "s--", label="conditional acceptance: accepted at k / accepted at k−1")
    ax.plot(k, _y(r["accuracy"]), "^:", label="teacher-forced accuracy: slot k right, any prefix (every anchor)")
    if c.selector:  # DFlash2: the unary argmax's accuracy and the top-k recall that bounds the selector
        ax.plot(k, _y(r["unary_accuracy"]), "v:", label="DFlash2: teacher-forced unary top-1 accuracy")
        ax.plot(k, _y(r["topk_recall"]), "d-.", label="DFlash2: unary top-k recall (the selector's ceiling)")
    _slots_axis(ax, len(k), "rate")
    ax.legend(fontsize=8, loc="upper right")
    tau = acceptance_length(c)  # None: no verify step (undefined)
    ax.set_title(
        f"{title + ': ' if title else ''}per-position acceptance, τ = {'-' if tau is None else f'{tau:.3f}'} (bonus "
        f"included), "
        f"{c.steps} verify steps",
        fontsize=10,
    )
    if any(v is None for v in r["accept_rate_cond"]):
        fig.text(0.01, -0.02, "gaps: 0/0, no step reached that slot (undefined, not 0)", fontsize=8)
    return _png(fig)


def commit_hist_png(c: Counters, title: str = "") -> bytes:
    counts = c.commit_hist[1:]  # index 0 is never used: a step commits at least the bonus
    x = list(range(1, len(counts) + 1))
    fig = Figure(figsize=(7.5, 3.8))
    ax = fig.add_subplot()
    ax.bar(x, counts, color="#4c72b0")
    tau = acceptance_length(c)
    if tau is not None:  # undefined without a verify step
        ax.axvline(tau, color="#c44e52", ls="--", label=f"τ = {tau:.3f} (mean tokens per step)")
        ax.legend(fontsize=8)
    ax.set_xticks(x)
    ax.set_xlabel("tokens committed by a verify step (accepted drafted tokens + 1 bonus; 1 = none accepted)")
    ax.set_ylabel("verify steps")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"{title + ': ' if title else ''}commit histogram, {c.steps} verify steps", fontsize=10)
    return _png(fig)


def run_plots(c: Counters, title: str = "") -> dict[str, bytes]:
    """The figures a run logs, by artifact path."""
    return {"plots/per_position.png": position_curves_png(c, title), "plots/commit_hist.png": commit_hist_png(c, title)}


def tau_figure(
    labels: Sequence[str],
    taus: Sequence[float | None],
    ses: Sequence[float | None],
    x: Sequence[float] | None = None,
    xlabel: str = "run",
    title: str = "",
    yardstick: float | None = None,
) -> Figure:
    """τ ± SE per run; at `x` (the swept value) when given, else one slot per label. An undefined τ is
    a gap (the line breaks there), an undefined SE no bar. `yardstick`: prompt lookup's τ, one line for all runs."""
    fig = Figure(figsize=(max(6.0, 0.9 * len(labels) + 2), 4.2))
    ax = fig.add_subplot()
    xs = list(x) if x is not None else list(range(len(labels)))
    ax.errorbar(xs, _y(taus), yerr=_y(ses), fmt="o-" if x is not None else "o", capsize=4, label="τ ± SE over prompts")
    if x is None:
        ax.set_xticks(
            xs,
            list(labels),
            rotation=30 if len(labels) > 3 else 0,
            ha="right" if len(labels) > 3 else "center",
            fontsize=8,
        )
    else:
        for i, t in enumerate(taus):
            if t is not None:
                ax.annotate(labels[i], (xs[i], t), textcoords="offset points", xytext=(4, 6), fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":", label="1 = plain decoding")
    if yardstick is not None:
        ax.axhline(yardstick, color="tab:red", lw=0.8, ls="--", label="prompt lookup (n-gram yardstick)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("τ: tokens per verify step (bonus included)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "acceptance length τ per run", fontsize=10)
    return fig


def tau_png(*args, **kw) -> bytes:
    """`tau_figure` as PNG bytes."""
    return _png(tau_figure(*args, **kw))


def curves_png(curves: dict[str, Curve], ylabel: str, title: str = "") -> bytes:
    """One curve per run (label -> values for slots 1..n), overlaid; undefined points are gaps."""
    n = max((len(v) for v in curves.values()), default=0)
    fig = Figure(figsize=(7.5, 4.2))
    ax = fig.add_subplot()
    for label, v in curves.items():
        ax.plot(range(1, len(v) + 1), _y(v), "o-", ms=3, label=label)
    _slots_axis(ax, n, ylabel)
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title(title or ylabel, fontsize=10)
    return _png(fig)


def gaps_png(
    metrics: Sequence[str], diffs: Sequence[float | None], ses: Sequence[float | None], title: str = ""
) -> bytes:
    """Paired gaps B − A per metric (a comparison's rows: metric, diff, se), ±2 SE bars; 0 = no difference. An
    undefined gap (None) is left out of the plot, an undefined SE draws no bar."""
    fig = Figure(figsize=(7.5, 0.45 * len(metrics) + 1.6))
    ax = fig.add_subplot()
    y = list(range(len(metrics)))[::-1]
    ax.errorbar(
        _y(diffs),
        y,
        xerr=_y([None if s is None else 2 * s for s in ses]),
        fmt="o",
        capsize=4,
        label="B − A ± 2 SE (paired by prompt)",
    )
    ax.axvline(0.0, color="grey", lw=0.8)
    ax.set_yticks(y, [m + (" (undefined)" if d is None else "") for m, d in zip(metrics, diffs)], fontsize=8)
    ax.set_xlabel("B − A (higher τ and accuracy are better; lower NLL is better)")
    ax.set_ylim(-0.6, len(metrics) - 0.4)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(title or "paired gaps", fontsize=10)
    return _png(fig)


def training_run_figure_png(
    steps: Sequence[int],
    taus: Sequence[float | None],
    ses: Sequence[float | None],
    superseded: Sequence[tuple[int, float | None]],
    trainer: dict[str, Sequence[tuple[int, float]]],
    unit: str,
    trainer_best: int | None,
    tau_best: int | None,
    title: str = "",
) -> bytes:
    """A training run on one chart: τ ± SE by training step (left axis; evaluations a rewind superseded as grey
    crosses), the trainer's own metrics by step (right axis: {name: [(step, value)]}), the trainer's recorded best
    step and the step of best τ marked."""
    fig = Figure(figsize=(8.0, 4.4))
    ax = fig.add_subplot()
    ax.errorbar(list(steps), _y(taus), yerr=_y(ses), fmt="o-", capsize=3, color="tab:blue", label="τ ± SE (ours)")
    if superseded:
        ax.plot([s for s, _ in superseded], _y([t for _, t in superseded]), "x", color="grey", label="τ, superseded")
    ax.set_xlabel(f"training step ({unit})")
    ax.set_ylabel("τ: tokens per verify step (bonus included)", color="tab:blue")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if trainer:
        ax2 = ax.twinx()
        for (name, pts), style in zip(trainer.items(), ("s--", "d:", "^-.")):
            ax2.plot(
                [s for s, _ in pts], [v for _, v in pts], style, ms=3, color="tab:orange", label=f"trainer: {name}"
            )
        ax2.set_ylabel("the trainer's own metric", color="tab:orange")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if trainer_best is not None:
        handles.append(ax.axvline(trainer_best, color="tab:green", ls="--", lw=1))
        labels.append(f"trainer's best step ({trainer_best})")
    if tau_best is not None:
        i = list(steps).index(tau_best)
        (star,) = ax.plot([tau_best], [taus[i]], "*", ms=14, color="tab:red")
        handles.append(star)
        labels.append(f"best τ (step {tau_best})")
    ax.legend(handles, labels, fontsize=7, loc="best")
    ax.set_title(title or "τ by training step", fontsize=10)
    return _png(fig)
