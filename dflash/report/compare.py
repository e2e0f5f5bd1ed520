"""Two runs paired prompt by prompt: is B better or worse than A?

`align` pairs the per-prompt rows of two evaluation runs by prompt id and refuses runs over other
prompts or other references; `compare` gives the gap in τ (overall and per subset), in teacher-forced
accuracy at slots 1-3 and (both run with scores=true) in the reference token's NLL, each with its
paired SE (metrics.paired_ratio_diff); `render` prints it, `compare_artifacts` writes it as CSV and a
plot of the gaps. Plain functions over the rows `per_prompt.json` holds; no MLflow here (the CLI,
dflash/compare.py, reads the runs through dflash.tracking).
"""

from __future__ import annotations

import csv
import io
import re
from typing import Any

from dflash.stages.metrics import paired_ratio_diff
from dflash.util.errors import UserError


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
        out += [
            row(f"acceptance_length/{s}", [p for p in pairs if p[0]["subset"] == s], lambda r: r["committed"], lambda r: r["steps"]) for s in subsets
        ]
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
    from dflash.report import plots

    stem = re.sub(r"[^A-Za-z0-9_.@=-]+", "_", f"compare_{name_a}_vs_{name_b}")
    png = plots.gaps_png(rows, title=f"B = {name_b}  minus  A = {name_a}, paired by prompt")
    return {f"{stem}.csv": table_csv(rows).encode(), f"{stem}.png": png}
