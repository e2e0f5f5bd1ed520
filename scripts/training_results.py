"""Writes docs/training_results.md from the raw logs of every training round in scripts/results/, newest first.

    python scripts/training_results.py [ROUND]        (default: every round, newest first)

A round is a date, with a letter after it for a later round of that date (2026-12-06b). Reads, all under
scripts/results/, per round:
- `train_<machine>_<ROUND>.log`: the trainer's log (data lines, per-variant rows every metrics_every steps);
- `eval_cpu_<ROUND>/*.log`: one `python evaluate.py` summary per drafter and step (builtin prompts);
- `compare_cpu_<ROUND>.log`: `python -m dflash.compare` tables (paired gaps), copied verbatim;
- `humaneval_cpu_<ROUND>/*.log` and `compare_humaneval_cpu_<ROUND>.log`: the same on HumanEval-164;
- `bench_*_<ROUND>.log`: the benches, named with their headers.
Every figure on the page comes from those files; nothing is typed in by hand.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PAGE = Path(__file__).resolve().parents[1] / "docs" / "training_results.md"


@dataclass(frozen=True)
class Eval:
    name: str
    step: int
    layers: str
    taps: str
    tau: str
    tau_se: str
    fresh: str
    train_like: str
    leak_gain: str
    extra: str  # DFlash2: the selector's lines


def parse_eval(text: str) -> Eval | None:
    head = re.search(r"^== (\S+)@step_(\d+)", text, re.M)
    tau = re.search(r"acceptance length τ \(bonus included, token-weighted\): ([\d.]+) ± ([\d.]+)", text)
    if not head or not tau:
        return None
    sub = re.search(r"τ per subset: fresh ([\d.]+)\s+train_like ([\d.]+)", text)
    leak = re.search(r"leak probe: .*\(gain ([+\-][\d.]+)\)", text)
    layers = re.search(r"num_layers=(\d+)", text)
    taps = re.search(r"target_layer_ids=\[([\d, ]+)\]", text)
    shipped = "the shipped default" in text.splitlines()[0]
    name = head.group(1) + (" (shipped, earlier round)" if shipped else "")
    return Eval(name, int(head.group(2)), layers.group(1) if layers else "-", taps.group(1).replace(" ", "") if taps else "-",
                tau.group(1), tau.group(2), sub.group(1) if sub else "-", sub.group(2) if sub else "-", leak.group(1) if leak else "-", "")


def humaneval_row(text: str) -> str | None:
    """A table row of one HumanEval-164 evaluation log: drafter @ step, τ ± SE, accuracy at slots 1-3, DFlash2's selector line."""
    e = parse_eval(text)
    if e is None:
        return None
    table = text.split("pos   accept(cum)", 1)[-1]  # the per-slot table
    acc = re.findall(r"^\s*([123])\s+[\d.]+\s+[\d.]+\s+([\d.]+)", table, re.M)[:3]
    d2 = re.search(r"DFlash2: .*?unary τ \(argmax, no selector\) ([\d.]+) ± ([\d.]+)\s+selector gain ([+\-][\d.]+) ± ([\d.]+)", text)
    return (f"| {e.name} @{e.step} | {e.tau} ± {e.tau_se} | {' / '.join(a for _, a in acc) or '-'} | "
            + (f"unary τ {d2.group(1)} ± {d2.group(2)}; selector gain {d2.group(3)} ± {d2.group(4)}" if d2 else "-") + " |")


def selector_figures(text: str) -> dict[str, str]:
    """run name -> 'unary τ U ± SE; selector gain G ± SE' from the compare log's DFlash2 block (MLflow metrics)."""
    m: dict[str, dict[str, str]] = {}
    for name, key, val in re.findall(r"^(\S+@step_\d+) (\S+) ([\d.\-]+)$", text, re.M):
        m.setdefault(name, {})[key] = val
    return {n: f"unary τ {d.get('acceptance_length_unary', '-')} ± {d.get('acceptance_length_unary_se', '-')}; selector gain "
               f"+{d.get('selector_gain', '-')} ± {d.get('selector_gain_se', '-')}; top-k recall {d.get('by_position/topk_recall', '-')}"
            for n, d in m.items() if "selector_gain" in d}


def paired_fresh(text: str) -> list[str]:
    """A table row per `python -m dflash.compare A B` block of a compare log: τ on the fresh subset of A and B, the
    paired gap B - A with its SE and z (the block's `acceptance_length/fresh` line)."""
    rows = []
    for block in text.split("### python -m dflash.compare ")[1:]:
        pair = block.split("\n", 1)[0].split()
        m = re.search(r"^acceptance_length/fresh\s+([\d.]+)\s+([\d.]+)\s+([+\-][\d.]+)\s+([\d.]+)\s+([+\-][\d.]+)", block, re.M)
        if len(pair) >= 2 and m:
            rows.append(f"| {pair[0]} | {pair[1]} | {m.group(1)} | {m.group(2)} | {m.group(3)} ± {m.group(4)} | {m.group(5)} |")
    return rows


def train_rows(text: str) -> dict[tuple[str, int], tuple[str, str, str]]:
    """(variant, step) -> (loss, acc_1, tf_tau) as the trainer's metrics lines print them."""
    out = {}
    for m in re.finditer(r"\[(\S+)\] step (\d+)/\d+ loss ([\d.]+) acc [\d.]+ acc_1 ([\d.]+) tf_tau ([\d.]+)", text):
        out[(m.group(1), int(m.group(2)))] = (m.group(3), m.group(4), m.group(5))
    return out


