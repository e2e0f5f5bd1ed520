"""The replay loop and the metrics, on hand-made proposals (no model), and the replay's refusal of non-finite
activations."""

import random

import pytest
import torch
from shortcuts import evaluate_sequence

from dflash.models.target.forward import tapped_forward
from dflash.stages.metrics import (
    Counters,
    accept_rate,
    accept_rate_cond,
    acceptance_length,
    accuracy,
    commit_share,
    expected_acceptance_length,
    position_curves,
    position_table,
    ratio_se,
    summarize,
)
from dflash.stages.replay.loop import replay, teacher_forced
from dflash.util.errors import NumericsError

B = 16


def oracle_proposals(seq, P, pad=0):
    return [(seq[p + 1 : p + B] + [pad] * B)[: B - 1] for p in range(P, len(seq) - 1)]


@pytest.mark.parametrize("n_new", [1, 2, 15, 16, 17, 100, 256])
def test_oracle_gets_block_size_except_where_the_reference_ends(n_new):
    rng = random.Random(n_new)
    P = 7
    seq = [rng.randrange(1000) for _ in range(P + n_new)]
    c, blocks = replay(seq, P, oracle_proposals(seq, P), B)
    committed = n_new - 1  # the first new token comes from the prefill
    assert c.committed == committed and c.new_tokens == n_new
    full, rest = divmod(committed, B)
    assert c.steps == full + (rest > 0)
    assert [blk.accepted for blk in blocks] == [B - 1] * full + ([rest] if rest else [])
    assert c.commit_hist[B] == full
    if committed >= B:
        assert acceptance_length(c) == pytest.approx(committed / c.steps)
        assert acceptance_length(c) > B - 1 if rest == 0 else True
    teacher_forced(seq, P, oracle_proposals(seq, P), c)
    assert all(a == 1.0 for a, t in zip(accuracy(c), c.tf_total) if t)


def test_random_drafter_gets_tau_close_to_one():
    rng = random.Random(0)
    P, V = 5, 50
    seq = [rng.randrange(V) for _ in range(P + 300)]
    props = [[rng.randrange(V) for _ in range(B - 1)] for _ in range(P, len(seq) - 1)]
    c, _ = replay(seq, P, props, B)
    tau = acceptance_length(c)
    assert 1.0 <= tau < 1.1  # each slot right with p = 1/50
    assert c.steps > 250


def test_partial_acceptance_counts():
    P = 2
    seq = list(range(40))
    props = oracle_proposals(seq, P)
    props[0] = props[0][:3] + [999] * 12  # first anchor: 3 accepted, bonus = seq[6]
    c, blocks = replay(seq, P, props, B)
    assert blocks[0].accepted == 3 and blocks[1].anchor_pos == P + 4
    # anchors 2 (3 accepted), 6 (15), 22 (15), 38 (1: only one reference token left)
    assert [blk.anchor_pos for blk in blocks] == [2, 6, 22, 38]
    assert [blk.accepted for blk in blocks] == [3, 15, 15, 1]
    assert c.accepted_at_pos[:5] == [4, 3, 3, 2, 2]
    assert c.committed == 4 + 16 + 16 + 1


def test_metric_conventions():
    c = Counters(
        block_size=4,
        steps=10,
        committed=25,
        accepted=15,
        drafted=30,
        accepted_at_pos=[8, 5, 2],
        tf_correct=[8, 4, 1],
        tf_total=[10, 10, 10],
    )
    assert acceptance_length(c) == 2.5
    assert accept_rate(c) == [0.8, 0.5, 0.2]
    assert accept_rate_cond(c) == pytest.approx([0.8, 5 / 8, 2 / 5])
    assert expected_acceptance_length(accuracy(c)) == pytest.approx(1 + 0.8 + 0.8 * 0.4 + 0.8 * 0.4 * 0.1)


def test_summarize_micro_macro_and_subsets():
    a = Counters(block_size=4, steps=2, committed=8, prompts=1, new_tokens=9)
    b = Counters(block_size=4, steps=6, committed=6, prompts=1, new_tokens=7)
    m = summarize([("x", a), ("y", b)])
    assert m["acceptance_length"] == pytest.approx(14 / 8)  # token-weighted
    assert m["acceptance_length_macro"] == pytest.approx((4 + 1) / 2)
    # SE over prompts: residuals 8 - 1.75*2 = 4.5 and 6 - 1.75*6 = -4.5 -> sqrt(2 * 40.5) / 8
    assert m["acceptance_length_se"] == pytest.approx(9 / 8)
    assert m["acceptance_length/x"] == 4 and m["acceptance_length/y"] == 1
    assert m["mean_accepted"] == 0  # no accepted drafts were counted
    assert not any("/pos_" in k for k in m)  # per-slot values are curves (position_curves), not scalars
    assert "nll_mean" not in m and "nll" not in position_curves(a + b)  # counted only with scores=true
    assert m["draft_acceptance_rate"] is None and m["expected_acceptance_length"] is None  # 0/0: undefined, not 0


