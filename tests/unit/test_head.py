"""The drafter's LM head over chunks of the vocabulary (dflash/models/drafter/head.py) equals the full-logit results,
ties included: top-1 = torch.argmax, top-k = the canonical order (value desc, id asc), the scores to rounding.

Two kinds of input:
- random float logits: the selection over chunk products computed once is compared with the selection over the
  same products concatenated (whether a chunk's product has the full product's bits is the BLAS's business: on a
  CPU in float32 at several threads it need not);
- integer-valued h and W (entries in -2..2): every product and sum is exact in float32 and bfloat16 whatever the
  BLAS's order, so the chunked results are compared with the real full product's argmax / topk; the logits are
  small integers, so ties are everywhere, and duplicated rows of W add more.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.models.drafter.dflash2 import candidates, propose, propose_logits, transform
from dflash.models.drafter.head import (
    Head,
    canonical_topk,
    chunk_candidates,
    from_keys,
    head_of,
    keys_of,
    select,
    top_of_chunks,
)
from dflash.models.drafter.model import DFlashDrafter

DTYPES = (torch.float32, torch.bfloat16)
COLS = (1, 7, 64, 1000, 4096)  # 1: a chunk narrower than k; 4096 > V: one chunk


def stable_topk(z: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The reference order, independently of keys: a stable descending sort."""
    v, i = z.sort(dim=-1, descending=True, stable=True)
    return v[..., :k], i[..., :k]


def tie_free(z: Tensor, k: int) -> Tensor:
    """[R] rows whose k+1 largest values are distinct: there torch.topk's ids are determined."""
    v = z.topk(min(k + 1, z.shape[-1]), -1).values
    return (v[:, 1:] != v[:, :-1]).all(-1)


