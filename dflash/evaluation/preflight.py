"""The checks that need no torch, transformers or MLflow: run by evaluate.py before it imports them.

A typo in a path should cost the user a second, not the start-up of the heavy libraries (many seconds
on a small machine): the prompt file or local data set copy must exist (a JSONL file is read and checked
whole, line by line; a data set copy's files must be readable and hold its columns and rows, read
from their headers), and so must the drafter's run folder or HF folder. Each failure is the same
user error, with the same message, that the full check would raise later.
"""

from __future__ import annotations

from typing import Any

from dflash.stages.prompts.benchmarks import BENCHMARKS, check_files, local_copy
from dflash.stages.prompts.sets import read_jsonl
from dflash.util.errors import CheckpointError, PromptError
from dflash.util.files import find_path


def check_inputs(cfg: Any) -> None:
    """cfg: the typed EvalConfig. Raises PromptError / CheckpointError (exit 2) naming the key to fix."""
    pc, d = cfg.prompts, cfg.drafter
    if pc.source == "jsonl":
        if not pc.path:
            raise PromptError("prompts=jsonl needs prompts.path=/path/to/prompts.jsonl")
        read_jsonl(pc.path)  # missing, not UTF-8, malformed: named by file and line
    elif pc.source in BENCHMARKS or pc.source == "humaneval_complete":
        b = BENCHMARKS.get(pc.source, BENCHMARKS["humaneval"])
        if files := local_copy(
            b, pc.path, pc.data_dir
        ):  # a missing path raises; None: from the hub, checked when it loads
            check_files(b, files)  # headers only: columns and rows of every file
    if (
        d.kind == "training" and d.run_dir and not cfg.follow and not find_path(d.run_dir).is_dir()
    ):  # follow: the trainer makes it
        raise CheckpointError(
            f"drafter.run_dir={d.run_dir} does not exist; point it at a training run folder holding step_<N>/ folders"
        )
    if d.kind == "hf" and d.path and not find_path(d.path).is_dir():
        raise CheckpointError(f"drafter.path={d.path} is not a folder")
