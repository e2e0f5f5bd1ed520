"""Entry point: `python -m dflash.compare RUN_A RUN_B [--uri URI]`: is B better or worse than A?

Two evaluation runs (MLflow run ids, or run names such as `fixed@step_1633`: the newest finished
runs of those names that replayed the same prompts) that replayed the same prompts against the
same references are compared prompt
by prompt: the gap in τ, in teacher-forced accuracy at slots 1-3 and (both run with scores=true) in
the reference token's NLL,
each with its paired SE (metrics.paired_ratio_diff). A gap of 2 SE or more is reported as
measurable. Runs over other prompts or other references are refused: their gap mixes drafter and
data. Reads MLflow through dflash.tracking only; exits 2 with a message on bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from dflash.errors import UserError
from dflash.metrics import paired_ratio_diff


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_a", help="baseline: MLflow run id or run name (e.g. fixed@step_1633)")
    ap.add_argument("run_b", help="candidate: MLflow run id or run name")
    ap.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"))
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
    except UserError as e:
        print(f"dflash-compare: error: {e}", file=sys.stderr)
        return 2
    print(render(f"{name_a} ({id_a[:8]})", f"{name_b} ({id_b[:8]})", len(pairs), compare(pairs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
