"""Builds the two results pages from the raw files in scripts/results/ (nothing is measured here, no figure typed in:
a figure lives in its log, and the pages quote it):

- docs/results.md, what a user reads (at most 200 lines): the headline ratios, the latest measurement of each per
  device; the shipped drafters' τ and the paired gaps that judge them (the bugs at the users' level); the stage
  table of the newest bench at the 27B shape;
- docs/results-full.md, the full record: each log with its date, machine and command and its key lines quoted,
  each JSON file with its machine block, each hand-written record (`*.md`) included as it is.

    .venv/bin/python scripts/results_page.py            # (re)writes both pages   (make results)
    .venv/bin/python scripts/results_page.py --check    # exit 1 when a page is not what it would write

Quoted verbatim, but for `VOCABULARY`: the few words in older logs that named how their machines were reached
(and an old name of docs/family.md) are normalised, so that the pages speak of the software only.

A new log opens with one header line, `# <command> | <machine> | <date>` (e.g.
`# dflash-bench --online 4 | 2 CPU cores, torch 2.13 CPU | 2026-12-05`); more `#` lines below it
are notes. Its key lines are a `== summary` section (up to the next `== ` line) or, in a log without one,
each result line followed by lines indented by two spaces (progress lines, warnings and tracebacks are
left out). Older logs without that header are taken as they are: date and machine from the file name
(`<what>_<machine>_<YYYY-MM-DD>[_more].log`), their free-text `#` lines shown as notes. A log with no
such lines is quoted by its last lines. A table or prose that exists only by hand goes in a dated
`<topic>_<YYYY-MM-DD>.md` beside the logs, included verbatim under "Hand-written records"; any other file
is listed, not quoted. A bench log's summary lines that match `HEADLINES` feed the headline table; the shipped
drafters are scripts/training_results.py's `SHIPPED`. tests/unit/test_results_page.py fails while a page lags
behind scripts/results/.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo's dflash
sys.path.insert(0, str(Path(__file__).resolve().parent))  # and training_results beside it
import training_results  # noqa: E402

from dflash.util.files import atomic_write_text  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "scripts" / "results"
PAGE = ROOT / "docs" / "results.md"
FULL = ROOT / "docs" / "results-full.md"
MAX_QUOTED = 80  # lines quoted per log; the rest is in the log
_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})")
_NOISE = re.compile(r"^(\[|/|Traceback|raw:|Writing |rc=)")
_HEADING = ("== ", "## ", "# ")
VOCABULARY = (  # (pattern, replacement) applied to every file's text before it is read
    (re.compile(r"DFLASH\.md §"), "docs/family.md §"),
    (re.compile(r" \(device\s+tool\)"), ""),
    (re.compile(r"\bthe device\s+tool\b"), "the transfer"),
    (re.compile(r"\blent\s+(GPU|H100|H200)\b"), r"\1"),
    (re.compile(r"\bthis\s+session's\b"), "a"),
)
# the headline ratios: (what, a regex over a bench log's summary lines); the newest log per device quotes its line
HEADLINES = (
    ("a sweep of 2 checkpoints in one process, over one run", re.compile(r"^  single run .*x one run")),
    ("the same as processes (`-m` sweep over one run)", re.compile(r"^  as processes .*x one run")),
    ("a new process with features on disk", re.compile(r"^  a new process with features on disk")),
    ("offline evaluation per checkpoint vs the online loop", re.compile(r"^  offline evaluation per checkpoint")),
    ("online DFlash over target-only decoding (batch 1)", re.compile(r"^  target-only .*x target-only")),
)
_DEVICE = re.compile(r"^dflash\.bench on .*device (\w+)")
PAGE_LINES = 200


@dataclass(frozen=True)
class Header:
    command: str | None  # from a structured header line; None for an old free-text one
    machine: str | None
    date: str | None
    notes: tuple[str, ...]  # the other leading `#` lines, verbatim
    length: int  # lines the header takes


@dataclass(frozen=True)
class Entry:
    name: str
    kind: str  # log | json | record | other
    date: str  # YYYY-MM-DD, or "" when neither the header nor the name has one
    machine: str
    command: str
    notes: tuple[str, ...]
    quoted: tuple[str, ...]  # verbatim lines (a record: its whole text)


def parse_header(lines: list[str]) -> Header:
    """The leading `#` lines (not `##`): a structured first line `# cmd | machine | date`, else notes."""
    n = 0
    while n < len(lines) and lines[n].startswith("#") and not lines[n].startswith("##"):
        n += 1
    head = lines[:n]
    if head:
        parts = head[0][1:].strip().rsplit(" | ", 2)
        if len(parts) == 3 and _DATE.match(parts[2].strip()):
            return Header(parts[0].strip(), parts[1].strip(), parts[2].strip(), tuple(head[1:]), n)
    return Header(None, None, None, tuple(head), n)


def name_date(name: str) -> str:
    m = _DATE.search(name)
    return m.group(1) if m else ""


def name_machine(name: str) -> str:
    """The file-name token just before the date: bench_scale_h200_2026-12-05_cpu.log -> h200."""
    m = _DATE.search(name)
    if not m:
        return ""
    tokens = name[: m.start()].rstrip("_").split("_")
    return tokens[-1] if tokens and tokens[-1] else ""


def _plain(line: str) -> bool:
    return bool(line.strip()) and not line.startswith((" ", *_HEADING)) and not _NOISE.match(line)


def _body(line: str) -> bool:
    return line.startswith("  ") and not line.startswith('  File "')


def key_blocks(lines: list[str]) -> list[list[str]]:
    """The lines worth quoting: `== summary` sections whole, else result lines with their indented
    lines (the plain line just above a block comes with it), each after the headings that precede it."""
    blocks: list[tuple[bool, list[str]]] = []  # (from a summary section, lines)
    headings: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("== summary"):
            j = i + 1
            while j < len(lines) and not lines[j].startswith(("== ", "#", "rc=")):
                j += 1
            body = lines[i:j]
            while body and not body[-1].strip():
                body.pop()
            blocks.append((True, headings[-1:] + body))
            headings, i = [], j
            continue
        if line.startswith(_HEADING):
            headings.append(line)
            i += 1
            continue
        warning = "Warning" in line or (i + 1 < len(lines) and lines[i + 1].strip().startswith("warnings.warn"))
        if _plain(line) and not warning and i + 1 < len(lines) and _body(lines[i + 1]):
            j = i + 1
            while j < len(lines) and _body(lines[j]):
                j += 1
            above = [lines[i - 1]] if i > 0 and _plain(lines[i - 1]) else []
            blocks.append((False, headings[-1:] + above + lines[i:j]))
            headings, i = [], j
            continue
        i += 1
    summary = {ln for s, b in blocks if s for ln in b}
    kept = [b for s, b in blocks if s or not all(ln in summary or ln.startswith(_HEADING) for ln in b)]
    if not kept:  # no block found: the last lines
        kept = [[ln for ln in lines if ln.strip()][-10:]]
    return kept


def _cap(blocks: list[list[str]]) -> tuple[str, ...]:
    out: list[str] = []
    for b in blocks:
        out += ([""] if out else []) + b
    if len(out) > MAX_QUOTED:
        out = out[:MAX_QUOTED] + [f"[... {len(out) - MAX_QUOTED} more lines: see the log]"]
    return tuple(out)


def normalise(text: str) -> str:
    for pattern, repl in VOCABULARY:
        text = pattern.sub(repl, text)
    return text


def read_entry(path: Path) -> Entry:
    name, text = path.name, normalise(path.read_text(encoding="utf-8", errors="replace"))
    if path.suffix == ".md":
        return Entry(name, "record", name_date(name), "", "", (), tuple(text.rstrip("\n").splitlines()))
    if path.suffix == ".json":
        machine = json.loads(text).get("machine", {})
        date = str(machine.get("date", ""))[:10] or name_date(name)
        lines = tuple(json.dumps(machine, indent=1, sort_keys=True).splitlines())
        return Entry(name, "json", date, name_machine(name), "", (), lines)
    if path.suffix != ".log":
        return Entry(name, "other", name_date(name), name_machine(name), "", (), ())
    lines = text.splitlines()
    h = parse_header(lines)
    return Entry(
        name,
        "log",
        h.date or name_date(name),
        h.machine or name_machine(name),
        h.command or "",
        h.notes,
        _cap(key_blocks(lines[h.length :])),
    )


def read_entries(folder: Path | None = None) -> list[Entry]:
    files = sorted(p for p in (folder or RESULTS).iterdir() if p.is_file() and not p.name.startswith("."))
    return [read_entry(p) for p in files]


def _fence(lines: tuple[str, ...]) -> list[str]:
    return ["```", *lines, "```"]


def render_entry(e: Entry) -> list[str]:
    link = f"[`scripts/results/{e.name}`](../scripts/results/{e.name})"
    out = [f"### {e.name}", ""]
    if e.kind == "other":
        return out + [f"{link}: not a log, a JSON file or a record; not quoted.", ""]
    out.append(f"- file: {link}")
    out.append(f"- date: {e.date or 'not recorded'}")
    if e.kind == "json":
        out += [
            "- what: the structured output of a run (its `.log` of the same name, where there is one,",
            "  holds the lines a person reads); its `machine` block:",
            "",
            *_fence(e.quoted),
            "",
        ]
        return out
    out.append(f"- machine: {e.machine or 'not recorded'}")
    if e.command:
        out.append(f"- command: `{e.command}`")
    else:
        out.append(
            "- command: " + ("no structured header; the log's own header:" if e.notes else "not recorded in the log")
        )
    if e.notes:
        out += ["", *_fence(e.notes)]
    return out + ["", "Key lines, verbatim:", "", *_fence(e.quoted), ""]


def render_full(entries: list[Entry]) -> str:
    """docs/results-full.md: every file, newest first."""
    measured = sorted((e for e in entries if e.kind != "record"), key=lambda e: (e.date, e.name), reverse=True)
    records = sorted((e for e in entries if e.kind == "record"), key=lambda e: (e.date, e.name), reverse=True)
    out = [
        "# Results: the full record",
        "",
        "<!-- generated by scripts/results_page.py from scripts/results/: do not edit; run `make results` -->",
        "",
        "Every measured figure of this project, quoted from the raw file that holds it, newest first, with",
        "its date, machine and command. A figure holds for the code and machine of its date; re-run the",
        "command to check it today. What a user needs from it: [results.md](results.md). How to add a log:",
        "the docstring of `scripts/results_page.py`.",
        "",
        "## Logs",
        "",
    ]
    for e in measured:
        out += render_entry(e)
    out += [
        "## Hand-written records (historical)",
        "",
        "Tables and prose that were only ever written by hand (most from the README before it was cut",
        "down): kept as they were on their date, not regenerated, and likely stale.",
        "",
    ]
    for e in records:
        out += [f"### {e.name}", "", *e.quoted, ""]
    return "\n".join(out).rstrip("\n") + "\n"


def _link(name: str) -> str:
    return f"[`{name}`](../scripts/results/{name})"


def headlines(entries: list[Entry]) -> list[tuple[str, str, str, Entry]]:
    """(what, device, the quoted line, its log) for each headline and device, from the newest bench log that has
    it (by date, then name)."""
    latest: dict[tuple[str, str], tuple[str, Entry]] = {}
    logs = sorted((e for e in entries if e.kind == "log"), key=lambda e: (e.date, e.name))
    for e in logs:
        device = next((m.group(1) for m in map(_DEVICE.match, e.quoted) if m), None)
        if device is None:
            continue
        for what, pattern in HEADLINES:
            line = next((ln for ln in e.quoted if pattern.match(ln)), None)
            if line is not None:
                latest[(what, device)] = (line.strip(), e)
    return [
        (what, device, *latest[(what, device)])
        for what, _ in HEADLINES
        for device in ("cpu", "cuda")
        if (what, device) in latest
    ]


def shipped_evals() -> dict[str, tuple[str, training_results.Eval]]:
    """run name -> (round, its newest builtin evaluation) for each shipped drafter; the HumanEval-164 τ ± SE under
    `name + " humaneval"`."""
    found: dict[str, tuple[str, training_results.Eval]] = {}
    for date in sorted(training_results.rounds()):
        for folder, suffix in ((f"eval_cpu_{date}", ""), (f"humaneval_cpu_{date}", " humaneval")):
            for p in sorted((RESULTS / folder).glob("*.log")):
                e = training_results.parse_eval(p.read_text(encoding="utf-8"))
                if e is not None:
                    run = f"{e.name.split(' ')[0]}@step_{e.step}"
                    if run in training_results.SHIPPED:
                        found[run + suffix] = (date, e)
    return found


def render(entries: list[Entry]) -> str:
    """docs/results.md: what a user reads."""
    out = [
        "# Results",
        "",
        "<!-- generated by scripts/results_page.py from scripts/results/: do not edit; run `make results` -->",
        "",
        "What a user needs to judge the evaluator's cost and the shipped drafters, each figure quoted from the raw log",
        "that holds it, with its date and machine. A figure holds for the code and machine of its date; the log's",
        "command reruns it. Every log, newest first: [the full record](results-full.md); each training round:",
        "[training results](training_results.md).",
        "",
        "## Headline ratios",
        "",
        "The newest measurement of each, per device (`dflash-bench`, SmolLM2-135M target, 12 builtin prompts, 256 new",
        "tokens; the line as the bench prints it).",
        "",
        "| what | device | measured | log |",
        "|---|---|---|---|",
    ]
    machines: dict[str, Entry] = {}
    for what, device, line, e in headlines(entries):
        out.append(f"| {what} | {device} | {line.replace('|', '/')} | {_link(e.name)} ({e.date}) |")
        machines[e.name] = e
    out += ["", "Machines:", ""]
    out += [f"- {_link(n)}: {e.machine or 'not recorded'}" for n, e in sorted(machines.items())]
    evals = shipped_evals()
    out += [
        "",
        "## The shipped drafters",
        "",
        "τ (bonus included) on CPU, greedy, 256 new tokens, fp32 SmolLM2 target: on the 12 builtin prompts (their",
        "`fresh` subset beside) and on HumanEval-164; the leak probe's Δτ (a large one flags bug 2). docs/training.md",
        "says how each was trained; `make drafters` restores those outside the tree's budget.",
        "",
        "| drafter @ step | what | τ builtin ± SE | τ fresh | τ HumanEval-164 ± SE | leak probe Δτ | round |",
        "|---|---|---|---|---|---|---|",
    ]
    for run, what in training_results.SHIPPED.items():
        if run not in evals:
            continue
        date, e = evals[run]
        he = evals.get(run + " humaneval")
        he_tau = f"{he[1].tau} ± {he[1].tau_se}" if he else "-"
        out.append(f"| {run} | {what} | {e.tau} ± {e.tau_se} | {e.fresh} | {he_tau} | {e.leak_gain} | {date} |")
    out += [
        "",
        "## What separates them",
        "",
        "Paired by prompt (`dflash-compare A B`): B - A with its paired SE; |z| >= 2 is a measurable gap. A bug's cost",
        "is its row against the bug-free twin trained in lockstep with it; the selector's gain, the default against",
        "its DFlash twin.",
        "",
        "| round | prompts | A | B | τ A | τ B | B - A ± SE | z |",
        "|---|---|---|---|---|---|---|---|",
        *training_results.shipped_rows(),
    ]
    scale = [e for e in entries if e.kind == "log" and e.name.startswith("bench_scale_") and e.quoted]
    if scale:
        e = max(scale, key=lambda e: (e.date, e.name))
        out += [
            "",
            "## The stages at the 27B shape",
            "",
            "`dflash-bench --scale qwen3_6_27b`: every stage of one evaluation of a random target of Qwen3.6-27B's",
            "shape, timed, each steady stage over its floor on the same device (docs/how-it-works.md). Newest run:",
            f"{_link(e.name)} ({e.date}; {e.machine or 'machine not recorded'}).",
            "",
            *_fence(e.quoted),
        ]
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    entries = read_entries()
    pages = {PAGE: render(entries), FULL: render_full(entries)}
    if "--check" in argv:
        stale = [p for p, text in pages.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
        for p in stale:
            print(f"{p.relative_to(ROOT)} is stale: run `make results`", file=sys.stderr)
        return 1 if stale else 0
    for p, text in pages.items():
        atomic_write_text(p, text)
    print(f"wrote {PAGE.relative_to(ROOT)} and {FULL.relative_to(ROOT)} from {len(list(RESULTS.iterdir()))} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
