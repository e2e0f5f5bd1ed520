"""Small local copies of the field's data sets, laid out and typed as a mirror of the hub holds them
(`huggingface-cli download --repo-type dataset <id> --local-dir <root>/<name>`): the same folders,
file names, formats and columns, a few rows each. Other configs and splits are written beside the
one z-lab reads (gsm8k's `socratic/`, mbpp's `full/` whose rows have `text`, not `prompt`, SWE-bench's
`dev`, MT-Bench's `raw/question.jsonl`) so a loader that picks the wrong file fails.

`write(root, name, n)` writes `<root>/<name>/...` and returns the rows of the split z-lab reads, in
split order; `write_all(root, n)` every data set. Texts hold braces, backslashes and newlines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq


def _parquet(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def gsm8k(d: Path, n: int) -> list[dict[str, Any]]:
    rows = [
        {
            "question": f"Natalia sold clips to {i} of her friends in April.\nHow many {{clips}} in all?",
            "answer": f"#### {i}",
        }
        for i in range(n)
    ]
    _parquet(d / "main" / "test-00000-of-00001.parquet", rows)
    _parquet(d / "main" / "train-00000-of-00001.parquet", [{"question": "train row", "answer": "0"}])
    _parquet(d / "socratic" / "test-00000-of-00001.parquet", [{"question": "socratic row", "answer": "0"}] * n)
    return rows


def math500(d: Path, n: int) -> list[dict[str, Any]]:
    rows = [
        {
            "problem": f"Convert the point $(0,{i})$ to polar coordinates \\[ r = \\sqrt{{x^2}} \\].",
            "solution": "...",
            "answer": f"\\left( {i}, \\frac{{\\pi}}{{2}} \\right)",
            "subject": "Precalculus",
            "level": 2,
            "unique_id": f"test/precalculus/{800 + i}.json",
        }
        for i in range(n)
    ]
    _jsonl(d / "test.jsonl", rows)
    return rows


def humaneval(d: Path, n: int) -> list[dict[str, Any]]:
    rows = [
        {
            "task_id": f"HumanEval/{i}",
            "prompt": f'from typing import List\n\n\ndef f{i}(numbers: List[float]) -> bool:\n    """ {{doc}} """\n',
            "canonical_solution": "    return True\n",
            "test": "def check(candidate):\n    pass\n",
            "entry_point": f"f{i}",
        }
        for i in range(n)
    ]
    _parquet(d / "openai_humaneval" / "test-00000-of-00001.parquet", rows)
    return rows


def mbpp(d: Path, n: int) -> list[dict[str, Any]]:
    rows = [
        {
            "source_file": "Benchmark Questions Verification V2.ipynb",
            "task_id": 11 + i,
            "prompt": f"Write a python function to remove first and last occurrence of {{char}} {i} from the string.",
            "code": "def f(s, ch):\n    return s",
            "test_imports": [],
            "test_list": ["assert f('hello','l') == 'heo'"],
        }
        for i in range(n)
    ]
    _parquet(d / "sanitized" / "test-00000-of-00001.parquet", rows)
    _parquet(d / "sanitized" / "train-00000-of-00001.parquet", rows[:1])
    _parquet(
        d / "full" / "test-00000-of-00001.parquet",  # the full config's rows say `text`: reading it fails loudly
        [
            {
                "task_id": 11 + i,
                "text": "full row",
                "code": "",
                "test_list": [],
                "test_setup_code": "",
                "challenge_test_list": [],
            }
            for i in range(n)
        ],
    )
    return rows


def mt_bench(d: Path, n: int) -> list[dict[str, Any]]:
    rows = [
        {
            "prompt": [
                f"Compose an engaging travel blog post about trip {i}.",
                f"Rewrite your previous response {i}. Start every sentence with A.",
            ],
            "prompt_id": 10000000 + 7919 * i,
            "category": "writing",
            "reference": [],
        }
        for i in range(n)
    ]
    _parquet(d / "data" / "train-00000-of-00001-4d1a6b3f1e0c9e2a.parquet", rows)
    _jsonl(
        d / "raw" / "question.jsonl",
        [{"question_id": 81 + i, "category": "writing", "turns": r["prompt"]} for i, r in enumerate(rows)],
    )
    return rows


def aime24(d: Path, n: int) -> list[dict[str, Any]]:
    rows = [
        {
            "id": 60 + i,
            "problem": f"Every morning Aya goes for a ${9 + i}$-kilometer-long walk.",
            "solution": "...",
            "answer": "204",
            "url": "https://artofproblemsolving.com/wiki",
            "year": "2024",
        }
        for i in range(n)
    ]
    _parquet(d / "data" / "train-00000-of-00001.parquet", rows)
    return rows


def aime25(d: Path, n: int) -> list[dict[str, Any]]:
    rows = [
        {
            "problem_idx": 1 + i,
            "problem": f"Find the sum of all integer bases $b>{9 + i}$ for which $17_b$ divides $97_b$.",
            "answer": 70,
            "problem_type": ["Number Theory"],
        }
        for i in range(n)
    ]
    _parquet(d / "data" / "train-00000-of-00001.parquet", rows)
    return rows


def livecodebench(d: Path, n: int) -> list[dict[str, Any]]:
    rows = [
        {
            "question_title": f"T{i}",
            "question_content": f"You are given a string S of length {i}.\nPrint {{S}} reversed.",
            "platform": "atcoder",
            "question_id": f"abc{300 + i}_a",
            "contest_id": "abc300",
            "contest_date": "2023-04-29T00:00:00",
            "starter_code": "class Solution:\n    def f(self, s: str) -> str:\n        " if i % 2 else "",
            "difficulty": "easy",
            "public_test_cases": "[]",
            "private_test_cases": "",
            "metadata": "{}",
        }
        for i in range(n)
    ]
    half = (n + 1) // 2
    _jsonl(d / "test.jsonl", rows[:half])  # the hub splits the releases over test.jsonl, test2.jsonl, ... test6.jsonl
    _jsonl(d / "test2.jsonl", rows[half:])
    return rows


def swe_bench(d: Path, n: int) -> list[dict[str, Any]]:
    def row(i: int, split: str) -> dict[str, Any]:
        return {
            "repo": "astropy/astropy",
            "instance_id": f"astropy__astropy-{12907 + i}{'' if split == 'test' else '-dev'}",
            "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
            "patch": "diff",
            "test_patch": "diff",
            "problem_statement": f"`separability_matrix` does not compute {{nested}} CompoundModels "
            f"{i}\nConsider:\n```python\nm = 1\n```",
            "hints_text": "",
            "created_at": "2022-03-03T15:14:54Z",
            "version": "4.3",
            "FAIL_TO_PASS": "[]",
            "PASS_TO_PASS": "[]",
            "environment_setup_commit": "298ccb478e6bf092953bca67a3d29dc6c35f6752",
        }

    rows = [row(i, "test") for i in range(n)]
    _parquet(d / "data" / "test-00000-of-00001.parquet", rows)
    _parquet(d / "data" / "dev-00000-of-00001.parquet", [row(i, "dev") for i in range(3)])
    return rows


def alpaca(d: Path, n: int) -> list[dict[str, Any]]:
    rows = [
        {
            "instruction": f"Give three tips for staying healthy {i}.",
            "input": f"Context {{x}} {i}\nline two" if i % 3 == 0 else "",
            "output": "1. Eat.",
            "text": "Below is an instruction...",
        }
        for i in range(n)
    ]
    _parquet(d / "data" / "train-00000-of-00001-a09b74b3ef9c3b56.parquet", rows)
    return rows


WRITERS: dict[str, Callable[[Path, int], list[dict[str, Any]]]] = {
    "gsm8k": gsm8k,
    "math500": math500,
    "humaneval": humaneval,
    "mbpp": mbpp,
    "mt_bench": mt_bench,
    "aime24": aime24,
    "aime25": aime25,
    "livecodebench": livecodebench,
    "swe_bench": swe_bench,
    "alpaca": alpaca,
}


SPLIT_FILES = {  # the files of the split z-lab reads, as the hub names them
    "gsm8k": ["main/test-00000-of-00001.parquet"],
    "math500": ["test.jsonl"],
    "humaneval": ["openai_humaneval/test-00000-of-00001.parquet"],
    "mbpp": ["sanitized/test-00000-of-00001.parquet"],
    "mt_bench": ["data/train-00000-of-00001-4d1a6b3f1e0c9e2a.parquet"],
    "aime24": ["data/train-00000-of-00001.parquet"],
    "aime25": ["data/train-00000-of-00001.parquet"],
    "livecodebench": ["test.jsonl", "test2.jsonl"],
    "swe_bench": ["data/test-00000-of-00001.parquet"],
    "alpaca": ["data/train-00000-of-00001-a09b74b3ef9c3b56.parquet"],
}


def write(root: Path, name: str, n: int = 12) -> list[dict[str, Any]]:
    """<root>/<name>/ as the hub lays it out; the rows of the split z-lab reads, in split order."""
    return WRITERS[name](Path(root) / name, n)


def write_all(root: Path, n: int = 12) -> dict[str, list[dict[str, Any]]]:
    return {name: write(root, name, n) for name in WRITERS}


if __name__ == "__main__":  # python tests/hub_copies.py <root> [n]: copies for trying the evaluator by hand
    import sys

    write_all(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 12)
