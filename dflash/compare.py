"""Entry point: `python -m dflash.compare RUN_A RUN_B [--uri URI] [--out DIR] [--log-to RUN_ID]`:
is B better or worse than A? And the sweep parent's table of its children.

Two evaluation runs (MLflow run ids, or run names such as `fixed@step_1633`: the newest finished
runs of those names that replayed the same prompts) that replayed the same prompts against the
same references are compared prompt by prompt: the gap in τ, in teacher-forced accuracy at slots
1-3 and (both run with scores=true) in the reference token's NLL, each with its paired SE
(metrics.paired_ratio_diff). A gap of 2 SE or more is reported as measurable. Runs over other
prompts or other references are refused: their gap mixes drafter and data. The table prints; with
`--out DIR` it is also written as `compare_<A>_vs_<B>.csv` with a plot of the gaps (`.png`), and
`--log-to RUN_ID` logs both to that run under `compare/`.

A sweep: `sweep_table(children)` (one row per child: the swept values, τ ± SE, τ per subset, the
paired Δτ and its SE against the first child that finished) and `sweep_artifacts(children)` (that
table as CSV, τ against the swept value, the children's per-position curves overlaid), from the
per-prompt rows each child logged (`tracking.load_per_prompt`).

Reads MLflow through dflash.tracking only; exits 2 with a message on bad input.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.errors import UserError
from dflash.metrics import paired_ratio_diff, ratio_se


class CompareError(UserError):
    pass


def align(rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Pair the rows by prompt id; refuse other prompt sets or references (new_tokens differ)."""
    a, b = {r["id"]: r for r in rows_a}, {r["id"]: r for r in rows_b}
    if a.keys() != b.keys():
        raise CompareError(f"the runs replayed different prompts ({len(a.keys() - b.keys())} only in A, {len(b.keys() - a.keys())} only in B): "
                           "evaluate both with the same prompts=... and prompts.num_prompts, or pass run ids")
    diff = [i for i in a if a[i]["new_tokens"] != b[i]["new_tokens"]]
    if diff:
        raise CompareError(f"{len(diff)} prompts have references of other lengths (e.g. {diff[0]!r}): the runs used other references "
                           "(another target, dtype or max_new_tokens); compare runs of one target setting")
    for r in (*rows_a, *rows_b):
        if "committed" not in r or "tf_correct" not in r:
            raise CompareError("a run was logged by an older dflash-eval (no per-prompt counters): evaluate it again")
    return [(a[i], b[i]) for i in a]


