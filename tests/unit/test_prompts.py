"""Prompt sets (builtin, JSONL, HumanEval) and rendering through a chat template."""

from __future__ import annotations

import json

import pytest
from conftest import GEN_PROMPT_THINKING_OFF, GEN_PROMPT_THINKING_ON, make_tokenizer

from dflash.stages.prompts.sets import Prompt, PromptError, load_prompts, read_jsonl, render, round_robin


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


# --- builtin ---------------------------------------------------------------------------------


def test_builtin_set():
    prompts = load_prompts("builtin")
    assert len(prompts) >= 10
    subsets = {p.subset for p in prompts}
    assert subsets == {"train_like", "fresh"}
    for s in subsets:
        assert any(p.subset == s for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts)
    for p in prompts:
        assert p.messages and p.messages[-1][0] == "user" and len(p.messages[-1][1]) > 20


def test_builtin_subset_filter_and_count():
    fresh = load_prompts("builtin", subsets=["fresh"])
    assert fresh and all(p.subset == "fresh" for p in fresh)
    assert len(fresh) < len(load_prompts("builtin"))
    with pytest.raises(PromptError, match="at least 1"):
        load_prompts("builtin", num_prompts=0)


def test_num_prompts_takes_every_subset_in_turn():
    """Round robin over the subsets (in order of first appearance), returned in file order."""
    every = load_prompts("builtin")
    four = load_prompts("builtin", num_prompts=4)
    assert [p.id for p in four] == ["tl-arith-1", "tl-arith-2", "fresh-1", "fresh-2"]
    assert [p.id for p in load_prompts("builtin", num_prompts=3)] == ["tl-arith-1", "tl-arith-2", "fresh-1"]
    assert load_prompts("builtin", num_prompts=12) == load_prompts("builtin", num_prompts=99) == every  # all: unchanged
    assert [p.id for p in load_prompts("builtin", num_prompts=2, subsets=["fresh"])] == ["fresh-1", "fresh-2"]
    # one subset (HumanEval): the first N, as before
    assert [p.id for p in load_prompts("humaneval_complete", num_prompts=3)] == [
        "HumanEval/0",
        "HumanEval/1",
        "HumanEval/2",
    ]


def test_round_robin_with_uneven_subsets():
    ps = [
        Prompt(id=f"{s}{i}", subset=s, messages=(("user", "x"),))
        for s, n in (("a", 3), ("b", 1), ("c", 2))
        for i in range(n)
    ]
    ps = ps[1:2] + ps[:1] + ps[2:]  # file order a1 a0 a2 b0 c0 c1: selection follows it, not the ids
    assert [p.id for p in round_robin(ps, 4)] == ["a1", "b0", "c0", "a0"]
    assert [p.id for p in round_robin(ps, 6)] == ["a1", "b0", "c0", "a0", "c1", "a2"]
    assert [p.id for p in round_robin(ps, 1)] == ["a1"] and round_robin([], 3) == []


# --- JSONL -----------------------------------------------------------------------------------


def test_jsonl_prompt_and_messages(tmp_path):
    path = _write(
        tmp_path / "mine.jsonl",
        [
            {"prompt": "hello there"},
            "",  # blank lines are skipped
            {
                "id": "chat-1",
                "subset": "chat",
                "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            },
            {"id": 7, "prompt": "third"},
        ],
    )
    prompts = load_prompts("jsonl", path=str(path))
    assert prompts == [
        Prompt(id="0", subset="mine", messages=(("user", "hello there"),)),  # default subset: the file's stem
        Prompt(id="chat-1", subset="chat", messages=(("system", "be brief"), ("user", "hi"))),
        Prompt(id="7", subset="mine", messages=(("user", "third"),)),
    ]
    assert [p.id for p in load_prompts("jsonl", path=str(path), subsets=["chat"])] == ["chat-1"]


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"text": "no prompt field"}), "'prompt' string or a 'messages' list"),
        (json.dumps({"prompt": "   "}), "non-empty 'prompt'"),
        (json.dumps({"messages": []}), "'messages' list"),
        (json.dumps({"messages": [{"role": "user"}]}), "'role' and 'content'"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad, message):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "a"}, "", bad, {"prompt": "b"}])
    with pytest.raises(PromptError, match=message) as e:
        read_jsonl(path)
    assert f"{path} line 3" in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(PromptError, match="does not exist"):
        load_prompts("jsonl", path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(PromptError, match="prompts.path"):
        load_prompts("jsonl")
    with pytest.raises(PromptError, match="builtin, jsonl, humaneval_complete"):
        load_prompts("csv")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(PromptError, match="empty"):
        load_prompts("jsonl", path=str(path))


def test_empty_after_subset_filter(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "a", "subset": "x"}])
    with pytest.raises(PromptError, match=r"empty.*subsets=\['y'\]"):
        load_prompts("jsonl", path=str(path), subsets=["y"])
    with pytest.raises(PromptError, match="empty"):
        load_prompts("builtin", subsets=["no_such_subset"])


