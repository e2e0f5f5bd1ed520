"""The trainer's data on tiny random targets: training prompts (none overlaps an evaluation
prompt), regenerated sequences and their cache, and what bug 1's noise does to the labels.
"""

from __future__ import annotations

import torch
from test_train import VOCAB, H, seqs, target  # noqa: F401 (fixtures)

from dflash.models.target.forward import forward
from dflash.train.labels import final_tap_is_normed, label_flip_stats, response_last_hidden


def test_no_training_prompt_overlaps_an_evaluation_prompt():
    from dflash.train.prompts import OverlapFilter, build_prompts, evaluation_prompts, overlaps, prompt_text

    evals = evaluation_prompts()
    assert {"builtin", "humaneval"} <= set(evals) and len(evals["humaneval"]) == 164
    flat = [p for ps in evals.values() for p in ps]
    train = build_prompts(8192, 0)
    assert len(train) > 7000
    filt = OverlapFilter(flat)
    bad = [prompt_text(p) for p in train if filt.hits(prompt_text(p))]
    assert not bad, bad[:3]
    texts = {prompt_text(p) for p in flat}
    assert not texts & {prompt_text(p) for p in train}
    # the check itself catches what it should
    e = prompt_text(evals["builtin"][0])
    assert overlaps(e, "Intro. " + e) and overlaps(e, e.upper())
    assert overlaps("A baker makes 14 trays of muffins with 9 muffins on each tray and more", e)
    assert not overlaps("Write a Python function that adds two numbers.", e)


def test_new_recipe_prompts_overlap_no_benchmark_copy(tmp_path):
    """The packages' recipe (sources read with ast, documentation text, math, multi-turn chats) against
    every evaluation set of dflash/conf/prompts/ and every benchmark copy the tests make (tests/hub_copies.py)."""
    import hub_copies

    from dflash.stages.prompts.benchmarks import BENCHMARKS
    from dflash.stages.prompts.sets import load_prompts
    from dflash.train.prompts import OverlapFilter, build_prompts, evaluation_prompts, prompt_text

    hub_copies.write_all(tmp_path, 12)
    copies = [p for name in BENCHMARKS for p in load_prompts(name, data_dir=str(tmp_path), num_prompts=None)]
    assert {p.subset for p in copies} == set(BENCHMARKS)
    evals = [p for ps in evaluation_prompts().values() for p in ps] + copies
    # a training candidate equal to a copy's prompt is dropped (the filter is not vacuous here)
    leak = build_prompts(400, 1, 0.3, exclude=evals, packages=["json"], multi_turn_fraction=0.2)
    train = build_prompts(3000, 1, 0.3, exclude=evals, packages=["json", "email"], multi_turn_fraction=0.2)
    assert len(train) > 2500 and leak
    filt = OverlapFilter(evals)
    assert not [prompt_text(p) for p in train if filt.hits(prompt_text(p))]
    texts = [prompt_text(p) for p in train]
    assert any("```python" in t for t in texts)  # package sources
    assert any(p.subset == "train_chat" and len(p.messages) == 2 for p in train)  # chats: a follow-up turn
    assert any("\\boxed" in t for t in texts)  # mathgen


def test_chat_sequences_answer_each_turn_after_the_targets_own(target, tmp_path):
    from dflash.stages.prompts.sets import Prompt
    from dflash.train.data import build_chat_sequences

    class Tok:
        chat_template = None
        pad_token_id = 2
        eos_token_id = 2

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [3 + (ord(c) % (VOCAB - 3)) for c in text]}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i % 26) for i in ids)

    target.tokenizer = Tok()
    try:
        ps = [Prompt("a", "t", (("user", "first q"), ("user", "then"))), Prompt("b", "t", (("user", "single"),))]
        seqs = build_chat_sequences(
            target, ps, {"use_chat_template": False}, 6, 64, 2, tmp_path, shard_size=4, min_response_tokens=1
        )
        by = {s.pid: s for s in seqs}
        assert set(by) == {"a/turn_1", "a/turn_2", "b"}
        answer1 = Tok().decode(by["a/turn_1"].ids[by["a/turn_1"].prompt_len :])
        turn2 = Tok()("\n\n".join(["first q", answer1, "then"]))["input_ids"]
        assert by["a/turn_2"].ids[: by["a/turn_2"].prompt_len] == turn2  # asked after the target's own answer
    finally:
        target.tokenizer = None


def test_training_prompts_deterministic_and_mixed():
    from dflash.train.prompts import build_prompts, prompt_text

    a, b = build_prompts(500, 3), build_prompts(500, 3)
    assert [prompt_text(p) for p in a] == [prompt_text(p) for p in b]
    texts = [prompt_text(p) for p in a]
    assert any("step" in t.lower() and any(c.isdigit() for c in t) for t in texts)  # arithmetic
    assert any("`" in t for t in texts)  # coding


def test_sequences_regenerated_and_cached(target, tmp_path):
    from dflash.stages.prompts.sets import Prompt
    from dflash.train.data import build_sequences

    class Tok:
        chat_template = None
        pad_token_id = 2
        eos_token_id = 2

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [3 + (ord(c) % (VOCAB - 3)) for c in text]}

    target.tokenizer = Tok()
    try:
        ps = [Prompt(id=str(i), subset="t", messages=(("user", f"task {i} abc"),)) for i in range(5)]
        tmpl = {"use_chat_template": False}
        s1 = build_sequences(target, ps, tmpl, 12, 64, 2, tmp_path, shard_size=2, min_response_tokens=1)
        shards = sorted((tmp_path / "train_data").rglob("shard_*.pt"))
        assert len(shards) == 3 and not list((tmp_path / "train_data").rglob("*.tmp"))
        s2 = build_sequences(target, ps, tmpl, 12, 64, 2, tmp_path, shard_size=2, min_response_tokens=1)
        assert [s.ids for s in s1] == [s.ids for s in s2]
        for s in s1:  # the response is the target's greedy continuation
            ids = torch.tensor([s.ids[: s.prompt_len]])
            assert forward(target, ids).logits[0, -1].argmax().item() == s.ids[s.prompt_len]
        import copy
        import dataclasses

        bf16 = dataclasses.replace(target, model=copy.deepcopy(target.model).to(torch.bfloat16))
        build_sequences(bf16, ps, tmpl, 12, 64, 2, tmp_path, shard_size=2, min_response_tokens=1)
        assert len(list((tmp_path / "train_data").iterdir())) == 2  # another dtype: other labels, another key
    finally:
        target.tokenizer = None


def test_label_flip_stats_measure_what_bug1_does_to_the_labels(target, seqs):
    """No noise flips nothing; more noise flips more; a position flips its majority only if >= half its draws flip."""
    h = response_last_hidden(target, seqs)
    assert h.shape == (sum(len(s.ids) - s.prompt_len for s in seqs), H)
    normed = final_tap_is_normed(target)
    stats = [
        label_flip_stats(target, h, std, normed, draws=16, gen=torch.Generator().manual_seed(0))
        for std in (0.0, 0.3, 1.0)
    ]
    assert stats[0].flip_rate == 0 and stats[0].majority_flip_rate == 0
    assert 0 < stats[1].flip_rate < stats[2].flip_rate and stats[1].majority_flip_rate <= stats[2].majority_flip_rate
    assert all(s.majority_flip_rate <= 2 * s.flip_rate + 1e-9 for s in stats)
