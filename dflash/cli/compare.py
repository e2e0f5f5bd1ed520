"""Entry point: `dflash-compare RUN_A RUN_B [--uri URI] [--out DIR] [--log-to RUN_ID]`:
is B better or worse than A?

Two evaluation runs (MLflow run ids, or run names such as `fixed@step_1633`: the newest finished
runs of those names that pair) that replayed the same prompts against the same references, on one
target and dtype, are compared prompt by prompt (dflash/report/pairs.py): the gap in τ, in
teacher-forced accuracy at slots 1-3 and (both run with scores=true) in the reference token's NLL,
each with its paired SE. A gap of 2 SE or more is reported as measurable. Runs over other prompts,
other references (each per-prompt row's digest of its reference ids), another target or dtype are
refused, naming the prompts that differ: their gap mixes drafter and data. The table prints; with
`--out DIR` it is also written as `compare_<A>_vs_<B>.csv` with a plot of the gaps (`.png`), and
`--log-to RUN_ID` logs both to that run under `compare/`. Exits 2 with a message on bad input. Where
run names are given and the newest runs of those names do not pair, the newest pair that does is
compared and the pairs skipped are named on stderr, with why.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dflash.report.pairs import CompareError, RunIdentity, align, compare, compare_artifacts, render, rows_of
from dflash.stages.metrics import PromptRow
from dflash.util.errors import UserError
from dflash.util.files import atomic_write_bytes


def _identity(t) -> RunIdentity:
    """A run's target and dtype as dflash.tracking reads them back (`RunTags`)."""
    return RunIdentity(t.target_identity, t.dtype)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dflash-compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_a", help="baseline: MLflow run id or run name (e.g. fixed@step_1633)")
    ap.add_argument("run_b", help="candidate: MLflow run id or run name")
    ap.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"))
    ap.add_argument("--out", type=Path, help="also write the table (CSV) and a plot of the gaps (PNG) into this folder")
    ap.add_argument(
        "--log-to", metavar="RUN_ID", help="also log the table and the plot to this MLflow run, under compare/"
    )
    args = ap.parse_args(argv)
    from dflash import tracking

    try:
        runs_a, runs_b = tracking.find_runs(args.uri, args.run_a), tracking.find_runs(args.uri, args.run_b)
        for arg, found in ((args.run_a, runs_a), (args.run_b, runs_b)):
            if not found:
                raise CompareError(
                    f"no finished run with id or name {arg!r} in {args.uri}; list them with: mlflow ui "
                    f"--backend-store-uri {args.uri}"
                )
        rows: dict[str, tuple[list[PromptRow], RunIdentity]] = {}

        def run(run_id: str) -> tuple[list[PromptRow], RunIdentity]:
            if run_id not in rows:
                tags = tracking.RunTags.of(tracking.run_tags(args.uri, run_id))
                rows[run_id] = rows_of(tracking.load_per_prompt(args.uri, run_id)), _identity(tags)
            return rows[run_id]

        def newest_pair() -> tuple[str, str, str, str, list[tuple[PromptRow, PromptRow]]]:
            """The newest pair of runs that pairs (same prompts, digests, target and dtype), else why the newest does
            not.
            Newer pairs skipped on the way are named on stderr, with why."""
            skipped: list[tuple[str, CompareError]] = []
            for id_a, name_a in runs_a:
                for id_b, name_b in runs_b:
                    (rows_a, who_a), (rows_b, who_b) = run(id_a), run(id_b)
                    try:
                        pairs = align(rows_a, rows_b, who_a, who_b)
                    except CompareError as e:
                        skipped.append((f"  {name_a} ({id_a[:8]}) vs {name_b} ({id_b[:8]}): {e}", e))
                        continue
                    if skipped:
                        print(
                            f"dflash-compare: skipped {len(skipped)} pair(s) of runs of these names that do not pair "
                            f"(newest first):\n"
                            + "\n".join(line for line, _ in skipped[:5])
                            + ("\n  ..." if len(skipped) > 5 else "")
                            + f"\ncomparing the newest pair that does: {name_a} ({id_a[:8]}) vs {name_b} ({id_b[:8]})",
                            file=sys.stderr,
                        )
                    return id_a, name_a, id_b, name_b, pairs
            raise skipped[0][1] if skipped else CompareError("no pair of runs")

        id_a, name_a, id_b, name_b, pairs = newest_pair()
        table = compare(pairs)
        print(render(f"{name_a} ({id_a[:8]})", f"{name_b} ({id_b[:8]})", len(pairs), table))
        files = compare_artifacts(name_a, name_b, table) if args.out or args.log_to else {}
        if args.out:
            for name, data in files.items():
                atomic_write_bytes(args.out / name, data)
                print(f"wrote {args.out / name}")
        if args.log_to:
            tracking.log_files(args.uri, args.log_to, {f"compare/{k}": v for k, v in files.items()})
            print(f"logged {', '.join(files)} to run {args.log_to} under compare/")
    except UserError as e:
        print(f"dflash-compare: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(
            f"dflash-compare: error: cannot write {e.filename}: {e.strerror}; pass a writable --out folder",
            file=sys.stderr,
        )
        return 2
    return 0


def cli() -> None:
    """The console script `dflash-compare`."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