def test_duplicate_ids(tmp_path):
    path = _write(
        tmp_path / "p.jsonl", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"}]
    )
    with pytest.raises(PromptError, match=r"unique.*\['a'\]"):
        load_prompts("jsonl", path=str(path))
    # an explicit id equal to another line's default (its index) collides too
    path = _write(tmp_path / "q.jsonl", [{"prompt": "x"}, {"id": "0", "prompt": "y"}])
    with pytest.raises(PromptError, match="unique"):
        load_prompts("jsonl", path=str(path))


# --- HumanEval -------------------------------------------------------------------------------


def test_humaneval_from_the_package():
    prompts = load_prompts("humaneval_complete")
    assert len(prompts) == 164
    assert prompts[0].id == "HumanEval/0" and prompts[-1].id == "HumanEval/163"
    assert {p.subset for p in prompts} == {"humaneval"}
    text = prompts[0].messages[0][1]
    assert "def has_close_elements" in text and text.startswith("Complete the following Python function.")
    assert len(load_prompts("humaneval_complete", num_prompts=20)) == 20


# --- rendering -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def test_render_appends_the_generation_prompt_with_thinking_off(tok):
    p = Prompt(id="1", subset="s", messages=(("user", "t7 t8"),))
    ids = render(p, tok, {"enable_thinking": False})
    assert ids == [3, 7, 8, 4] + GEN_PROMPT_THINKING_OFF
    assert all(isinstance(i, int) for i in ids)


def test_render_passes_enable_thinking(tok):
    p = Prompt(id="1", subset="s", messages=(("user", "t7 t8"),))
    on = render(p, tok, {"enable_thinking": True})
    off = render(p, tok, {"enable_thinking": False})
    assert on == [3, 7, 8, 4] + GEN_PROMPT_THINKING_ON
    assert on != off
    assert render(p, tok, {}) == off  # thinking off unless asked


def test_render_system_prompt_and_multi_turn(tok):
    p = Prompt(id="1", subset="s", messages=(("user", "t7"), ("assistant", "t8"), ("user", "t30")))
    ids = render(p, tok, {"enable_thinking": False, "system_prompt": "t40"})
    assert ids == [9, 40, 4, 3, 7, 4, 3, 8, 4, 3, 30, 4] + GEN_PROMPT_THINKING_OFF


def test_render_without_chat_template():
    no_template = make_tokenizer(chat_template=None)
    p = Prompt(id="1", subset="s", messages=(("user", "t7 t8"),))
    with pytest.raises(PromptError, match="use_chat_template=false"):
        render(p, no_template, {"use_chat_template": True})
    assert render(p, no_template, {"use_chat_template": False}) == [7, 8]


def test_render_builtin_through_the_target_tokenizer(qwen3_target):
    """The tokenizer saved with the tiny target (loaded by load_target) keeps its template."""
    p = load_prompts("builtin", num_prompts=1)[0]
    ids = render(p, qwen3_target.tokenizer, {"enable_thinking": False})
    assert ids[0] == 3 and ids[-2:] == GEN_PROMPT_THINKING_OFF


def test_a_file_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "fine"}\n{"prompt": "café"}\n'.encode("latin-1"))
    with pytest.raises(PromptError, match=r"latin1.jsonl line 2: not UTF-8 \(byte 0xe9\)"):
        read_jsonl(path)


@pytest.mark.parametrize("use_chat_template", [True, False])
def test_the_system_prompt_reaches_the_target_in_both_template_modes(use_chat_template):
    from conftest import make_tokenizer

    from dflash.stages.prompts.sets import Prompt, render

    tok = make_tokenizer()
    p = Prompt("a", "all", (("user", "t7 t8"),))
    ids = render(p, tok, {"use_chat_template": use_chat_template, "system_prompt": "t30 t31"})
    plain = render(p, tok, {"use_chat_template": use_chat_template})
    text = tok.decode(ids)
    assert "t30" in text and "t31" in text and "t30" not in tok.decode(plain) and len(ids) > len(plain)
