"""A `-m` sweep's comparison: one row per child, and the parent's files.

`Child.read` types what the store holds of a child (its per-prompt rows as `PromptRow`s, its target
and dtype as a `RunIdentity`; rows an older dflash-eval logged are refused with a note);
`sweep_table(children)`: per child a `SweepRow`: the swept values (a swept group such as `prompts` by its choice), τ ±
SE, the
prompts replayed (`num_prompts`), τ per subset, and the paired Δτ and its
SE against the first child that finished, paired only where `compare.align` pairs them (else why not,
naming the prompts that differ), the data set (prompts.source) and z-lab's published τ beside it
(dflash/data/published_tau.json) where the drafter is a public one on the target it was published with;
`sweep_artifacts(children)`: that
table as CSV, τ against the swept value, the children's per-position curves overlaid. `yardstick_once`: prompt lookup's
τ when every
child that logged one has the same (its references and block size agree), shown once. Undefined (no
verify step; an SE over one prompt) stays None: an empty cell, a gap in a plot, never the best child.
dflash/cli/app.py reads the children through dflash.tracking and hands the files to the sweep parent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from dflash.report.pairs import CompareError, RunIdentity, align, compare, rows_of, table_csv
from dflash.stages.metrics import PromptRow, Rate, acceptance_length, position_curves, ratio_se, row_counters
from dflash.stages.prompts.benchmarks import BENCHMARKS


@dataclass
class Child:
    name: str  # run name
    run_id: str
    values: dict[str, str]  # the swept values, e.g. {"drafter.step": "1633"} (see swept_values)
    rows: list[PromptRow] | None  # per-prompt rows; None: it logged none (failed) or they were refused (`note`)
    params: dict[str, str] = field(
        default_factory=dict
    )  # the child run's MLflow params (e.g. drafter.name, prompts.source)
    identity: RunIdentity = field(default_factory=RunIdentity)  # its target and dtype
    note: str = ""  # why its rows were refused
    prompt_lookup_tau: Rate = (
        None  # the yardstick's τ on its references (dflash.stages.replay.prompt_lookup); None: not logged
    )

    @classmethod
    def read(
        cls,
        name: str,
        run_id: str,
        values: dict[str, str],
        rows: list[dict[str, Any]] | None,
        params: dict[str, str],
        identity: RunIdentity,
        prompt_lookup_tau: Rate = None,
    ) -> "Child":
        """A child from what the store holds (per_prompt.json's dicts, its params, its target and dtype, the yardstick's
        τ)."""
        try:
            typed, note = (rows_of(rows) if rows is not None else None), ""
        except CompareError as e:
            typed, note = None, str(e)
        return cls(name, run_id, values, typed, params, identity, note, prompt_lookup_tau)


def swept_values(overrides: list[list[str]]) -> list[dict[str, str]]:
    """Each child's Hydra overrides (`key=value`) -> only the keys whose values differ across children."""
    parsed = [dict(o.split("=", 1) for o in ov if "=" in o) for ov in overrides]
    keys = list(dict.fromkeys(k for p in parsed for k in p))
    swept = [k for k in keys if len({p.get(k) for p in parsed}) > 1]
    return [{k: p.get(k, "") for k in swept} for p in parsed]


def _tau(rows: list[PromptRow]) -> tuple[Rate, Rate]:
    """τ and its SE over the rows; None where undefined (no verify step; fewer than 2 prompts)."""
    return acceptance_length(row_counters(rows)), ratio_se([r.committed for r in rows], [r.steps for r in rows])


PUBLISHED = Path(__file__).resolve().parents[1] / "data" / "published_tau.json"