def compare(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    """-> rows {metric, a, b, diff, se, z}: τ overall and per subset, tf accuracy at slots 1-3, NLL."""
    def row(name: str, pp: list, num, den) -> dict[str, Any]:
        na, da = [num(x) for x, _ in pp], [den(x) for x, _ in pp]
        nb, db = [num(y) for _, y in pp], [den(y) for _, y in pp]
        d, se = paired_ratio_diff(na, da, nb, db)
        a = sum(na) / sum(da) if sum(da) else 0.0
        return {"metric": name, "a": a, "b": a + d, "diff": d, "se": se, "z": d / se if se else 0.0}

    out = [row("acceptance_length", pairs, lambda r: r["committed"], lambda r: r["steps"])]
    subsets = sorted({x["subset"] for x, _ in pairs})
    if len(subsets) > 1:
        out += [row(f"acceptance_length/{s}", [p for p in pairs if p[0]["subset"] == s], lambda r: r["committed"], lambda r: r["steps"]) for s in subsets]
    for k in range(3):
        out.append(row(f"accuracy/pos_{k + 1:02d}", pairs, lambda r, k=k: r["tf_correct"][k], lambda r, k=k: r["tf_total"][k]))
    if all(x.get("tf_nll") is not None and y.get("tf_nll") is not None for x, y in pairs):  # both ran with scores=true
        out.append(row("nll_mean", pairs, lambda r: r["tf_nll"], lambda r: sum(r["tf_total"])))
    return out


def render(name_a: str, name_b: str, n: int, rows: list[dict[str, Any]]) -> str:
    lines = [f"A = {name_a}   B = {name_b}   {n} prompts, paired by prompt", f"{'metric':<28}{'A':>8}{'B':>8}{'B-A':>9}{'± SE':>8}{'z':>7}"]
    for r in rows:
        verdict = "" if abs(r["z"]) < 2 else ("  B higher" if r["diff"] > 0 else "  B lower")
        lines.append(f"{r['metric']:<28}{r['a']:>8.3f}{r['b']:>8.3f}{r['diff']:>+9.3f}{r['se']:>8.3f}{r['z']:>+7.1f}{verdict}")
    lines.append("|z| >= 2: a measurable gap (lower NLL is better; higher τ and accuracy are better)")
    return "\n".join(lines)


def table_csv(rows: list[dict[str, Any]]) -> str:
    """Rows as CSV, columns in order of first appearance; floats to 6 significant digits, None empty."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for r in rows:
        w.writerow(["" if r.get(c) is None else f"{r[c]:.6g}" if isinstance(r[c], float) else r[c] for c in cols])
    return buf.getvalue()


def compare_artifacts(name_a: str, name_b: str, rows: list[dict[str, Any]]) -> dict[str, bytes]:
    """The comparison as files: `compare_<A>_vs_<B>.csv` (compare's rows) and `.png` (the gaps)."""
    from dflash import plots

    stem = re.sub(r"[^A-Za-z0-9_.@=-]+", "_", f"compare_{name_a}_vs_{name_b}")
    png = plots.gaps_png(rows, title=f"B = {name_b}  minus  A = {name_a}, paired by prompt")
    return {f"{stem}.csv": table_csv(rows).encode(), f"{stem}.png": png}


# --- a sweep: one row per child ------------------------------------------------------------------


@dataclass
class Child:
    name: str  # run name
    run_id: str
    values: dict[str, str]  # the swept values, e.g. {"drafter.step": "1633"} (see swept_values)
    rows: list[dict[str, Any]] | None  # per-prompt rows (tracking.load_per_prompt); None: it logged none (failed)


def swept_values(overrides: list[list[str]]) -> list[dict[str, str]]:
    """Each child's Hydra overrides (`key=value`) -> only the keys whose values differ across children."""
    parsed = [dict(o.split("=", 1) for o in ov if "=" in o) for ov in overrides]
    keys = list(dict.fromkeys(k for p in parsed for k in p))
    swept = [k for k in keys if len({p.get(k) for p in parsed}) > 1]
    return [{k: p.get(k, "") for k in swept} for p in parsed]


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
        row.update(tau=tau, tau_se=se, prompts=len(c.rows) if c.rows else None)
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
    from dflash.plots import rates

    K = len(rows[0]["tf_total"])
    if cumulative:
        return rates([sum(r["accepted_at_pos"][k] for r in rows) for k in range(K)], [sum(r["steps"] for r in rows)] * K)
    return rates([sum(r["tf_correct"][k] for r in rows) for k in range(K)], [sum(r["tf_total"][k] for r in rows) for k in range(K)])


def sweep_artifacts(children: list[Child], title: str = "sweep") -> dict[str, bytes]:
    """The sweep parent's files: `sweep/children.csv` (sweep_table), `sweep/tau.png` (τ ± SE against
    the swept value when it is one number per child, else per child), `sweep/per_position.png` (each
    child's cumulative acceptance, or teacher-forced accuracy for runs that did not log it, overlaid)."""
    from dflash import plots

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


def _write(out_dir: Path, files: dict[str, bytes]) -> list[Path]:
    """Each file to a temporary name, then renamed: nothing half-written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in files.items():
        path = out_dir / name
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_a", help="baseline: MLflow run id or run name (e.g. fixed@step_1633)")
    ap.add_argument("run_b", help="candidate: MLflow run id or run name")
    ap.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"))
    ap.add_argument("--out", type=Path, help="also write the table (CSV) and a plot of the gaps (PNG) into this folder")
    ap.add_argument("--log-to", metavar="RUN_ID", help="also log the table and the plot to this MLflow run, under compare/")
    args = ap.parse_args(argv)
    from dflash import tracking

    try:
        runs_a, runs_b = tracking.find_runs(args.uri, args.run_a), tracking.find_runs(args.uri, args.run_b)
        for arg, found in ((args.run_a, runs_a), (args.run_b, runs_b)):
            if not found:
                raise CompareError(f"no finished run with id or name {arg!r} in {args.uri}; list them with: mlflow ui --backend-store-uri {args.uri}")
        rows: dict[str, list[dict[str, Any]]] = {}

        def per_prompt(run_id: str) -> list[dict[str, Any]]:
            if run_id not in rows:
                rows[run_id] = tracking.load_per_prompt(args.uri, run_id)
            return rows[run_id]

        def same_prompts(a: tuple[str, str], b: tuple[str, str]) -> bool:
            return {r["id"] for r in per_prompt(a[0])} == {r["id"] for r in per_prompt(b[0])}

        # the newest pair over the same prompts, else the two newest (align then says why not)
        (id_a, name_a), (id_b, name_b) = next(((a, b) for a in runs_a for b in runs_b if same_prompts(a, b)), (runs_a[0], runs_b[0]))
        pairs = align(per_prompt(id_a), per_prompt(id_b))
        table = compare(pairs)
        print(render(f"{name_a} ({id_a[:8]})", f"{name_b} ({id_b[:8]})", len(pairs), table))
        files = compare_artifacts(name_a, name_b, table) if args.out or args.log_to else {}
        if args.out:
            for path in _write(args.out, files):
                print(f"wrote {path}")
        if args.log_to:
            tracking.log_files(args.uri, args.log_to, {f"compare/{k}": v for k, v in files.items()})
            print(f"logged {', '.join(files)} to run {args.log_to} under compare/")
    except UserError as e:
        print(f"dflash-compare: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"dflash-compare: error: cannot write {e.filename}: {e.strerror}; pass a writable --out folder", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