def test_undefined_rates_are_none_not_zero():
    c = Counters(
        block_size=4,
        steps=5,
        committed=7,
        accepted=2,
        drafted=15,
        accepted_at_pos=[2, 0, 0],
        tf_correct=[3, 1, 0],
        tf_total=[5, 3, 0],
    )
    assert accept_rate_cond(c) == [
        0.4,
        0.0,
        None,
    ]  # slot 3: no step reached it (0/0), slot 2: reached twice, never accepted
    assert accuracy(c)[2] is None and expected_acceptance_length(accuracy(c)) == pytest.approx(1 + 0.6 + 0.6 / 3)
    assert commit_share(c) == [0.0] * 4 and acceptance_length(Counters(block_size=4)) is None
    rows = position_table(c)
    assert [r["pos"] for r in rows] == [1, 2, 3] and rows[2]["accept_rate_cond"] is None and rows[2]["reached"] == 0
    m = summarize([("x", Counters(block_size=4, prompts=1, new_tokens=1))])  # a 1-token reference: no verify step
    assert m["acceptance_length"] is None and m["acceptance_length_macro"] is None and m["acceptance_length_se"] is None


def test_ratio_se_is_zero_for_equal_prompts_and_shrinks_with_more_of_them():
    assert ratio_se([4, 8, 12], [2, 4, 6]) == 0.0  # every prompt has τ 2
    assert ratio_se([5], [3]) is None  # one prompt: no spread to measure (undefined, not 0)
    one, four = ratio_se([8, 6], [2, 6]), ratio_se([8, 6] * 4, [2, 6] * 4)
    assert four == pytest.approx(one * (2 * 8 / 7) ** 0.5 / 4)  # n/(n-1) factor, sqrt(n) shrinkage


def test_nll_confidence_and_overconfidence():
    seq, P = [1, 2, 3, 4, 5], 2  # anchors 2, 3; slot k needs p + k < 5
    props = [[4, 9, 0], [5, 0, 0]]  # anchor 2: slot 1 right, slot 2 wrong; anchor 3: slot 1 right
    nll = [[0.1, 2.0, 9.0], [0.3, 9.0, 9.0]]  # entries past the reference end must be ignored
    conf = [[0.9, 0.8, 1.0], [0.5, 1.0, 1.0]]
    c = Counters(block_size=4)
    teacher_forced(seq, P, props, c, nll, conf)
    assert c.tf_total == [2, 1, 0] and c.tf_correct == [2, 0, 0]
    assert c.tf_nll == pytest.approx([0.4, 2.0, 0.0]) and c.tf_conf == pytest.approx([1.4, 0.8, 0.0])
    m = summarize([("x", c)])
    assert m["nll_mean"] == pytest.approx(2.4 / 3)
    curves = position_curves(c)
    assert (
        curves["nll"][0] == pytest.approx(0.2)
        and curves["confidence"][1] == pytest.approx(0.8)
        and curves["nll"][2] is None
    )
    assert m["overconfidence"] == pytest.approx((2.2 - 2) / 3)


def test_non_finite_drafter_activations_fail_the_run(qwen3_target, make_drafter):
    d = make_drafter(qwen3_target, num_layers=1, num_taps=2, block_size=4)
    x, r = [3, 5, 7, 9], [11, 13, 15, 17, 19]
    taps = tapped_forward(qwen3_target, torch.tensor([x + r]), d.cfg.target_layer_ids)[0]
    evaluate_sequence(d, qwen3_target, x, r, taps)  # finite: runs
    d.norm.weight.data[0] = float("nan")  # what an overflow inside the drafter leaves behind
    with pytest.raises(NumericsError, match="not finite at the anchor at position 4"):  # the first anchor: P = 4
        evaluate_sequence(d, qwen3_target, x, r, taps)


def test_a_one_token_reference_has_no_verify_step(qwen3_target, make_drafter):
    """A reference of one token (the target ends at once: EOS first) leaves no anchor: no step, τ undefined, no
    crash."""
    d = make_drafter(qwen3_target, num_layers=1, num_taps=2, block_size=4)
    x, r = [3, 5, 7, 9], [2]
    taps = tapped_forward(qwen3_target, torch.tensor([x + r]), d.cfg.target_layer_ids)[0]
    c, blocks = evaluate_sequence(d, qwen3_target, x, r, taps)
    assert (c.steps, c.new_tokens, blocks) == (0, 1, []) and acceptance_length(c) is None


def test_a_run_that_measured_nothing_is_an_error_and_some_prompts_without_a_step_a_warning():
    from dflash.evaluation.pipeline import check_measured
    from dflash.result import PromptResult
    from dflash.stages.metrics import Counters
    from dflash.stages.prompts.sets import Prompt
    from dflash.util.errors import ReferenceError

    def result(pid, steps, ref):
        return PromptResult(
            Prompt(pid, "all", (("user", "x"),)), [1, 2], ref, Counters(block_size=4, steps=steps, prompts=1), []
        )

    with pytest.raises(
        ReferenceError,
        match=r"nothing was measured: 2 of 2 prompts had no verify step: a \(1 new token\), b \(1 new token\)",
    ):
        check_measured([result("a", 0, [2]), result("b", 0, [2])], "sglang")
    (w,) = check_measured([result("a", 3, [5, 6, 2]), result("b", 0, [2])], "sglang")
    assert "1 of 2 prompts had no verify step: b (1 new token)" in w
    assert check_measured([result("a", 3, [5, 6, 2])], "local") == []
