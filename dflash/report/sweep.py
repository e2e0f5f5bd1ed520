"""A `-m` sweep's comparison: one row per child, and the parent's files.

`sweep_table(children)`: per child the swept values, τ ± SE, τ per subset, and the paired Δτ and its
SE against the first child that finished, the data set (prompts.source) and z-lab's published τ beside it
(dflash/data/published_tau.json) where the drafter is a public one; `sweep_artifacts(children)`: that table as CSV, τ against
the swept value, the children's per-position curves overlaid. From the per-prompt rows each child
logged; dflash/entry.py reads them through dflash.tracking and hands the files to the sweep parent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.report.compare import CompareError, align, compare, table_csv
from dflash.stages.metrics import ratio_se


@dataclass
class Child:
    name: str  # run name
    run_id: str
    values: dict[str, str]  # the swept values, e.g. {"drafter.step": "1633"} (see swept_values)
    rows: list[dict[str, Any]] | None  # per-prompt rows (tracking.load_per_prompt); None: it logged none (failed)
    params: dict[str, str] = field(default_factory=dict)  # the child run's MLflow params (e.g. drafter.name, prompts.source)


def swept_values(overrides: list[list[str]]) -> list[dict[str, str]]:
    """Each child's Hydra overrides (`key=value`) -> only the keys whose values differ across children."""
    parsed = [dict(o.split("=", 1) for o in ov if "=" in o) for ov in overrides]
    keys = list(dict.fromkeys(k for p in parsed for k in p))
    swept = [k for k in keys if len({p.get(k) for p in parsed}) > 1]
    return [{k: p.get(k, "") for k in swept} for p in parsed]


PUBLISHED = Path(__file__).resolve().parents[1] / "data" / "published_tau.json"


def published_tau(params: dict[str, str]) -> float | None:
    """z-lab's published τ for a child's drafter (drafter.name or the path's last part), data set
    (prompts.source) and temperature (references.temperature, default 0.0); None where none is published."""
    tau = json.loads(PUBLISHED.read_text())["tau"]
    names = [params.get("drafter.name") or "", Path(params.get("drafter.path") or "").name]
    drafter = next((n for n in names if n in tau), None)
    temp = str(float(params.get("references.temperature") or 0.0))
    return tau[drafter].get(temp, {}).get(params.get("prompts.source", "")) if drafter else None


def _tau(rows: list[dict[str, Any]]) -> tuple[float, float]:
    num, den = [r["committed"] for r in rows], [r["steps"] for r in rows]
    return (sum(num) / sum(den) if sum(den) else 0.0), ratio_se(num, den)


def sweep_table(children: list[Child]) -> list[dict[str, Any]]:
    """One row per child: run, its swept values, τ ± SE, τ per subset, and Δτ ± paired SE against the
    first child that has rows (`paired_against`); None where a child has no rows or other prompts."""
    done = [c for c in children if c.rows]
    base = done[0] if done else None
    subsets = sorted({r["subset"] for c in done for r in c.rows or []})
    out = []
    for c in children:
        row: dict[str, Any] = {"run": c.name, **c.values}
        tau, se = _tau(c.rows) if c.rows else (None, None)
        row.update(tau=tau, tau_se=se, prompts=len(c.rows) if c.rows else None, dataset=c.params.get("prompts.source"),
                   published_tau=published_tau(c.params))
        for s in subsets:
            sub = [r for r in c.rows or [] if r["subset"] == s]
            row[f"tau/{s}"] = _tau(sub)[0] if sub else None
        row.update(delta_tau=None, delta_tau_se=None, delta_tau_z=None, paired_against=base.name if base else None, note="")
        if c.rows and base is not None:
            try:
                pairs = align(base.rows or [], c.rows)
            except CompareError as e:
                row["note"] = f"not paired: {e}"
            else:
                d = compare(pairs)[0]  # acceptance_length
                row.update(delta_tau=d["diff"], delta_tau_se=d["se"], delta_tau_z=d["z"])
        elif not c.rows:
            row["note"] = "no per-prompt rows (the job failed?)"
        row["run_id"] = c.run_id
        out.append(row)
    return out


def best(table: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The child with the highest τ (None if none finished)."""
    done = [r for r in table if r["tau"] is not None]
    return max(done, key=lambda r: r["tau"]) if done else None


CUMULATIVE = "cumulative acceptance (steps with slot k accepted / steps)"
TEACHER_FORCED = "teacher-forced accuracy (slot k right, any prefix)"


def position_curve(rows: list[dict[str, Any]], cumulative: bool) -> list[float | None]:
    """A run's per-slot curve from its per-prompt rows: cumulative acceptance (needs the rows'
    `accepted_at_pos`) or teacher-forced accuracy; None where undefined."""
    from dflash.report.plots import rates

    K = len(rows[0]["tf_total"])
    if cumulative:
        return rates([sum(r["accepted_at_pos"][k] for r in rows) for k in range(K)], [sum(r["steps"] for r in rows)] * K)
    return rates([sum(r["tf_correct"][k] for r in rows) for k in range(K)], [sum(r["tf_total"][k] for r in rows) for k in range(K)])


def sweep_artifacts(children: list[Child], title: str = "sweep") -> dict[str, bytes]:
    """The sweep parent's files: `sweep/children.csv` (sweep_table), `sweep/tau.png` (τ ± SE against
    the swept value when it is one number per child, else per child), `sweep/per_position.png` (each
    child's cumulative acceptance, or teacher-forced accuracy for runs that did not log it, overlaid)."""
    from dflash.report import plots

    table = sweep_table(children)
    keys = list(dict.fromkeys(k for c in children for k in c.values))
    names = [c.name for c in children]
    labels = [n if names.count(n) == 1 else f"{n} " + ",".join(f"{k}={v}" for k, v in c.values.items()) for n, c in zip(names, children)]
    x, xlabel = None, "child run"
    if len(keys) == 1:
        xlabel = keys[0]
        try:
            x = [float(c.values.get(keys[0], "nan")) for c in children]
        except ValueError:
            labels = [f"{keys[0]}={c.values.get(keys[0], '')}" for c in children]
    files = {
        "sweep/children.csv": table_csv(table).encode(),
        "sweep/tau.png": plots.tau_png(labels, [r["tau"] for r in table], [r["tau_se"] for r in table], x=x, xlabel=xlabel,
                                       title=f"{title}: τ ± SE over prompts, per child"),
    }
    done = [(lab, c.rows) for lab, c in zip(labels, children) if c.rows]
    if done:
        cum = all("accepted_at_pos" in r for _, rows in done for r in rows)
        what = CUMULATIVE if cum else TEACHER_FORCED
        curves = {lab: position_curve(rows, cum) for lab, rows in done}
        files["sweep/per_position.png"] = plots.curves_png(curves, what.split(" (")[0], title=f"{title}: {what}, per child")
    return files