ROUND = r"\d{4}-\d{2}-\d{2}[a-z]?"  # a date, then a letter for a later round of that date


def rounds() -> list[str]:
    """Every round with a trainer's log in scripts/results/, newest first."""
    found = {re.fullmatch(rf"train_[^_]+_({ROUND})\.log", p.name) for p in RESULTS.glob("train_*.log")}
    return sorted((m.group(1) for m in found if m), reverse=True)


def round_section(date: str) -> list[str]:
    """One round: its data, its CPU evaluations beside the trainer's figures at that step, its paired gaps and benches."""
    train_log = next(RESULTS.glob(f"train_*_{date}.log"))
    ttext = train_log.read_text()
    rows = train_rows(ttext)
    evals = [e for e in (parse_eval(p.read_text()) for p in sorted((RESULTS / f"eval_cpu_{date}").glob("*.log"))) if e]
    evals.sort(key=lambda e: (e.name != "fixed", e.name, e.step))
    data = re.findall(r"data: (\d+ sequences, \d+ response tokens)", ttext)
    lines = [f"## Round {date}", "",
             f"Raw logs: `{train_log.name}` (its header: machine, commands), `eval_cpu_{date}/`, `compare_cpu_{date}.log`, "
             f"the bench logs of that round.", "",
             "### Data", "", *[f"- {d}" for d in dict.fromkeys(data)], "",
             "### τ on the builtin prompts (CPU, greedy, 256 new tokens, fp32 target), with the training figures at that step", "",
             "| drafter @ step | layers | taps | τ builtin ± SE | τ fresh | τ train_like | leak probe Δτ | train loss / acc@1 / tf τ | DFlash2 |",
             "|---|---|---|---|---|---|---|---|---|"]
    cmp = RESULTS / f"compare_cpu_{date}.log"
    sel = selector_figures(cmp.read_text()) if cmp.is_file() else {}
    curve = tf_curve(rows)
    for e in evals:
        e = Eval(**{**e.__dict__, "extra": sel.get(f"{e.name}@step_{e.step}", "")})
        lines.append(f"| {e.name} @{e.step} | {e.layers} | {e.taps} | {e.tau} ± {e.tau_se} | {e.fresh} | {e.train_like} | {e.leak_gain} | "
                     f"{train_at(rows, e.name, e.step)} | {e.extra or '-'} |")
    if curve:
        lines += ["", "### The trainer's teacher-forced τ by step (its metrics lines; where the curves stand when the run stopped)", "",
                  *curve]
    if cmp.is_file():
        pairs = paired_fresh(cmp.read_text())
        if pairs:
            lines += ["", "### What each change buys: τ on the fresh subset, paired by prompt (B - A)", "",
                      "| A | B | τ fresh A | τ fresh B | B - A ± SE | z |", "|---|---|---|---|---|---|", *pairs]
        lines += ["", "### Paired gaps (python -m dflash.compare)", "", "```", cmp.read_text().rstrip(), "```"]
    he = [r for r in (humaneval_row(p.read_text()) for p in sorted((RESULTS / f"humaneval_cpu_{date}").glob("*.log"))) if r]
    if he:
        lines += ["", "### τ on HumanEval-164 (CPU, greedy, 256 new tokens, fp32 target; `prompts=humaneval prompts.num_prompts=164`)", "",
                  "| drafter @ step | τ ± SE | accuracy @1 / @2 / @3 (teacher-forced) | DFlash2 |", "|---|---|---|---|", *he]
        hcmp = RESULTS / f"compare_humaneval_cpu_{date}.log"
        if hcmp.is_file():
            lines += ["", "```", hcmp.read_text().rstrip(), "```"]
    for b in sorted(RESULTS.glob(f"bench_*_{date}.log")):
        summ = b.read_text().split("== summary")[-1].strip()
        lines += ["", f"### {b.name}", "", "```", summ, "```"]
    return lines


def tf_curve(rows: dict[tuple[str, int], tuple[str, str, str]], every: int = 500) -> list[str]:
    """The trainer's teacher-forced τ by step, a column per variant: every `every` steps and the last logged step."""
    variants = list(dict.fromkeys(v for v, _ in rows))
    steps = sorted({k for _, k in rows})
    if not steps:
        return []
    shown = [k for k in steps if k % every == 0] + ([steps[-1]] if steps[-1] % every else [])
    head = ["| step | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    return head + [f"| {k} | " + " | ".join(rows[(v, k)][2] if (v, k) in rows else "-" for v in variants) + " |"
                   for k in shown]


def train_at(rows: dict[tuple[str, int], tuple[str, str, str]], variant: str, step: int) -> str:
    """The trainer's figures at `step`, else at its last logged step before it (a run stopped between two log lines)."""
    logged = [k for v, k in rows if v == variant and k <= step]
    if not logged:
        return "-"
    at = max(logged)
    return " / ".join(rows[(variant, at)]) + ("" if at == step else f" (step {at})")


def main() -> None:
    only = sys.argv[1:]  # a round to write alone; default: every round, newest first
    lines = ["# Training results", "",
             "Generated by `python scripts/training_results.py` from `scripts/results/`: every training round, newest first. "
             "Do not edit by hand.", ""]
    for date in only or rounds():
        lines += round_section(date) + [""]
    PAGE.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