def random_case(dtype: torch.dtype, R: int = 24, H: int = 64, V: int = 3001, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(R, H, generator=g).to(dtype), (torch.randn(V, H, generator=g) * 0.3).to(dtype)


def tied_case(dtype: torch.dtype, R: int = 32, H: int = 48, V: int = 2500, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Exact integer logits in a narrow range, the best rows of W duplicated at scattered ids: heavy ties at the top."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-2, 3, (R, H), generator=g).to(dtype)
    W = torch.randint(-1, 2, (V, H), generator=g).to(dtype)
    W[torch.randperm(V, generator=g)[:300]] = W[torch.randint(0, 40, (300,), generator=g)]  # copies of 40 rows
    W[torch.randperm(V, generator=g)[:50]] = h[torch.randint(0, R, (50,), generator=g)].sign()  # a row's best, repeated
    return h, W


def head(W: Tensor, **kw) -> Head:
    lin = nn.Linear(W.shape[1], W.shape[0], bias=False, dtype=W.dtype)
    lin.weight.data = W
    return Head(whole=lin, weight=W, **kw)


def chunks_once(h: Tensor, W: Tensor, cols: int) -> tuple[list[tuple[int, Tensor]], Tensor]:
    """The chunk products, computed once, and their concatenation: the selection's input and its reference's."""
    chunks = list(head(W).chunks(h, cols))
    return chunks, torch.cat([z for _, z in chunks], -1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_keys_roundtrip_and_order(dtype):
    z = torch.tensor(
        [[1.5, -0.0, 0.0, -1.5, float("inf"), float("-inf"), 1.5, -1e-30, 3e38, float("nan"), -2.0, 1e-40]]
    ).to(dtype)
    keys = keys_of(z, torch.arange(z.shape[1]))
    v, i = from_keys(keys, dtype)
    assert torch.equal(i, torch.arange(z.shape[1])[None])
    assert torch.equal(v.isnan(), z.isnan()) and torch.equal(v[~z.isnan()], z[~z.isnan()])
    assert keys.argsort(-1, descending=True)[0].tolist() == stable_topk(z, z.shape[1])[1][0].tolist()  # NaN first


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", COLS)
def test_top1_random(dtype, cols):
    chunks, z = chunks_once(*random_case(dtype), cols)
    out = top_of_chunks(chunks, 1)
    assert torch.equal(out.ids[:, 0], z.argmax(-1)) and torch.equal(out.values[:, 0], z.max(-1).values)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("k", (1, 8, 16))
def test_topk_random(dtype, cols, k):
    chunks, z = chunks_once(*random_case(dtype), cols)
    ids = torch.arange(z.shape[1])  # k = 1 through the candidates' path too (as with a reduced vocabulary)
    for out in (top_of_chunks(chunks, k), top_of_chunks(chunks, k, ids)):
        tv, ti = z.topk(k, -1)
        assert torch.equal(out.values, tv)  # values: torch.topk's, always
        assert torch.equal(out.ids, stable_topk(z, k)[1]) and torch.equal(out.ids[:, 0], z.argmax(-1))
        free = tie_free(z, k)
        assert torch.equal(out.ids[free], ti[free])  # ids: torch.topk's wherever its order is defined


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("k", (1, 5, 16))
def test_tied_against_the_full_product(dtype, cols, k):
    """Integer logits: the chunked path equals the full F.linear's argmax and its canonical top k, on rows where many
    ids tie at the top; the full-logit canonical_topk (keys) equals the stable sort."""
    h, W = tied_case(dtype)
    z = F.linear(h, W)  # exact
    assert not tie_free(z, k).all(), "the case should have ties"
    ref_v, ref_i = stable_topk(z, k)
    assert torch.equal(canonical_topk(z, k)[1], ref_i) and torch.equal(canonical_topk(z, k)[0], ref_v)
    out = top_of_chunks(head(W).chunks(h, cols), k)
    assert torch.equal(out.values, ref_v) and torch.equal(out.ids, ref_i)
    assert torch.equal(out.ids[:, 0], z.argmax(-1))
    assert torch.equal(select(head(W), h, k, budget=4 * h.shape[0] * cols).ids, ref_i)  # one chunk: MIN_COLS


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_tie_runs_fall_back_to_keys(dtype):
    """A tie run at the k-th value longer than the extra candidates: torch.topk may keep any of its ids, so the chunk
    is ranked by keys; the candidates then hold the lowest ids of the run."""
    g = torch.Generator().manual_seed(2)
    z = torch.zeros(6, 300)
    for r in range(6):
        z[r, torch.randperm(300, generator=g)[: 10 + 10 * r]] = 1.0  # 10..60 tied maxima
        z[r, torch.randperm(300, generator=g)[:2]] = 2.0
    z = z.to(dtype)
    for k in (1, 5, 16):
        v, i = chunk_candidates(z, torch.arange(1000, 1300), k, extra=4)
        ci = stable_topk(z, k)[1]
        assert all(set(c.tolist()) <= set(x.tolist()) for c, x in zip(ci + 1000, i))
        out = top_of_chunks([(lo, z[:, lo : lo + 64]) for lo in range(0, 300, 64)], k, torch.arange(300))
        assert torch.equal(out.ids, ci)


def test_torch_topk_order_on_ties_is_not_argmax():
    """Why the order is defined here: torch.topk's first index on tied maxima is not argmax's (on this CPU)."""
    h, W = tied_case(torch.float32)
    z = F.linear(h, W)
    assert not torch.equal(z.topk(16, -1).indices[:, 0], z.argmax(-1))


def test_dflash2_selects_raw_then_transforms():
    """SGLang's order: the top k of the raw logits, the multiplier and softcap on the k values; a softcap that
    saturates in float32 ties transformed values, and the raw order stands."""
    h, W = random_case(torch.float32)
    W = W * 40  # logits in the hundreds: c·tanh(x/c) saturates at c = 5
    cap = lambda x: torch.tanh(x.float() * 0.5 / 5.0) * 5.0  # noqa: E731
    chunks, raw = chunks_once(h, W, 1000)
    tv, ti = raw.topk(16, -1)
    out = top_of_chunks(chunks, 16)
    assert torch.equal(out.ids, ti) and torch.equal(cap(out.values), cap(tv))
    assert (cap(out.values)[:, 1:] == cap(out.values)[:, :-1]).any(), "the softcap should tie some transformed values"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", (64, 1000, 8000))
def test_scores(dtype, cols):
    """The log-sum-exp (to rounding), the reference's score and the top score (bit for bit), DFlash and DFlash2
    style."""
    h, W = random_case(dtype, V=5003)
    ref = torch.randint(0, W.shape[0], (h.shape[0],), generator=torch.Generator().manual_seed(1))
    chunks, z = chunks_once(h, W, cols)
    for score in (None, lambda x: torch.tanh(x.float() * 2.0 / 3.0) * 3.0):
        y = z.float() if score is None else score(z)
        out = top_of_chunks(chunks, 16, ref_rows=ref, score=score)
        assert torch.equal(out.ids, stable_topk(z, 16)[1])
        assert torch.equal(out.ref_score, y.gather(-1, ref[:, None])[:, 0])
        assert torch.equal(out.top_score, y.max(-1).values)
        lse = y.logsumexp(-1)
        torch.testing.assert_close(out.lse, lse, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(out.nll, lse - y.gather(-1, ref[:, None])[:, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.conf, (y.max(-1).values - lse).exp(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduced_vocabulary_and_scale(dtype):
    """A reduced draft vocabulary (rows at scattered, non-monotone target ids) and a logit scale: select over chunks
    equals the full scattered logits (-inf at ids without a row), ties included; a reference without a row scores
    -inf."""
    h, W = tied_case(dtype, V=700)
    V = 1000
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(5))[:700]
    hd = head(W, scale=2.0, ids=ids, vocab=V)
    full = torch.full((h.shape[0], V), float("-inf"), dtype=dtype)
    full[:, ids] = F.linear(h, W) * 2.0
    ref = torch.arange(h.shape[0]) * 31  # some have a row, some not
    for budget in (4 * h.shape[0] * 2000, 1):  # one chunk; MIN_COLS
        out = select(hd, h, 6, ref=ref, budget=budget)
        assert torch.equal(out.ids, stable_topk(full, 6)[1]) and torch.equal(out.values, stable_topk(full, 6)[0])
        assert torch.equal(out.ref_score, full.float().gather(-1, ref[:, None])[:, 0])
        torch.testing.assert_close(out.lse, full.float().logsumexp(-1))
        top1 = select(hd, h, 1, budget=budget)
        assert torch.equal(top1.ids[:, 0], full.argmax(-1))


def test_full_vocabulary_size():
    """Qwen3.6's 248,320 ids (keys hold ids to 2^32), integer logits: ties across chunk boundaries."""
    g = torch.Generator().manual_seed(3)
    h = torch.randint(-1, 2, (8, 16), generator=g).float()
    W = torch.randint(-1, 2, (248320, 16), generator=g).float()
    z = F.linear(h, W)
    out = top_of_chunks(head(W).chunks(h, 16384), 16)
    assert torch.equal(out.ids, stable_topk(z, 16)[1]) and torch.equal(out.values, z.topk(16, -1).values)
    assert torch.equal(top_of_chunks(head(W).chunks(h, 16384), 1).ids[:, 0], z.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_propose_in_chunks_equals_the_full_logits(qwen3_target, make_drafter, monkeypatch, dtype, arch):
    """The proposal rule through the chunked head (an nn.Linear: its weight in chunks of 64 ids) equals it over the
    full logits (`propose_logits`: argmax; DFlash2: the canonical top-k, walked), on a tied integer-valued head."""
    from test_dflash2 import make_dflash2

    from dflash.models.drafter import head as head_mod

    monkeypatch.setattr(head_mod, "MIN_COLS", 64)
    d = make_drafter(qwen3_target, block_size=5) if arch == "dflash" else make_dflash2(make_drafter, qwen3_target)
    d = d.to(dtype)
    V, Hs = qwen3_target.vocab_size, d.cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(Hs, V, bias=False, dtype=dtype)
    lin.weight.data = torch.randint(-1, 2, (V, Hs), generator=g).to(dtype)
    h = torch.randint(-1, 2, (6, d.cfg.block_size - 1, Hs), generator=g).to(dtype)
    anchor = torch.randint(0, V, (6,), generator=g)
    a = propose(d, lin, h, anchor)  # with 6 x (B - 1) rows, budget 1: chunks of MIN_COLS
    monkeypatch.setattr(head_mod, "HEAD_BYTES", 1)
    b = propose(d, lin, h, anchor)
    c = propose_logits(d, d.logits(lin, h.reshape(-1, Hs)).view(6, d.cfg.block_size - 1, -1), h, anchor)
    for p in (a, b):
        assert torch.equal(p.tokens, c.tokens) and torch.equal(p.unary, c.unary)
        assert (p.topk is None and c.topk is None) or torch.equal(p.topk, c.topk)
    if arch == "dflash2":
        z = d.logits(lin, h.reshape(-1, Hs)).view(6, d.cfg.block_size - 1, -1)
        cand = candidates(d.candidate_selector, d.cfg.dflash2, *canonical_topk(z, d.cfg.dflash2.selector_top_k), h)
        assert torch.equal(cand.ids, stable_topk(z, d.cfg.dflash2.selector_top_k)[1])
        assert torch.equal(cand.scores, transform(stable_topk(z, d.cfg.dflash2.selector_top_k)[0], d.cfg.dflash2))


def test_head_of_a_reduced_vocabulary_drafter(qwen3_target, make_drafter):
    """head_of: the drafter's own lm_head, its d2t ids and logit_scale: select's argmax equals DFlashDrafter.logits'."""
    base = make_drafter(qwen3_target)
    V = qwen3_target.vocab_size
    cfg = dataclasses.replace(
        base.cfg, own_lm_head=True, draft_vocab_size=64, vocab_map=True, logit_scale=0.5, vocab_size=V
    )
    d = DFlashDrafter(cfg).init_weights(1).eval()
    d.d2t.copy_(torch.randperm(qwen3_target.vocab_size, generator=torch.Generator().manual_seed(0))[:64].sort().values)
    d.d2t -= torch.arange(64)
    h = torch.randn(9, cfg.hidden_size)
    hd = head_of(d, qwen3_target.lm_head)
    assert hd.weight is d.lm_head.weight and hd.scale == 0.5
    z = d.logits(qwen3_target.lm_head, h)
    assert torch.equal(select(hd, h, 1).ids[:, 0], z.argmax(-1))
    assert torch.equal(select(hd, h, 3).ids, stable_topk(z, 3)[1])
