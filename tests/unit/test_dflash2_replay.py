"""The offline replay of DFlash2 drafters (issue 27 parts 2, 3): every replay mode gives the same walk, the
same unary walk and the same teacher-forced counters (unary top-1, walk, top-k recall); an identity DFlash2
replays as DFlash; unary τ, top-k recall and the selector's gain come from summed counters."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import loop_counters
from test_dflash2 import make_dflash2

from dflash.models.target.forward import tapped_forward
from dflash.stages.metrics import Counters, count_step, position_curves, summarize, topk_recall, unary_accuracy
from dflash.stages.replay.loop import (
    ReplayOptions,
    ReplaySeq,
    draft_anchors,
    prepare,
    replay,
    replay_group,
    teacher_forced,
)

B = 6


def mixed_reference(target, drafter, prompt: list[int], n_new: int, seed: int) -> list[int]:
    """A reference both walks partly predict: at each anchor the first m tokens of the walk or of the unary
    argmax (either, at random), then one random token."""
    rng = random.Random(seed)
    seq = list(prompt) + [rng.randrange(3, 200)]
    while len(seq) < len(prompt) + n_new:
        ext = seq + [0]
        taps = tapped_forward(target, torch.tensor([ext]), drafter.cfg.target_layer_ids)[0]
        s = ReplaySeq(torch.tensor(ext), len(seq) - 1, drafter.context_kv(taps[None]))
        d = draft_anchors(drafter, target, s, torch.tensor([len(seq) - 1]), ReplayOptions())
        prop = (d.tokens if rng.random() < 0.5 else d.unary)[0].tolist()
        m = rng.randrange(B)
        seq += prop[:m] + [rng.choice([t for t in range(3, 200) if m == B - 1 or t != prop[m]])]
    return seq[len(prompt) : len(prompt) + n_new]


@pytest.fixture(scope="module")
def case(qwen3_target, make_drafter):
    drafter = make_dflash2(make_drafter, qwen3_target, num_layers=2, block_size=B, seed=1, std=0.2)
    rng = random.Random(0)
    items = []
    for i, (P, n) in enumerate([(4, 40), (9, 25), (6, 33)]):
        x = [rng.randrange(3, 200) for _ in range(P)]
        r = mixed_reference(qwen3_target, drafter, x, n, seed=i)
        items.append((x, r, tapped_forward(qwen3_target, torch.tensor([x + r]), drafter.cfg.target_layer_ids)[0]))
    return drafter, items


def run(target, drafter, items, **kw):
    return replay_group(
        drafter, target, [prepare(drafter, target, x, r, taps) for x, r, taps in items], ReplayOptions(**kw)
    )


def tf(c: Counters):
    return c.tf_correct, c.tf_total, c.tf_unary_correct, c.tf_topk_hit


@pytest.mark.parametrize("stride, chunk, scores", [(1, 32, False), (3, 32, True), (4, 2, False), (1, 1, True)])
def test_dflash2_visited_equals_all(qwen3_target, case, stride, chunk, scores):
    drafter, items = case
    exact = run(qwen3_target, drafter, items, anchors="all", tf_stride=stride, chunk=chunk, scores=scores)
    visited = run(qwen3_target, drafter, items, anchors="visited", tf_stride=stride, chunk=chunk, scores=scores)
    assert sum(c.accepted for c, _ in exact) > len(items) and sum(
        c.unary_committed - c.unary_steps for c, _ in exact
    ) > len(items)
    differs = [b for _, bs in exact for b in bs if b.unary[: b.accepted + 1] != b.proposal[: b.accepted + 1]]
    assert differs, "the walk should differ from the unary argmax"
    for (ce, be), (cv, bv) in zip(exact, visited):
        assert ce.selector and cv.selector
        assert loop_counters(cv) == loop_counters(ce) and (cv.unary_steps, cv.unary_committed) == (
            ce.unary_steps,
            ce.unary_committed,
        )
        assert [(b.anchor_pos, b.accepted) for b in bv] == [(b.anchor_pos, b.accepted) for b in be]
        for b_v, b_e in zip(bv, be):  # the lazy head's walk and unary argmax: prefixes of the full ones
            assert b_v.proposal == b_e.proposal[: len(b_v.proposal)] and b_v.unary == b_e.unary[: len(b_v.unary)]
        assert tf(cv) == tf(ce)
        assert all(
            w <= r and u <= r for w, u, r in zip(ce.tf_correct, ce.tf_unary_correct, ce.tf_topk_hit)
        )  # top-k bounds both


def test_lockstep_group_equals_one_prompt_at_a_time(qwen3_target, case):
    drafter, items = case
    together = run(qwen3_target, drafter, items, anchors="visited", tf_stride=7, chunk=2)
    alone = [run(qwen3_target, drafter, [it], anchors="visited", tf_stride=7)[0] for it in items]
    for (ct, bt), (ca, ba) in zip(together, alone):
        assert loop_counters(ct) == loop_counters(ca) and ct.unary_committed == ca.unary_committed and tf(ct) == tf(ca)
        assert [(b.anchor_pos, b.proposal, b.unary) for b in bt] == [(b.anchor_pos, b.proposal, b.unary) for b in ba]


@pytest.mark.parametrize("scores", [False, True])
def test_prompts_packed_in_one_pass_equal_one_prompt_per_pass(qwen3_target, case, monkeypatch, scores):
    """`all`: the prompts in one drafter pass, its LM head in pieces of one anchor, and each prompt alone over
    passes of 3 anchors: the same walk, unary walk and teacher-forced counters (unary top-1, top-k recall)."""
    from dflash.stages.replay import drafts

    drafter, items = case
    split = [run(qwen3_target, drafter, [it], anchors="all", chunk=3, scores=scores)[0] for it in items]
    packed = run(qwen3_target, drafter, items, anchors="all", chunk=1000, scores=scores)
    monkeypatch.setattr(drafts, "HEAD_BYTES", 1)
    pieces = run(qwen3_target, drafter, items, anchors="all", chunk=1000, scores=scores)
    for (cs, bs), (cp, bp), (cq, bq) in zip(split, packed, pieces):
        for c, b in ((cp, bp), (cq, bq)):
            assert loop_counters(c) == loop_counters(cs) and c.unary_committed == cs.unary_committed and tf(c) == tf(cs)
            assert [(x.anchor_pos, x.proposal, x.unary) for x in b] == [(x.anchor_pos, x.proposal, x.unary) for x in bs]
            if scores:
                assert c.tf_nll == pytest.approx(cs.tf_nll, rel=1e-5) and c.tf_conf == pytest.approx(
                    cs.tf_conf, rel=1e-5
                )


@pytest.mark.parametrize("mode", ["all", "visited"])
def test_a_prompt_with_no_anchor_walks_nothing_beside_others(qwen3_target, case, mode):
    """A one-token reference leaves no anchor to draft at: in a group it takes no step, and the prompts beside
    it walk as they do alone (the host copy of the group's drafts keeps its empty rows apart)."""
    drafter, items = case
    x, r, taps = items[0]
    group = [items[1], (x, r[:1], taps[: len(x) + 1]), items[2]]
    together = run(qwen3_target, drafter, group, anchors=mode, tf_stride=2, scores=True)
    (c0, b0) = together[1]
    assert c0.steps == 0 and b0 == [] and sum(c0.tf_total) == 0
    for (ct, bt), it in zip((together[0], together[2]), (items[1], items[2])):
        ((ca, ba),) = run(qwen3_target, drafter, [it], anchors=mode, tf_stride=2, scores=True)
        assert loop_counters(ct) == loop_counters(ca) and ct.unary_committed == ca.unary_committed and tf(ct) == tf(ca)
        assert [(b.anchor_pos, b.proposal, b.unary) for b in bt] == [(b.anchor_pos, b.proposal, b.unary) for b in ba]


def test_identity_dflash2_replays_as_dflash(qwen3_target, make_drafter, case):
    """Identity convolutions, zero successor codebook: DFlash's counters, and the unary walk is the walk (gain 0)."""
    _, items = case
    dflash = make_drafter(qwen3_target, num_layers=2, block_size=B, seed=1, std=0.2)
    two = make_dflash2(make_drafter, qwen3_target, identity=True, num_layers=2, block_size=B, seed=1, std=0.2)
    for mode in ("all", "visited"):
        a, b = run(qwen3_target, dflash, items, anchors=mode), run(qwen3_target, two, items, anchors=mode)
        for (ca, ba), (cb, bb) in zip(a, b):
            assert loop_counters(ca) == loop_counters(cb) and (ca.tf_correct, ca.tf_total) == (
                cb.tf_correct,
                cb.tf_total,
            )
            assert (cb.unary_steps, cb.unary_committed) == (
                cb.steps,
                cb.committed,
            ) and cb.tf_unary_correct == cb.tf_correct
            assert [x.proposal for x in ba] == [x.proposal for x in bb]
        m = summarize([("s", c) for c, _ in b])
        assert m["selector_gain"] == 0.0 and m["acceptance_length_unary"] == m["acceptance_length"]
        assert "selector_gain" not in summarize([("s", c) for c, _ in a])  # DFlash: the rows are absent, not 0


def test_unary_tau_recall_and_gain_from_counters():
    """Hand-made proposals on a 10-token reference, B = 4: the walk, the unary argmax and the top-k by hand."""
    seq, P, B4 = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 2, 4  # anchors 2..8; labels after anchor p: seq[p+1 : p+4]
    g = lambda i: seq[i] if i < len(seq) else -1  # noqa: E731
    walk = [[g(p + 1), g(p + 2), 0] for p in range(P, 9)]  # slots 1-2 right, slot 3 wrong
    unary = [[g(p + 1), 0, 0] for p in range(P, 9)]  # slot 1 right only
    topk = torch.tensor(
        [
            [[u, w, g(p + 3) if k == 2 else 0] for k, (u, w) in enumerate(zip(un, wa))]
            for p, un, wa in zip(range(P, 9), unary, walk)
        ]
    )  # [A, 3, k=3]: every gold is in the top-k
    c, _ = replay(seq, P, walk, B4, selector=True)
    cu, _ = replay(seq, P, unary, B4)
    c.unary_steps, c.unary_committed = cu.steps, cu.committed
    teacher_forced(seq, P, walk, c, unary=torch.tensor(unary), topk=topk)
    # the walk commits 3 per step from anchor 2: 2, 5 (3 each), then 8 (1: the reference ends) -> 7 / 3;
    # the unary commits 2 per step: 2, 4, 6, 8 -> 7 / 4
    assert (c.steps, c.committed, cu.steps, cu.committed) == (3, 7, 4, 7)
    assert unary_accuracy(c) == [1.0, 0.0, 0.0] and c.tf_total == [7, 6, 5]
    assert topk_recall(c) == [1.0, 1.0, 1.0] and position_curves(c)["accuracy"] == [1.0, 1.0, 0.0]
    other = Counters(block_size=B4, selector=True)
    for a, commit in ((1, 2), (1, 2)):  # a second prompt: both walks commit 2 per step
        count_step(other, a, commit)
    other.unary_steps, other.unary_committed = 2, 4
    m = summarize([("s", c), ("s", other)])
    assert m["acceptance_length_unary"] == pytest.approx(11 / 6) and m["acceptance_length"] == pytest.approx(11 / 5)
    assert m["selector_gain"] == pytest.approx(11 / 5 - 11 / 6) and m["selector_gain_se"] is not None
    assert m["expected_acceptance_length_topk"] == pytest.approx(4.0) and m[
        "expected_acceptance_length_unary"
    ] == pytest.approx(2.0)
