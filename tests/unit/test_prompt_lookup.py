"""Prompt lookup, the n-gram yardstick (vLLM's `ngram` speculator): its proposal rule, its replay counted by
hand on a made-up reference, the indexed walk equal to the rule read straight off, the pooled yardstick."""

import dataclasses
import random

import pytest

from dflash.stages.metrics import Counters, count_step
from dflash.stages.replay.loop import verify
from dflash.stages.replay.prompt_lookup import lookup_replay, propose, yardstick


def test_propose_follows_vllms_rule():
    assert propose([1, 2, 3, 4, 2, 3], 2, 3, 4) == [
        4,
        2,
        3,
    ]  # vLLM's docstring example: [4,2,3] unmatched, [2,3] matched, 3 tokens left
    assert propose([7, 8, 9, 7, 8, 5, 7, 8], 1, 3, 2) == [9, 7]  # [7,8] occurs twice: the earliest one's continuation
    assert propose([2, 3, 5, 1, 2, 3, 9, 1, 2, 3], 2, 3, 2) == [
        9,
        1,
    ]  # the longest n first: [1,2,3], not the earlier [2,3] -> [5,1]
    assert propose([1, 2, 3, 4], 2, 3, 3) == []  # no n-gram repeats: nothing proposed
    assert propose([5, 5, 5], 2, 2, 3) == [5]  # an occurrence may overlap the suffix, never be it
    assert propose([4, 6, 4, 6], 3, 3, 2) == []  # below prompt_lookup_min: no match


def test_lookup_replay_equals_a_hand_count():
    """prompt [10 11 12 13 14], reference [10 11 12 13 20 10 11 12 13 20 7], B = 4 (k = 3), n in 2..3.
    seq positions 0..15; the first anchor is 5 (the prefill's token). By hand:
      pos 5:  ... 14 10: [13 14 10], [14 10] seen nowhere before      -> no draft, commit 1
      pos 6:  ... 10 11: [10 11] at 0 -> draft [12 13 14] vs [12 13 20] -> 2 accepted, commit 3
      pos 9:  ... 13 20: nothing earlier                              -> commit 1
      pos 10: ... 20 10: nothing earlier                              -> commit 1
      pos 11: ... 10 11: earliest [10 11] at 0 -> [12 13 14] vs [12 13 20] -> 2 accepted, commit 3
              (the latest occurrence, at 5, would draft [12 13 20]: all 3 accepted)
      pos 14: ... 12 13 20: [12 13 20] at 7 -> [10 11 12] vs [7]       -> 0 accepted, commit 1 (the last token)
    6 steps commit 10 tokens (the reference's 11 less the prefill's): τ = 10/6."""
    c = lookup_replay([10, 11, 12, 13, 14], [10, 11, 12, 13, 20, 10, 11, 12, 13, 20, 7], block_size=4, min_n=2, max_n=3)
    assert (c.steps, c.committed, c.accepted, c.new_tokens) == (6, 10, 4, 11)
    assert c.commit_hist == [0, 4, 0, 2, 0] and c.accepted_at_pos == [2, 2, 0]


def walk_straight(prompt, ref, B, lo, hi):
    """The loop with `propose` read straight off the rule (no index)."""
    seq, c = prompt + ref, Counters(block_size=B, prompts=1, new_tokens=1)
    pos = len(prompt)
    while pos < len(seq) - 1:
        a, commit = verify(seq, pos, propose(seq[: pos + 1], lo, hi, B - 1), B)
        count_step(c, a, commit)
        pos += commit
    return c


@pytest.mark.parametrize("seed", range(6))
def test_the_indexed_walk_equals_the_rule(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])  # small vocabularies repeat n-grams often
    prompt, ref = (
        [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))],
        [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))],
    )
    B, lo = rng.choice([2, 4, 8, 16]), rng.randrange(1, 4)
    hi = lo + rng.randrange(0, 4)
    assert lookup_replay(prompt, ref, B, lo, hi) == walk_straight(prompt, ref, B, lo, hi)


