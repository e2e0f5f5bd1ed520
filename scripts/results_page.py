"""Builds docs/results.md, the one page of measured figures, from the raw files in scripts/results/:
each log with its date, machine and command and its key lines quoted verbatim, each JSON file with its
machine block, each hand-written record (`*.md`) included as it is. Nothing is measured here and no
figure is typed in: a figure lives in its log, and the page only quotes it.

    .venv/bin/python scripts/results_page.py            # (re)writes docs/results.md   (make results)
    .venv/bin/python scripts/results_page.py --check    # exit 1 when docs/results.md is not what it would write

A new log opens with one header line, `# <command> | <machine> | <date>` (e.g.
`# python -m dflash.bench --online 4 | 2 CPU cores, torch 2.13 CPU | 2026-12-05`); more `#` lines below it
are notes. Its key lines are a `== summary` section (up to the next `== ` line) or, in a log without one,
each result line followed by lines indented by two spaces (progress lines, warnings and tracebacks are
left out). Older logs without that header are taken as they are: date and machine from the file name
(`<what>_<machine>_<YYYY-MM-DD>[_more].log`), their free-text `#` lines shown as notes. A log with no
such lines is quoted by its last lines. A table or prose that exists only by hand goes in a dated
`<topic>_<YYYY-MM-DD>.md` beside the logs, included verbatim under "Hand-written records"; any other file
is listed, not quoted. tests/unit/test_results_page.py fails while docs/results.md lags behind scripts/results/.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo's dflash
from dflash.util.files import atomic_write_text  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "scripts" / "results"
PAGE = ROOT / "docs" / "results.md"
MAX_QUOTED = 80  # lines quoted per log; the rest is in the log
_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})")
_NOISE = re.compile(r"^(\[|/|Traceback|raw:|Writing |rc=)")
_HEADING = ("== ", "## ", "# ")


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


def read_entry(path: Path) -> Entry:
    name, text = path.name, path.read_text(encoding="utf-8", errors="replace")
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


def render(entries: list[Entry]) -> str:
    measured = sorted((e for e in entries if e.kind != "record"), key=lambda e: (e.date, e.name), reverse=True)
    records = sorted((e for e in entries if e.kind == "record"), key=lambda e: (e.date, e.name), reverse=True)
    out = [
        "# Results",
        "",
        "<!-- generated by scripts/results_page.py from scripts/results/: do not edit; run `make results` -->",
        "",
        "Every measured figure of this project, quoted from the raw file that holds it, newest first, with",
        "its date, machine and command. A figure holds for the code and machine of its date; re-run the",
        "command to check it today. How to add a log: the docstring of `scripts/results_page.py`.",
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


def main(argv: list[str]) -> int:
    page = render(read_entries())
    if "--check" in argv:
        if not PAGE.exists() or PAGE.read_text(encoding="utf-8") != page:
            print(f"{PAGE.relative_to(ROOT)} is stale: run `make results`", file=sys.stderr)
            return 1
        return 0
    atomic_write_text(PAGE, page)
    print(f"wrote {PAGE.relative_to(ROOT)} from {len(list(RESULTS.iterdir()))} files in scripts/results/")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
