"""The field's benchmarks (dflash/stages/benchmarks.py): local copies in the hub's schema, §7 wording,
z-lab's seed-42 selection, errors naming the problem, multi-turn expansion (dflash/stages/turns.py)."""

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash.stages.benchmarks import select
from dflash.stages.prompts import load_prompts
from dflash.stages.turns import expand, fill
from dflash.util.errors import PromptError

SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def _gsm8k(tmp_path, n=10):
    (tmp_path / "gsm8k" / "main").mkdir(parents=True)
    pq.write_table(pa.table({"question": [f"q{i}" for i in range(n)], "answer": ["a"] * n}),
                   tmp_path / "gsm8k" / "main" / "test-00000-of-00001.parquet")
    return tmp_path


def test_gsm8k_wording_and_seed42_selection(tmp_path):
    root = _gsm8k(tmp_path)
    ps = load_prompts("gsm8k", None, 3, data_dir=str(root))
    idx = list(range(10))
    random.seed(42)
    random.shuffle(idx)
    assert [p.id for p in ps] == [f"gsm8k/{i}" for i in idx[:3]]
    assert ps[0].messages == (("user", f"q{idx[0]}" + SUFFIX),)
    assert select(5, 10) == [0, 1, 2, 3, 4]  # n <= N: every row, in order, no shuffle


def test_humaneval_field_wording_offline():
    p = load_prompts("humaneval", None, None, selection="first")[0]
    assert p.id == "HumanEval/0"
    assert p.messages[0][1].startswith("Write a solution to the following problem and make sure that it passes the tests:\n```python\n")
    assert p.messages[0][1].endswith("\n```")


def test_missing_column_and_path(tmp_path):
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "test.parquet")
    with pytest.raises(PromptError, match="no column 'question'"):
        load_prompts("gsm8k", str(tmp_path / "test.parquet"), 1)
    with pytest.raises(PromptError, match="prompts.path=.*does not exist"):
        load_prompts("gsm8k", str(tmp_path / "nope"), 1)


def test_mt_bench_turns(tmp_path):
    pq.write_table(pa.table({"prompt": [["u1", "u2"]], "prompt_id": [81]}), tmp_path / "train.parquet")
    ps = expand(load_prompts("mt_bench", str(tmp_path / "train.parquet"), 80))
    assert [(p.id, p.subset) for p in ps] == [("81/turn_1", "mt_bench/turn_1"), ("81/turn_2", "mt_bench/turn_2")]
    assert fill(ps[1], ["ANSWER"]).messages == (("user", "u1"), ("assistant", "ANSWER"), ("user", "u2"))
