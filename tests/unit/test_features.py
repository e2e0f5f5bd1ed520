"""The feature stage (dflash/stages/features.py) and the truncated, chunked tapped forward under it:
equal to the full forward's hidden_states[L + 1], chunked equal to unchunked (Qwen3 and the hybrid
Qwen3.5 text decoder), one pass for several drafters' taps, and the cache's keys and size cap."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from shortcuts import get_features

from dflash.models.target.forward import forward, tapped_forward
from dflash.models.target.model import load_target
from dflash.stages import features as F
from dflash.stages.features import DiskCache, FeatureStats, feature_key, iter_features
from dflash.util.errors import ConfigError, TargetError
from dflash.util.memo import PROCESS


def _ids(S=2, T=11, seed=0):
    return torch.randint(3, 250, (S, T), generator=torch.Generator().manual_seed(seed))


def _full_taps(target, ids, layers):
    with torch.no_grad():
        hs = forward(target, ids, hidden_states=True).hidden_states
    return torch.cat([hs[L + 1] for L in layers], dim=-1)


@pytest.fixture(autouse=True)
def _fresh_memory():
    PROCESS.clear()
    yield
    PROCESS.clear()


# --- the truncated forward -------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["qwen3_target", "vl_target"])
def test_truncated_forward_equals_the_full_forwards_hidden_states(fixture, request):
    t = request.getfixturevalue(fixture)
    n = t.num_layers
    ids = _ids(2, 23, seed=1)
    for layers in (
        [0],
        [1, n - 2],
        [n - 2, 0, 1],
        [n - 1],
        [0, n - 1],
    ):  # n - 1: after the final norm, as hidden_states[n]
        torch.testing.assert_close(
            tapped_forward(t, ids, layers), _full_taps(t, ids, layers), atol=1e-6, rtol=1e-5, msg=str(layers)
        )


def test_truncated_forward_runs_nothing_after_the_deepest_tap(qwen3_target):
    t = qwen3_target
    ran: list[str] = []
    mods = {
        "layer 3": t.model.model.layers[3],
        "layer 4": t.model.model.layers[4],
        "norm": t.model.model.norm,
        "lm_head": t.model.lm_head,
    }
    handles = [m.register_forward_hook(lambda *_a, name=name: ran.append(name)) for name, m in mods.items()]
    try:
        tapped_forward(t, _ids(), [0, 3])
    finally:
        for h in handles:
            h.remove()
    assert ran == ["layer 3"]


@pytest.mark.parametrize("fixture", ["qwen3_target", "vl_target"])
def test_chunked_features_equal_unchunked(fixture, request):
    """Chunks run through the KV cache (and, on the hybrid decoder, the Gated DeltaNet conv and
    recurrent state): the same states as one pass, for chunk sizes that do and do not divide T."""
    t = request.getfixturevalue(fixture)
    layers = [0, 1, t.num_layers - 1]
    ids = _ids(2, 150, seed=2)
    one = tapped_forward(t, ids, layers)
    for chunk in (64, 50, 7, 150, 1000):
        torch.testing.assert_close(
            tapped_forward(t, ids, layers, chunk_tokens=chunk), one, atol=2e-6, rtol=1e-5, msg=f"chunk {chunk}"
        )


def test_chunked_features_with_right_padding(qwen3_target):
    t = qwen3_target
    ids = _ids(2, 40, seed=3)
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0  # row 1 is 25 tokens, right-padded
    layers = [1, 4]
    one = tapped_forward(t, ids, layers, attention_mask=mask)
    torch.testing.assert_close(
        tapped_forward(t, ids, layers, attention_mask=mask, chunk_tokens=16), one, atol=2e-6, rtol=1e-5
    )
    torch.testing.assert_close(one[1, :25], tapped_forward(t, ids[1:, :25], layers)[0], atol=2e-6, rtol=1e-5)


def test_taps_outside_the_target_are_refused(qwen3_target):
    with pytest.raises(TargetError, match="decoder layers 0..5"):
        tapped_forward(qwen3_target, _ids(), [0, 6])


# --- the stage: union of taps, keys, cache -----------------------------------------------------------


def _seqs(n=3, T=20, seed=4):
    return [row.tolist() for row in _ids(n, T, seed=seed)]


def test_union_of_taps_sliced_per_drafter_equals_separate_passes(qwen3_target, tmp_path, monkeypatch):
    t, seqs = qwen3_target, _seqs()
    a, b = [0, 2, 4], [4, 1]
    calls = []
    real = F.tapped_forward
    monkeypatch.setattr(F, "tapped_forward", lambda *x, **k: calls.append(list(x[2])) or real(*x, **k))
    feats, stats = get_features(t, seqs, [a, b], tmp_path)
    assert calls == [[0, 2, 4, 1]] * len(seqs)  # one pass per sequence for both drafters
    assert feats[0].layer_ids == (0, 2, 4, 1) and stats.computed == len(seqs)
    for f, s in zip(feats, seqs):
        ids = torch.tensor([s])
        torch.testing.assert_close(f.taps(a), tapped_forward(t, ids, a)[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(f.taps(b), tapped_forward(t, ids, b)[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(f.taps(b), _full_taps(t, ids, b)[0], atol=1e-6, rtol=1e-5)
    with pytest.raises(KeyError):
        feats[0].taps([3])


def test_same_request_hits_from_a_new_process_state(qwen3_target, tmp_path):
    t, seqs, taps = qwen3_target, _seqs(), [1, 3]
    first, s1 = get_features(t, seqs, [taps], tmp_path)
    assert (s1.computed, s1.hits, s1.computed_tokens) == (3, 0, 60) and s1.bytes_written > 0
    assert len(list((tmp_path / "features").glob("*/*.safetensors"))) == 3
    again, s2 = get_features(t, seqs, [taps], tmp_path)  # same process: memory
    assert (s2.computed, s2.memory_hits, s2.disk_hits) == (0, 3, 0)
    PROCESS.clear()  # as a new process would start
    disk, s3 = get_features(t, seqs, [taps], tmp_path)
    assert (s3.computed, s3.memory_hits, s3.disk_hits, s3.bytes_written) == (0, 0, 3, 0)
    for a, b, c in zip(first, again, disk):
        assert a.key == b.key == c.key
        assert torch.equal(a.states, b.states) and torch.equal(a.states, c.states)


def test_a_subset_of_stored_layers_hits_and_more_layers_compute_only_the_missing(qwen3_target, tmp_path, monkeypatch):
    t, seqs = qwen3_target, _seqs(2)
    full, _ = get_features(t, seqs, [[0, 2, 4]], tmp_path)
    PROCESS.clear()
    sub, s = get_features(t, seqs, [[4, 0]], tmp_path)
    assert (s.computed, s.disk_hits) == (0, 2)
    assert torch.equal(sub[0].states, full[0].taps([4, 0]))
    PROCESS.clear()
    calls = []
    real = F.tapped_forward
    monkeypatch.setattr(F, "tapped_forward", lambda *x, **k: calls.append(list(x[2])) or real(*x, **k))
    more, s = get_features(t, seqs, [[0, 5]], tmp_path)
    assert calls == [[5], [5]] and s.computed == 2
    torch.testing.assert_close(more[1].states, _full_taps(t, torch.tensor([seqs[1]]), [0, 5])[0], atol=1e-6, rtol=1e-5)
    PROCESS.clear()
    held = DiskCache(tmp_path, 1 << 40).read(more[0].key, len(seqs[0]))
    assert sorted(held) == [0, 2, 4, 5]  # the file kept the earlier layers


def test_cache_keys_miss_on_a_changed_tap_token_dtype_or_target(qwen3_target, qwen3_dir, tmp_path):
    t, seqs, taps = qwen3_target, _seqs(1), [1, 3]
    get_features(t, seqs, [taps], tmp_path)

    def computed(target, seqs, taps):
        PROCESS.clear()
        return get_features(target, seqs, [taps], tmp_path)[1].computed

    assert computed(t, seqs, taps) == 0
    assert computed(t, seqs, [1, 2]) == 1  # a changed tap
    other = [seqs[0][:-1] + [(seqs[0][-1] + 1) % 250]]  # one reference token changed
    assert computed(t, other, taps) == 1
    assert computed(dataclasses.replace(t, identity=t.identity + "-retrained"), seqs, taps) == 1
    bf16 = load_target("hf", str(qwen3_dir), dtype="bfloat16")
    assert feature_key(bf16, seqs[0]) != feature_key(t, seqs[0])
    assert computed(bf16, seqs, taps) == 1
    assert computed(t, seqs, taps) == 0  # the original is still there


def test_cache_off_computes_and_keeps_nothing(qwen3_target, tmp_path):
    for _ in range(2):
        _, s = get_features(qwen3_target, _seqs(2), [[1]], tmp_path, cache=False)
        assert s.computed == 2 and s.bytes_written == 0
    assert not (tmp_path / "features").exists()


def test_eviction_keeps_the_disk_cache_under_its_cap_least_recently_used_first(qwen3_target, tmp_path):
    t, seqs = qwen3_target, _seqs(4, seed=7)
    feats, s = get_features(t, seqs[:1], [[1]], tmp_path)
    size = s.bytes_written
    cache = DiskCache(tmp_path, 1)
    path = [cache.path(feature_key(t, x)) for x in seqs]
    cap_gb = 3.5 * size / 1e9  # room for three files
    for i in (1, 2):
        get_features(t, seqs[i : i + 1], [[1]], tmp_path, max_cache_gb=cap_gb)
    for i, p in enumerate(path[:3]):  # make the order explicit: 0 oldest ... 2 newest
        os.utime(p, ns=(10**18 + i * 10**9,) * 2)
    PROCESS.clear()
    get_features(t, seqs[:1], [[1]], tmp_path, max_cache_gb=cap_gb)  # a hit refreshes 0: now 1 is the oldest
    get_features(t, seqs[3:], [[1]], tmp_path, max_cache_gb=cap_gb)  # a fourth file: one must go
    assert [p.exists() for p in path] == [True, False, True, True]
    assert sum(p.stat().st_size for p in path if p.exists()) <= cap_gb * 1e9


def test_an_unreadable_cache_file_is_recomputed(qwen3_target, tmp_path, caplog):
    t, seqs = qwen3_target, _seqs(1)
    first, _ = get_features(t, seqs, [[2]], tmp_path)
    p = DiskCache(tmp_path, 1).path(first[0].key)
    p.write_bytes(b"not a safetensors file")
    PROCESS.clear()
    again, s = get_features(t, seqs, [[2]], tmp_path)
    assert s.computed == 1 and "unreadable" in caplog.text
    assert torch.equal(again[0].states, first[0].states)


def test_non_finite_states_name_the_prompt_and_layer(qwen3_target, tmp_path, monkeypatch):
    real = F.tapped_forward

    def poisoned(target, ids, layers, **kw):
        out = real(target, ids, layers, **kw)
        for r in range(ids.shape[0]):
            if ids[r, 0] == seqs[1][0]:
                out[r, 7, target.hidden_size + 3] = float("inf")  # second layer requested, position 7
        return out

    seqs = _seqs(3)
    monkeypatch.setattr(F, "tapped_forward", poisoned)
    for batch in (None, 60):  # one sequence per pass; all three in one pass
        with pytest.raises(TargetError, match=r"sequence 1 .*layer 4, first at position 7 of 20.*bfloat16 or float32"):
            get_features(qwen3_target, seqs, [[0, 4]], tmp_path, batch_tokens=batch)


def test_bad_feature_settings_are_config_errors(qwen3_target, tmp_path):
    for kw, name in (
        (dict(chunk_tokens=0), "chunk_tokens"),
        (dict(max_cache_gb=-1), "max_cache_gb"),
        (dict(memory_gb="x"), "memory_gb"),
        (dict(batch_tokens=0), "batch_tokens"),
    ):
        with pytest.raises(ConfigError, match=f"features.{name}"):
            get_features(qwen3_target, _seqs(1), [[1]], tmp_path, **kw)


def test_a_sequence_given_twice_is_computed_once(qwen3_target, tmp_path):
    seqs = _seqs(2)
    feats, s = get_features(qwen3_target, [seqs[0], seqs[1], seqs[0]], [[1, 2]], tmp_path)
    assert s.computed == 2 and torch.equal(feats[0].states, feats[2].states)


def test_iter_features_computes_one_sequence_at_a_time(qwen3_target, tmp_path):
    stats = FeatureStats()
    it = iter_features(qwen3_target, _seqs(3), [[1]], tmp_path, stats=stats)
    first = next(it)
    assert stats.computed == 1 and first.states.shape == (20, 64)
    assert len(list(it)) == 2 and stats.computed == 3 and stats.seconds > 0


def test_the_in_process_cache_is_bounded(qwen3_target, tmp_path):
    seqs = _seqs(3)
    one = 20 * 64 * 4  # bytes of one sequence's layer: [T, H] float32
    get_features(qwen3_target, seqs, [[1]], tmp_path, memory_gb=2.5 * one / 1e9)  # room for two
    assert len(F._MEMORY) == 2 and F._MEMORY.bytes == 2 * one
    _, s = get_features(qwen3_target, seqs[1:], [[1]], tmp_path, memory_gb=2.5 * one / 1e9)
    assert (s.memory_hits, s.disk_hits, s.computed) == (2, 0, 0)
    _, s = get_features(qwen3_target, seqs[:1], [[1]], tmp_path, memory_gb=2.5 * one / 1e9)
    assert (s.memory_hits, s.disk_hits, s.computed) == (0, 1, 0)  # the oldest had gone: from disk


@pytest.mark.parametrize("fixture", ["qwen3_target", "vl_target"])
def test_batched_feature_passes_equal_one_sequence_per_pass(fixture, request, tmp_path):
    """Consecutive sequences of other lengths in one right-padded pass (chunked or not, on the hybrid decoder too): the
    same states as a pass each, every sequence yielded in order at its own length."""
    t = request.getfixturevalue(fixture)
    seqs = [row.tolist()[:n] for row, n in zip(_ids(5, 40, seed=6), (40, 13, 27, 40, 5))]
    layers = [[0, t.num_layers - 1]]
    one, s1 = get_features(t, seqs, layers, tmp_path / "one", cache=False)
    for batch, chunk in ((10_000, None), (10_000, 16), (80, 1024)):
        PROCESS.clear()
        got, s = get_features(
            t, seqs, layers, tmp_path / f"b{batch}_{chunk}", cache=False, batch_tokens=batch, chunk_tokens=chunk
        )
        assert s.computed == s1.computed == len(seqs) and s.computed_tokens == sum(map(len, seqs))
        for a, b, seq in zip(one, got, seqs):
            assert b.states.shape[0] == len(seq) and b.key == a.key
            torch.testing.assert_close(
                b.states, a.states, atol=2e-5, rtol=1e-5, msg=f"batch_tokens {batch}, chunk {chunk}"
            )


def test_batches_hold_consecutive_sequences_within_their_padded_size(qwen3_target, tmp_path, monkeypatch):
    """batch_tokens bounds count x longest; a sequence already held, or given twice, is not recomputed; the caller still
    gets one sequence at a time."""
    calls = []
    real = F.tapped_forward
    monkeypatch.setattr(
        F, "tapped_forward", lambda t, ids, *a, **k: calls.append(tuple(ids.shape)) or real(t, ids, *a, **k)
    )
    seqs = _seqs(5)  # 20 tokens each
    get_features(qwen3_target, seqs[1:2], [[1]], tmp_path)  # seqs[1] held from now on
    calls.clear()
    stats = FeatureStats()
    it = iter_features(
        qwen3_target,
        [seqs[0], seqs[1], seqs[2], seqs[3], seqs[3], seqs[4]],
        [[1]],
        tmp_path,
        stats=stats,
        batch_tokens=40,
    )
    next(it)
    assert calls == [(1, 20)] and stats.computed == 1  # seqs[0] alone: seqs[1] after it needs nothing
    rest = list(it)
    assert len(rest) == 5 and calls == [(1, 20), (2, 20), (1, 20)]  # [2, 3] (the second 3 from memory), then [4]
    assert (stats.computed, stats.memory_hits, stats.disk_hits) == (
        4,
        2,
        0,
    )  # seqs[1] and the second seqs[3] from memory