def _norm(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def published_tau(params: dict[str, str]) -> float | None:
    """z-lab's published τ for a child's drafter (drafter.name or the path's last part) on the target it was
    published with (target.name or the target path's last part, e.g. qwen3_8b or /models/Qwen3-8B), data
    set (prompts.source) and temperature (references.temperature, default 0.0); None where none is published."""
    data = json.loads(PUBLISHED.read_text())
    names = [params.get("drafter.name") or "", Path(params.get("drafter.path") or "").name]
    drafter = next((n for n in names if n in data["tau"]), None)
    if drafter is None:
        return None
    target = _norm(data["target"][drafter])
    if target not in {_norm(params.get("target.name") or ""), _norm(Path(params.get("target.path") or "").name)}:
        return None  # the public drafter on another target: no published figure applies
    temp = str(float(params.get("references.temperature") or 0.0))
    return data["tau"][drafter].get(temp, {}).get(params.get("prompts.source", ""))


PUBLISHED_SETTING = {
    "prompts.max_new_tokens": "2048",
    "target.template.enable_thinking": "False",
    "prompts.selection": "hf_shuffle",
    "prompts.seed": "0",
}  # published_tau.json's "setting": z-lab 2026-01's lengths, thinking mode and subset


def published_setting_differs(params: dict[str, str]) -> str:
    """What of a child's setting differs from the one its published τ was measured in (length, thinking
    mode, subset rule and size: published_tau.json's "setting", the data set's count): '' where none does."""
    out = [
        f"{k.split('.')[-1]} {params.get(k)} (published: {v})"
        for k, v in PUBLISHED_SETTING.items()
        if k in params and str(params[k]).lower() != v.lower()
    ]
    bench = BENCHMARKS.get(params.get("prompts.source", ""))
    if bench and params.get("prompts.num_prompts") not in (None, "None", str(bench.num_prompts)):
        out.append(f"num_prompts {params['prompts.num_prompts']} (published: {bench.num_prompts})")
    return "; ".join(out)


@dataclass(frozen=True)
class SweepRow:
    """One child in the sweep table; None where undefined (no verify step, an SE over one prompt) or not paired."""

    run: str  # the child's run name
    values: dict[str, str]  # its swept values (swept_values)
    tau: Rate
    tau_se: Rate
    num_prompts: int | None  # prompts replayed; None: no rows
    dataset: str | None  # prompts.source
    published_tau: float | None  # z-lab's, where one applies (published_tau)
    published_differs: (
        str  # where published_tau is set: what of this child's setting differs from the published one ('' if none)
    )
    tau_by_subset: dict[str, Rate]  # every subset of the sweep; None where the child has none of it
    delta_tau: Rate = None  # paired Δτ against `paired_against`, its SE and z
    delta_tau_se: Rate = None
    delta_tau_z: Rate = None
    paired_against: str | None = None  # the first child that has rows
    not_paired: str = ""  # why compare.align refused to pair it with `paired_against`
    note: str = ""  # why it has no rows (refused, or the job failed)
    run_id: str = ""
    prompt_lookup_tau: Rate = (
        None  # the yardstick on its references (the same for children of one reference and block setting)
    )

    def to_dict(self) -> dict[str, Any]:
        """The row as sweep/children.csv holds it: run, the swept values, τ, ..., τ per subset, Δτ, ..., note, run
        id."""
        return {
            "run": self.run,
            **self.values,
            "tau": self.tau,
            "tau_se": self.tau_se,
            "num_prompts": self.num_prompts,
            "dataset": self.dataset,
            "published_tau": self.published_tau,
            "published_setting_differs": self.published_differs,
            "prompt_lookup_tau": self.prompt_lookup_tau,
            **{f"tau/{k}": v for k, v in self.tau_by_subset.items()},
            "delta_tau": self.delta_tau,
            "delta_tau_se": self.delta_tau_se,
            "delta_tau_z": self.delta_tau_z,
            "paired_against": self.paired_against,
            "note": f"not paired: {self.not_paired}" if self.not_paired else self.note,
            "run_id": self.run_id,
        }


def sweep_table(children: list[Child]) -> list[SweepRow]:
    """One row per child: run, its swept values, τ ± SE, τ per subset, and Δτ ± paired SE against the
    first child that has rows (`paired_against`); None where a child has no rows or does not pair."""
    done = [c for c in children if c.rows]
    base = done[0] if done else None
    subsets = sorted({r.subset for c in done for r in c.rows or []})
    out = []
    for c in children:
        rows = c.rows or []
        tau, se = _tau(rows) if rows else (None, None)
        by_subset = {s: _tau(sub)[0] if (sub := [r for r in rows if r.subset == s]) else None for s in subsets}
        delta: tuple[Rate, Rate, Rate] = (None, None, None)
        not_paired, note = "", c.note
        if rows and base is not None:
            try:
                pairs = align(base.rows or [], rows, base.identity, c.identity)
            except CompareError as e:
                not_paired = str(e)
            else:
                d = compare(pairs)[0]  # acceptance_length
                delta = (d.diff, d.se, d.z)
        elif not c.note and not rows:
            note = "no per-prompt rows (the job failed?)"
        pub = published_tau(c.params)
        out.append(
            SweepRow(
                c.name,
                c.values,
                tau,
                se,
                len(rows) if rows else None,
                c.params.get("prompts.source"),
                pub,
                published_setting_differs(c.params) if pub is not None else "",
                by_subset,
                *delta,
                base.name if base else None,
                not_paired,
                note,
                c.run_id,
                c.prompt_lookup_tau,
            )
        )
    return out


def yardstick_once(table: Sequence[SweepRow]) -> Rate:
    """Prompt lookup's τ shown once beside a sweep: the one value every child that logged it shares; None when
    none did or they differ (children of other references or block sizes: then it stays per child)."""
    taus = {r.prompt_lookup_tau for r in table if r.prompt_lookup_tau is not None}
    return taus.pop() if len(taus) == 1 else None


def best(table: list[SweepRow]) -> SweepRow | None:
    """The child with the highest τ (None if no child measured one)."""
    done = [r for r in table if r.tau is not None]
    return max(done, key=lambda r: r.tau) if done else None  # type: ignore[arg-type, return-value]


CUMULATIVE = "cumulative acceptance (steps with slot k accepted / steps)"


def position_curve(rows: list[PromptRow]) -> list[Rate]:
    """A run's cumulative acceptance per slot from its per-prompt rows (metrics.position_curves); None where
    undefined."""
    return position_curves(row_counters(rows))["accept_rate"]


def sweep_artifacts(children: list[Child], title: str = "sweep") -> dict[str, bytes]:
    """The sweep parent's files: `sweep/children.csv` (sweep_table), `sweep/tau.png` (τ ± SE against
    the swept value when it is one number per child, else per child; a gap where τ is undefined),
    `sweep/per_position.png` (each child's cumulative acceptance, overlaid)."""
    from dflash.report import plots

    table = sweep_table(children)
    keys = list(dict.fromkeys(k for c in children for k in c.values))
    names = [c.name for c in children]
    labels = [
        n if names.count(n) == 1 else f"{n} " + ",".join(f"{k}={v}" for k, v in c.values.items())
        for n, c in zip(names, children)
    ]
    x, xlabel = None, "child run"
    if len(keys) == 1:
        xlabel = keys[0]
        try:
            x = [float(c.values.get(keys[0], "nan")) for c in children]
        except ValueError:
            labels = [f"{keys[0]}={c.values.get(keys[0], '')}" for c in children]
    files = {
        "sweep/children.csv": table_csv([r.to_dict() for r in table]).encode(),
        "sweep/tau.png": plots.tau_png(
            labels,
            [r.tau for r in table],
            [r.tau_se for r in table],
            x=x,
            xlabel=xlabel,
            title=f"{title}: τ ± SE over prompts, per child",
            yardstick=yardstick_once(table),
        ),
    }
    curves = {lab: position_curve(c.rows) for lab, c in zip(labels, children) if c.rows}
    if curves:
        files["sweep/per_position.png"] = plots.curves_png(
            curves, CUMULATIVE.split(" (")[0], title=f"{title}: {CUMULATIVE}, per child"
        )
    return files
