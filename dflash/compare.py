"""Entry point: `python -m dflash.compare RUN_A RUN_B [--uri URI] [--out DIR] [--log-to RUN_ID]`:
is B better or worse than A?

Two evaluation runs (MLflow run ids, or run names such as `fixed@step_1633`: the newest finished
runs of those names that replayed the same prompts) that replayed the same prompts against the
same references are compared prompt by prompt (dflash/report/compare.py): the gap in τ, in
teacher-forced accuracy at slots 1-3 and (both run with scores=true) in the reference token's NLL,
each with its paired SE. A gap of 2 SE or more is reported as measurable. Runs over other prompts
or other references are refused: their gap mixes drafter and data. The table prints; with
`--out DIR` it is also written as `compare_<A>_vs_<B>.csv` with a plot of the gaps (`.png`), and
`--log-to RUN_ID` logs both to that run under `compare/`. Exits 2 with a message on bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from dflash.report.compare import CompareError, align, compare, compare_artifacts, render
from dflash.util.errors import UserError


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
