"""The replay's LM head (dflash/models/drafter/head.py through dflash/stages/replay/drafts.py): the counters do not
depend on how the vocabulary is chunked, and the `all` mode with a stride pays the head only for the slots a walk
reads while its walk, counter for counter, is the one at stride 1."""

from __future__ import annotations

import pytest
import torch
from conftest import loop_counters
from test_dflash2 import make_dflash2
from test_dflash2_replay import case, tf  # noqa: F401  (the module-scoped DFlash2 fixture)
from test_dflash2_replay import run as run2
from test_replay_modes import cases, run  # noqa: F401  (the module-scoped DFlash fixture)

from dflash.models.drafter import head as head_mod
from dflash.models.drafter.dflash2 import propose
from dflash.stages.replay import drafts


def blocks(out):
    return [[(b.anchor_pos, b.accepted, b.proposal, b.unary) for b in bs] for _, bs in out]


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
@pytest.mark.parametrize("anchors, stride", [("all", 1), ("all", 3), ("visited", 3)])
def test_counters_do_not_depend_on_the_vocabulary_chunks(qwen3_target, cases, case, monkeypatch, arch, anchors, stride):  # noqa: F811
    """The head over 16 chunks of 16 ids (and one anchor per head call) gives one chunk's counters, blocks and
    scores, in every mode."""
    if arch == "dflash":
        drafter, items = cases[0]
        go, tfc = run, lambda c: (c.tf_correct, c.tf_total)
    else:
        (drafter, items), go, tfc = case, run2, tf
    kw = dict(anchors=anchors, tf_stride=stride, scores=True)
    one = go(qwen3_target, drafter, items, **kw)
    monkeypatch.setattr(head_mod, "MIN_COLS", 16)
    monkeypatch.setattr(drafts, "HEAD_BYTES", 1)
    many = go(qwen3_target, drafter, items, **kw)
    assert blocks(many) == blocks(one)
    for (cm, _), (co, _) in zip(many, one):
        assert loop_counters(cm) == loop_counters(co) and tfc(cm) == tfc(co)
        assert (cm.unary_steps, cm.unary_committed) == (co.unary_steps, co.unary_committed)
        assert cm.tf_nll == pytest.approx(co.tf_nll, rel=1e-5) and cm.tf_conf == pytest.approx(co.tf_conf, rel=1e-5)


@pytest.mark.parametrize("other", [False, True])
@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_all_with_a_stride_pays_the_head_only_for_the_slots_read(qwen3_target, cases, case, monkeypatch, arch, other):  # noqa: F811
    """`all` at stride 4: every slot through the head at every 4th anchor, at the others only the slots the walk reads
    (fewer head rows than at stride 1); the walk is stride 1's, counter for counter and block for block (its
    proposals a prefix of stride 1's, through the first rejected slot); teacher forcing at every 4th anchor. With the
    convention check (`other`) the other convention's walk is stride 1's too, its lazy head on the rows it reads."""
    if arch == "dflash":
        drafter, items = cases[0]
        go = run
    else:
        (drafter, items), go = case, run2
    rows: list[int] = []
    select = drafts.select
    monkeypatch.setattr(drafts, "select", lambda hd, h, *a, **kw: (rows.append(h.shape[0]), select(hd, h, *a, **kw))[1])
    full = go(qwen3_target, drafter, items, anchors="all", tf_stride=1, other=other)
    n1, rows[:] = sum(rows), []
    part = go(qwen3_target, drafter, items, anchors="all", tf_stride=4, other=other)
    # these references accept much: the walk reads about half the slots (the other convention's, off by one, few more)
    assert sum(rows) < (0.7 if other else 0.6) * n1
    assert sum(c.accepted for c, _ in full) > len(items), "the references should make the drafter accept tokens"
    for (cf, bf), (cp, bp), (x, r, _) in zip(full, part, items):
        assert loop_counters(cp) == loop_counters(cf)
        assert (cp.unary_steps, cp.unary_committed) == (cf.unary_steps, cf.unary_committed)
        assert (cp.other_steps, cp.other_committed) == (cf.other_steps, cf.other_committed)
        assert cp.tf_total[0] == len(range(0, len(r) - 1, 4))
        for b_p, b_f in zip(bp, bf, strict=True):
            assert (b_p.anchor_pos, b_p.accepted) == (b_f.anchor_pos, b_f.accepted)
            assert b_p.proposal == b_f.proposal[: len(b_p.proposal)]
            assert len(b_p.proposal) >= min(b_f.accepted + 1, len(x) + len(r) - 1 - b_f.anchor_pos, len(b_f.proposal))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identity_dflash2_proposes_as_dflash_on_tied_logits(qwen3_target, make_drafter, dtype):
    """An identity DFlash2 (zero successor codebook) walks its unary argmax, so it proposes what DFlash proposes, also
    where the head's logits tie (integer-valued head, bfloat16): the canonical top k's first id is the argmax."""
    from torch import nn

    d = make_drafter(qwen3_target, block_size=5, seed=1).to(dtype)
    two = make_dflash2(make_drafter, qwen3_target, identity=True, block_size=5, seed=1).to(dtype)
    V, H = qwen3_target.vocab_size, d.cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(H, V, bias=False, dtype=dtype)
    lin.weight.data = torch.randint(-1, 2, (V, H), generator=g).to(dtype)
    h = torch.randint(-1, 2, (16, 4, H), generator=g).to(dtype)
    anchor = torch.randint(0, V, (16,), generator=g)
    z = lin(h)
    assert (z.topk(2, -1).values[..., 0] == z.topk(2, -1).values[..., 1]).any(), "the head should tie at the top"
    a, b = propose(d, lin, h, anchor), propose(two, lin, h, anchor)
    assert torch.equal(a.tokens, z.argmax(-1)) and torch.equal(b.tokens, a.tokens) and torch.equal(b.unary, a.tokens)
