"""The project stands alone: no tracked file outside scripts/results/ (the raw logs, kept as they were written) refers
to a file outside the repository, and none describes the particular machines the project's figures came from
instead of how a user runs the software. The patterns are assembled from parts, so that this file does not match
itself."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = re.compile(re.escape("../" + "shared") + "|" + re.escape("DFLASH" + ".md"))
SETUP_WORDS = re.compile(
    r"lent (GPU|H100|H200)|" + "device" + r" tool|this " + "session|a" + " lease|the " + "lease", re.IGNORECASE
)


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / n for n in out.split("\0") if n and not n.startswith("scripts/results/")]


def offenders(pattern: re.Pattern) -> list[str]:
    hits = []
    for p in tracked():
        if not p.is_file():
            continue  # a tracked file deleted in the work tree
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # weights, images
        hits += [
            f"{p.relative_to(ROOT)}:{i}: {ln.strip()[:100]}"
            for i, ln in enumerate(text.splitlines(), 1)
            if pattern.search(ln)
        ]
    return hits


def test_no_tracked_file_points_outside_the_repository():
    assert not offenders(OUTSIDE), "\n".join(offenders(OUTSIDE))


def test_docs_and_code_speak_of_the_software_not_of_the_machines_it_was_built_on():
    assert not offenders(SETUP_WORDS), "\n".join(offenders(SETUP_WORDS))
