"""The replay's modes (`replay.anchors` all | visited, `replay.tf_stride`) give the exact replay's counters:
the loop's counters and blocks equal in every mode, the teacher-forced counters equal at the same stride,
a lockstep group equal to its prompts replayed one by one, and the lazy LM head equal to the full one on
the slots the walk reads. The references are built so that the drafter's own proposals are accepted
along the way (a random drafter alone would reject at slot 1 and test nothing past it)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from conftest import loop_counters
from shortcuts import draft_every_anchor

from dflash.models.drafter.model import DFlashDrafter
from dflash.models.target.forward import tapped_forward
from dflash.stages.replay.loop import (
    ReplayOptions,
    lazy_greedy,
    prepare,
    replay_group,
)

B = 6


def accepting_reference(target, drafter, prompt: list[int], n_new: int, seed: int) -> list[int]:
    """A reference the drafter partly predicts: at each anchor take the drafter's first m proposals
    (m random in 0..B-1), then one random token (a bonus that differs from the next proposal)."""
    rng = random.Random(seed)
    seq = list(prompt) + [rng.randrange(3, 200)]  # the prefill's token
    while len(seq) < len(prompt) + n_new:
        ext = seq + [0]  # one more position so that the last one is an anchor (its own tap is never seen)
        taps = tapped_forward(target, torch.tensor([ext]), drafter.cfg.target_layer_ids)[0]
        prop = draft_every_anchor(drafter, target, torch.tensor(ext), taps, len(seq) - 1)[0][-1].tolist()
        m = rng.randrange(B)
        seq += prop[:m] + [rng.choice([t for t in range(3, 200) if m == B - 1 or t != prop[m]])]
    return seq[len(prompt) : len(prompt) + n_new]


@pytest.fixture(scope="module")
def cases(qwen3_target, make_drafter):
    """A drafter (and a sliding-window one) with three prompts of different lengths and references it partly
    predicts."""
    d = make_drafter(qwen3_target, num_layers=2, block_size=B, seed=1, std=0.2)
    sw = (
        DFlashDrafter(replace(d.cfg, layer_types=["sliding_attention", "full_attention"], sliding_window=5))
        .init_weights(1, std=0.2)
        .eval()
    )
    rng = random.Random(0)
    out = []
    for drafter in (d, sw):
        items = []
        for i, (P, n) in enumerate([(4, 40), (9, 25), (6, 33)]):
            x = [rng.randrange(3, 200) for _ in range(P)]
            r = accepting_reference(qwen3_target, drafter, x, n, seed=i)
            taps = tapped_forward(qwen3_target, torch.tensor([x + r]), drafter.cfg.target_layer_ids)[0]
            items.append((x, r, taps))
        out.append((drafter, items))
    return out


def run(target, drafter, items, **kw):
    seqs = [prepare(drafter, target, x, r, taps) for x, r, taps in items]
    return replay_group(drafter, target, seqs, ReplayOptions(**kw))


@pytest.mark.parametrize("which", [0, 1], ids=["full", "sliding"])
@pytest.mark.parametrize("stride, chunk, scores", [(1, 32, False), (3, 32, True), (4, 2, False), (1, 1, True)])
def test_visited_equals_all(qwen3_target, cases, which, stride, chunk, scores):
    drafter, items = cases[which]
    exact = run(qwen3_target, drafter, items, anchors="all", tf_stride=stride, chunk=chunk, scores=scores)
    visited = run(qwen3_target, drafter, items, anchors="visited", tf_stride=stride, chunk=chunk, scores=scores)
    assert sum(c.accepted for c, _ in exact) > len(items), "the references should make the drafter accept tokens"
    for (ce, be), (cv, bv), (x, r, _) in zip(exact, visited, items):
        assert loop_counters(cv) == loop_counters(ce)
        assert [(b.anchor_pos, b.accepted) for b in bv] == [(b.anchor_pos, b.accepted) for b in be]
        for b_v, b_e in zip(
            bv, be
        ):  # the lazy head's proposal: a prefix of the full one, through the first rejected slot
            assert b_v.proposal == b_e.proposal[: len(b_v.proposal)]
            assert len(b_v.proposal) >= min(b_e.accepted + 1, len(x) + len(r) - 1 - b_e.anchor_pos, B - 1)
        assert (cv.tf_correct, cv.tf_total) == (ce.tf_correct, ce.tf_total)
        if scores:
            assert cv.tf_nll == pytest.approx(ce.tf_nll, rel=1e-5) and cv.tf_conf == pytest.approx(ce.tf_conf, rel=1e-5)


def test_passes_pack_whole_prompts_and_split_long_ones():
    from dflash.stages.replay.drafts import _passes

    assert _passes([40, 25, 0, 33], 100) == [
        [(0, 0, 40), (1, 0, 25)],
        [(3, 0, 33)],
    ]  # 3 x 40 > 100: the third starts a pass
    assert _passes([5, 12, 3], 8) == [
        [(0, 0, 5)],
        [(1, 0, 8)],
        [(1, 8, 12)],
        [(2, 0, 3)],
    ]  # 2 x 5 > 8; 12 > 8: split alone


@pytest.mark.parametrize("which", [0, 1], ids=["full", "sliding"])
@pytest.mark.parametrize("scores, see_anchor", [(False, False), (True, False), (False, True)])
def test_prompts_packed_in_one_pass_equal_one_prompt_per_pass(
    qwen3_target, cases, monkeypatch, which, scores, see_anchor
):
    """`all`: the group's prompts in one drafter pass (a large anchors_per_chunk: how CUDA runs a small drafter),
    its LM head in pieces of one anchor, and each prompt alone split over passes of 3 anchors: the same counters,
    teacher-forced counters and blocks."""
    from dflash.stages.replay import drafts

    drafter, items = cases[which]
    split = [
        run(qwen3_target, drafter, [it], anchors="all", chunk=3, scores=scores, see_anchor=see_anchor)[0]
        for it in items
    ]
    packed = run(qwen3_target, drafter, items, anchors="all", chunk=1000, scores=scores, see_anchor=see_anchor)
    monkeypatch.setattr(drafts, "HEAD_BYTES", 1)
    pieces = run(qwen3_target, drafter, items, anchors="all", chunk=1000, scores=scores, see_anchor=see_anchor)
    for (cs, bs), (cp, bp), (cq, bq) in zip(split, packed, pieces):
        for c, b in ((cp, bp), (cq, bq)):
            assert loop_counters(c) == loop_counters(cs) and (c.tf_correct, c.tf_total) == (cs.tf_correct, cs.tf_total)
            assert [(x.anchor_pos, x.accepted, x.proposal) for x in b] == [
                (x.anchor_pos, x.accepted, x.proposal) for x in bs
            ]
            if scores:
                assert c.tf_nll == pytest.approx(cs.tf_nll, rel=1e-5) and c.tf_conf == pytest.approx(
                    cs.tf_conf, rel=1e-5
                )


def test_stride_counts_every_sth_anchor(qwen3_target, cases):
    drafter, items = cases[0]
    full = run(qwen3_target, drafter, items, anchors="all")
    for s in (2, 5):
        part = run(qwen3_target, drafter, items, anchors="visited", tf_stride=s)
        for (cf, _), (cp, _), (x, r, _) in zip(full, part, items):
            anchors = len(r) - 1  # P .. T-2
            assert cp.tf_total[0] == len(range(0, anchors, s)) and cf.tf_total[0] == anchors
            assert loop_counters(cp) == loop_counters(cf)


def test_lockstep_group_equals_one_prompt_at_a_time(qwen3_target, cases):
    drafter, items = cases[0]
    together = run(qwen3_target, drafter, items, anchors="visited", tf_stride=7, chunk=2)
    alone = [run(qwen3_target, drafter, [it], anchors="visited", tf_stride=7)[0] for it in items]
    for (ct, bt), (ca, ba) in zip(together, alone):
        assert loop_counters(ct) == loop_counters(ca) and (ct.tf_correct, ct.tf_total) == (ca.tf_correct, ca.tf_total)
        assert [(b.anchor_pos, b.accepted, b.proposal) for b in bt] == [
            (b.anchor_pos, b.accepted, b.proposal) for b in ba
        ]


def test_leak_probe_mode_agrees(qwen3_target, cases):
    drafter, items = cases[0]
    a = run(qwen3_target, drafter, items, anchors="all", see_anchor=True)
    v = run(qwen3_target, drafter, items, anchors="visited", tf_stride=3, see_anchor=True)
    assert [loop_counters(c) for c, _ in a] == [loop_counters(c) for c, _ in v]


def test_lazy_head_reads_only_the_slots_it_needs(qwen3_target, cases):
    torch.manual_seed(0)
    K, H = B - 1, qwen3_target.config.hidden_size
    h = torch.randn(4, K, H)
    full = qwen3_target.lm_head(h.reshape(-1, H)).argmax(-1).view(4, K)
    labels = full.clone()
    labels[0, 0] += 1  # row 0: rejected at slot 1
    labels[1, 2] += 1  # row 1: slots 1-2 accepted, rejected at 3
    labels[3, 3:] = -1  # row 3: the reference ends after slot 3, all accepted
    rows = []
    head = qwen3_target.lm_head
    counting = lambda x: (rows.append(x.shape[0]), head(x))[1]  # noqa: E731
    qwen3_target.lm_head = counting
    try:
        props = lazy_greedy(cases[0][0], qwen3_target, h, labels)
    finally:
        qwen3_target.lm_head = head
    assert props[0] == full[0, :1].tolist()  # groups of 1, 2, 4: slot 1 only
    assert props[1] == full[1, :3].tolist()  # slots 1, then 2-3
    assert props[2] == full[2].tolist()  # all accepted: every group
    assert props[3] == full[3, :3].tolist()  # nothing past the reference's end
    assert sum(rows) < 4 * K and rows[0] == 4  # fewer LM-head rows than the full head's