def test_yardstick_pools_prompts_and_pairs_the_drafter():
    lookup = [
        Counters(block_size=4, steps=5, committed=10, prompts=1),
        Counters(block_size=4, steps=10, committed=10, prompts=1),
    ]
    drafter = [
        Counters(block_size=4, steps=4, committed=10, prompts=1),
        Counters(block_size=4, steps=5, committed=10, prompts=1),
    ]
    y = yardstick(drafter, lookup, 2, 5)
    assert (y.min_n, y.max_n, y.k) == (2, 5, 3)
    assert (
        y.tau == 20 / 15
        and y.gain == pytest.approx(20 / 9 - 20 / 15)
        and y.tau_se is not None
        and y.gain_se is not None
    )
    none = yardstick(
        [Counters(block_size=4, prompts=1)], [Counters(block_size=4, prompts=1)], 2, 5
    )  # one-token references: no step
    assert (none.tau, none.tau_se, none.gain, none.gain_se) == (None, None, None, None)


def test_the_pipeline_replays_the_yardstick_on_its_references_and_prints_it_beside_tau(qwen3_dir, tmp_path):
    """On a tiny target: the yardstick is prompt lookup replayed on the run's own references at its block size, with
    the settings of prompt_lookup.*; the summary prints it beside τ, tracking names it; prompt_lookup.enabled=false:
    none."""
    from dflash import tracking
    from dflash.config.schema import DrafterSchema, EvalConfig, PromptLookupConfig, PromptsConfig, TargetConfig
    from dflash.evaluation import pipeline
    from dflash.report.console import markdown, summary

    cfg = EvalConfig(
        target=TargetConfig(name="tiny", kind="hf", path=str(qwen3_dir), mask_token_id=250),
        drafter=DrafterSchema(kind="init", num_taps=2),
        prompts=PromptsConfig(source="builtin", num_prompts=3, max_new_tokens=24),
        prompt_lookup=PromptLookupConfig(min=1, max=3),
        cache_dir=str(tmp_path),
        num_samples=0,
    )
    res = pipeline.run(cfg)
    B = res.info.block_size
    lookup = [lookup_replay(r.prompt_ids, r.reference, B, 1, 3) for r in res.prompts]
    assert (
        res.prompt_lookup == yardstick([r.counters for r in res.prompts], lookup, 1, 3) and res.prompt_lookup.k == B - 1
    )
    assert res.prompt_lookup.tau is not None and "prompt_lookup" in res.timings
    assert (
        f"prompt lookup (vLLM's ngram: n 1..3, {B - 1} drafted, same references): τ {res.prompt_lookup.tau:.3f}"
        in summary(res)
    )
    assert "**prompt lookup**" in markdown(res, "builtin", "tiny")
    m = tracking.prompt_lookup_metrics(res.prompt_lookup)
    assert m[tracking.PROMPT_LOOKUP_TAU] == res.prompt_lookup.tau and set(m) == {
        "prompt_lookup/acceptance_length",
        "prompt_lookup/acceptance_length_se",
        "prompt_lookup/gain",
        "prompt_lookup/gain_se",
    }
    off = pipeline.run(dataclasses.replace(cfg, prompt_lookup=PromptLookupConfig(enabled=False)))
    assert (
        off.prompt_lookup is None and "prompt lookup" not in summary(off) and tracking.prompt_lookup_metrics(None) == {}
    )


def test_prompt_lookup_settings_are_checked():
    from dflash.config.schema import PromptLookupConfig
    from dflash.util.errors import ConfigError

    with pytest.raises(ConfigError, match=r"prompt_lookup.min=0: use 1 or more"):
        PromptLookupConfig(min=0)
    with pytest.raises(ConfigError, match=r"prompt_lookup.max=2 is below prompt_lookup.min=3"):
        PromptLookupConfig(min=3, max=2)


def test_a_sweep_reads_the_yardstick_back_by_its_tracking_name(tmp_path):
    """A child logs the yardstick through tracking's names; the sweep reads its τ back (one MLflow store, no model)."""
    from dflash import tracking
    from dflash.stages.replay.prompt_lookup import PromptLookup

    uri, sweep = f"sqlite:///{tmp_path}/mlflow.db", tracking.SweepFamily("s1", "sweep", str(tmp_path))
    for job, p in enumerate((PromptLookup(5, 5, 3, 1.25, 0.02, 0.5, 0.01), None)):  # the second computed none
        with tracking.Run(uri, "dflash/tiny", f"a@step_{job}", parent=sweep, tags={"dflash.job": job}) as run:
            run.log_metrics({"acceptance_length": 1.75, **tracking.prompt_lookup_metrics(p)})
    (parent,) = tracking.sweep_parents(uri, "s1")
    assert [k.prompt_lookup_tau for k in parent.children] == [1.25, None]
