"""The feature stage: the target's tapped hidden states over every prompt + reference, computed once.

A sequence's features are the outputs of the tapped decoder layers at every position ([T, n*H],
docs/family.md §1), from `dflash.models.target.forward.tapped_forward`: the forward stops after the deepest tap (no
later
layer, no LM head) and long sequences run in chunks of `chunk_tokens` through the KV cache. They
depend only on the target (identity, dtype, device type, attention implementation), the token ids
and the taps, so they are cached by that content:

- in process: a least-recently-used dict bounded by `memory_gb`, so the jobs of a `-m` sweep in one
  process compute them once;
- on disk: `<cache_dir>/features/<key[:2]>/<key>.safetensors`, one file per sequence holding one
  tensor per layer (`layer_<L>`, [T, H], the target's dtype). A request for layers the file holds
  reads them; one for more computes only the missing layers and rewrites the file with all of them.
  Written to a temp name and renamed; beyond `max_cache_gb` the least recently used files (mtime,
  refreshed on every hit) are removed.

Drafters with different taps share one forward: `iter_features(target, seqs, [taps_a, taps_b], ...)`
taps the union and `Features.taps(taps_a)` slices per drafter.

Sequences that need the target run in batches on CUDA (`batch_tokens`: at most that many padded positions per
pass, consecutive sequences right-padded to the longest; padding is harmless, the target being causal), so a
GPU runs one forward per batch rather than per sequence: at the 27B shape the per-sequence pass was bound by
the host launching kernels (dflash/bench/steady.py's profile). The caller still gets one sequence at a time
and holds at most one batch of computed states.

Not in the key: chunk size, batch and thread count, which change the states only by float rounding.

    stats = FeatureStats()
    for f in iter_features(target, [x + r for x, r in zip(prompts, refs)], [drafter_taps], cache_dir, stats=stats):
        taps = f.taps(drafter_taps)                             # [T, n*H], one sequence at a time
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import Tensor

from dflash.config.schema import FeaturesConfig
from dflash.models.target.forward import tapped_forward
from dflash.models.target.model import Target
from dflash.util.errors import ConfigError, TargetError
from dflash.util.files import atomic_write
from dflash.util.memo import PROCESS
from dflash.util.progress import Progress, log


@dataclass
class Features:
    """One sequence's tapped states: states[:, i*H:(i+1)*H] is the output of decoder layer layer_ids[i]."""

    key: str
    layer_ids: tuple[int, ...]
    states: Tensor  # [T, n*H]

    def taps(self, layer_ids: Sequence[int]) -> Tensor:
        """-> [T, m*H] for `layer_ids` (a subset of self.layer_ids), in that order."""
        if tuple(layer_ids) == self.layer_ids:
            return self.states
        H = self.states.shape[-1] // len(self.layer_ids)
        pos = {L: i for i, L in enumerate(self.layer_ids)}
        if any(L not in pos for L in layer_ids):
            raise KeyError(f"taps {list(layer_ids)} are not all among the computed layers {list(self.layer_ids)}")
        return torch.cat([self.states[:, pos[L] * H : (pos[L] + 1) * H] for L in layer_ids], dim=-1)


@dataclass
class FeatureStats:
    sequences: int = 0
    memory_hits: int = 0  # sequences served from this process's memory
    disk_hits: int = 0  # ... from the disk cache (some layers may have come from memory)
    computed: int = 0  # sequences that ran the target (for all requested layers or the missing ones)
    computed_tokens: int = 0
    bytes_written: int = 0
    cache_bytes: int = 0  # the disk cache's size after this stage
    seconds: float = 0.0

    @property
    def hits(self) -> int:
        return self.memory_hits + self.disk_hits


# --- keys ------------------------------------------------------------------------------------------


def feature_key(target: Target, ids: Sequence[int]) -> str:
    """Content key of one sequence's features on this target (every layer of it)."""
    blob = json.dumps([target.identity, str(target.dtype), target.device.type, target.attn, list(ids)])
    return hashlib.sha256(blob.encode()).hexdigest()


# --- in-process cache --------------------------------------------------------------------------------


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


_MEMORY = PROCESS.memo("features", size_of=_nbytes)  # (key, layer) -> [T, H], least recently used first


# --- disk cache --------------------------------------------------------------------------------------


class DiskCache:
    """One safetensors file per sequence under <root>/<key[:2]>/; size-capped, least recently used out."""

    def __init__(self, cache_dir: str | Path, max_bytes: int):
        self.root = Path(cache_dir).expanduser() / "features"
        self.max_bytes = max_bytes
        self.size = sum(s for _, s, _ in self._files())
        self.writable = True

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.safetensors"

    def _files(self) -> list[tuple[int, int, Path]]:
        """(mtime_ns, bytes, path) of every entry, oldest first."""
        out = []
        for p in self.root.glob("*/*.safetensors"):
            try:
                st = p.stat()
            except OSError:  # removed meanwhile by another process
                continue
            out.append((st.st_mtime_ns, st.st_size, p))
        return sorted(out)

    @staticmethod
    def _stored(f, key: str, tokens: int) -> set[int]:
        """Layers of an open file, if it is this key's (a foreign or stale file holds none)."""
        meta = f.metadata() or {}
        if meta.get("key") != key or int(meta.get("tokens", -1)) != tokens:
            return set()
        return {int(n.removeprefix("layer_")) for n in f.keys()}

    def layers(self, key: str, tokens: int) -> set[int]:
        """The layers this key's file holds, from its header only."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.path(key)), framework="pt") as f:
                return self._stored(f, key, tokens)
        except (OSError, SafetensorError, ValueError):
            return set()

    def read(self, key: str, tokens: int, layers: Sequence[int] | None = None) -> dict[int, Tensor]:
        """The requested layers (None: all) this key's file holds."""
        from safetensors import SafetensorError, safe_open

        p = self.path(key)
        if not p.is_file():
            return {}
        try:
            with safe_open(str(p), framework="pt") as f:
                stored = self._stored(f, key, tokens)
                got = {L: f.get_tensor(f"layer_{L}") for L in (stored if layers is None else layers) if L in stored}
        except (OSError, SafetensorError, ValueError) as e:
            log.warning("features: ignoring unreadable cache file %s (%s); it will be rewritten", p, e)
            return {}
        if got:
            try:
                os.utime(p)  # least recently used = oldest mtime
            except OSError:
                pass
        return got

    def write(self, key: str, tokens: int, layers: dict[int, Tensor]) -> int:
        """Add `layers` to this key's file (keeping the layers it held); -> bytes written (0: not writable)."""
        from safetensors.torch import save_file

        if not self.writable:
            return 0
        p = self.path(key)
        old = p.stat().st_size if p.is_file() else 0
        merged = {**(self.read(key, tokens) if old else {}), **layers}
        tensors = {f"layer_{L}": t.detach().to("cpu").contiguous() for L, t in merged.items()}
        meta = {"key": key, "tokens": str(tokens), "layers": ",".join(str(L) for L in sorted(merged))}
        try:
            atomic_write(p, lambda tmp: save_file(tensors, tmp, metadata=meta))
        except OSError as e:
            self.writable = False
            log.warning(
                "features: cannot write the cache under %s (%s); features are computed but not kept", self.root, e
            )
            return 0
        new = p.stat().st_size
        self.size += new - old
        if self.size > self.max_bytes:
            self.evict()
        return new

    def evict(self) -> None:
        files = self._files()
        self.size = sum(s for _, s, _ in files)
        for _, s, p in files:
            if self.size <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            self.size -= s
            log.info(
                "features: cache over %.2f GB: removed %s (%.1f MB, least recently used)",
                self.max_bytes / 1e9,
                p.name,
                s / 1e6,
            )


# --- the stage -----------------------------------------------------------------------------------------


def _check_finite(states: dict[int, Tensor], seq_index: int) -> None:
    for L, t in states.items():
        bad = ~torch.isfinite(t).all(dim=-1)  # [T]
        if bool(bad.any()):
            pos = int(bad.nonzero()[0])
            raise TargetError(
                f"the target's hidden states are not finite: sequence {seq_index} (prompt index), layer {L}, first at "
                f"position {pos} of {t.shape[0]}; the target overflows in {str(t.dtype).replace('torch.', '')}: run it "
                f"in "
                "bfloat16 or float32 (device.dtype / target.dtype)"
            )


def _batch(
    seqs: Sequence[Sequence[int]], keys: list[str], need: list[tuple[int, ...]], i: int, batch_tokens: int | None
) -> list[int]:
    """The sequences of the pass that computes sequence i: i and the consecutive ones after it that need the same
    layers (none twice), while the batch's padded size (count x longest) stays within batch_tokens."""
    group, longest = [i], len(seqs[i])
    for j in range(i + 1, len(seqs) if batch_tokens else i + 1):
        if need[j] != need[i] or keys[j] in {keys[g] for g in group}:
            break
        if (len(group) + 1) * max(longest, len(seqs[j])) > batch_tokens:
            break
        group.append(j)
        longest = max(longest, len(seqs[j]))
    return group


def _batched_forward(
    target: Target, seqs: Sequence[Sequence[int]], group: list[int], layers: list[int], chunk_tokens: int | None
) -> dict[int, Tensor]:
    """One target pass over the group, right-padded -> {index: [T_i, m*H]} (each its own copy: no view keeps the batch
    alive)."""
    T = max(len(seqs[g]) for g in group)
    ids = torch.zeros((len(group), T), dtype=torch.long)  # [S, T]; the padding's id is never read back
    for r, g in enumerate(group):
        ids[r, : len(seqs[g])] = torch.tensor(list(seqs[g]))
    out = tapped_forward(target, ids.to(target.device), layers, chunk_tokens=chunk_tokens)  # [S, T, m*H]
    if len(group) == 1:
        return {group[0]: out[0]}
    return {g: out[r, : len(seqs[g])].clone() for r, g in enumerate(group)}


def iter_features(
    target: Target,
    seqs: Sequence[Sequence[int]],
    layer_sets: Sequence[Sequence[int]],
    cache_dir: str | Path = ".cache",
    cache: bool = True,
    max_cache_gb: float = 10.0,
    memory_gb: float = 2.0,
    chunk_tokens: int | None = 1024,
    batch_tokens: int | str | None = "auto",
    stats: FeatureStats | None = None,
) -> Iterator[Features]:
    """Tapped states of each sequence (token ids of prompt + reference) for the union of `layer_sets`
    (one layer list per drafter), in order, one at a time (so the caller never holds them all): from
    memory, from disk, or a truncated target pass for the layers neither holds, batched over the next
    sequences that need the same (`batch_tokens`; auto: by the device, `FeaturesConfig.batch`). `stats` (if given) is
    filled
    as it goes; `cache=False`: compute everything, keep nothing."""
    fc = FeaturesConfig(
        cache, max_cache_gb, memory_gb, chunk_tokens, batch_tokens
    )  # each setting checked where the config is
    batch_tokens = fc.batch(target.device.type == "cuda")
    union = tuple(dict.fromkeys(L for s in layer_sets for L in s))  # first set's order, then the others' new layers
    if not union:
        raise ConfigError("the feature stage needs at least one tap layer")
    H, mem_cap = target.hidden_size, int(memory_gb * 1e9)
    disk = DiskCache(cache_dir, int(max_cache_gb * 1e9)) if cache else None
    stats = stats if stats is not None else FeatureStats()
    stats.sequences = len(seqs)
    keys = [feature_key(target, s) for s in seqs]
    held = [
        {L for L in union if cache and (k, L) in _MEMORY} | (disk.layers(k, len(s)) if disk else set())
        for k, s in zip(keys, seqs)
    ]
    need = [tuple(L for L in union if L not in h) for h in held]  # the layers each sequence's pass must compute
    tokens = sum(len(s) for s, n in zip(seqs, need) if n)
    log.info(
        "features: %d sequences, %d tokens, taps %s on %s: %d cached, %d to compute (%d tokens)%s",
        len(seqs),
        sum(map(len, seqs)),
        list(union),
        target.device,
        sum(not n for n in need),
        sum(bool(n) for n in need),
        tokens,
        "" if disk else ", cache off",
    )
    bar = Progress("features", total=tokens, unit="tok") if tokens else None
    computed: dict[int, Tensor] = {}  # the current batch's states, by sequence index, until yielded
    try:
        for i, (key, seq) in enumerate(zip(keys, seqs)):
            t0 = time.perf_counter()
            got = {L: _MEMORY.get((key, L)) for L in union if cache and (key, L) in _MEMORY}
            from_disk = (
                disk.read(key, len(seq), [L for L in union if L not in got]) if disk and len(got) < len(union) else {}
            )
            got.update({L: t.to(target.head_device) for L, t in from_disk.items()})
            missing = [L for L in union if L not in got]
            states = None
            if missing:
                if (
                    i not in computed or tuple(missing) != need[i]
                ):  # (memory may have dropped layers since `need` was read)
                    group = _batch(seqs, keys, need, i, batch_tokens) if tuple(missing) == need[i] else [i]
                    computed = _batched_forward(target, seqs, group, missing, chunk_tokens)
                states = computed.pop(i)  # [T, m*H]
                new = dict(zip(missing, states.split(H, dim=-1)))
                _check_finite(new, i)
                got.update(new)
                stats.bytes_written += disk.write(key, len(seq), new) if disk else 0
                stats.computed += 1
                stats.computed_tokens += len(seq)
            else:
                stats.disk_hits += bool(from_disk)
                stats.memory_hits += not from_disk
            if cache:
                for L in union:
                    _MEMORY.put((key, L), got[L], cap=mem_cap)
            if states is None or len(missing) < len(union):
                states = torch.cat([got[L] for L in union], dim=-1)  # [T, n*H]
            feats = Features(key, union, states)
            stats.seconds += time.perf_counter() - t0
            if missing and bar is not None:
                bar.update(len(seq))
            yield feats
    finally:
        if bar is not None:
            bar.close(ok=False)  # its clock ran during the caller's work too: the line below says what it cost
    stats.cache_bytes = disk.size if disk else 0
    log.info(
        "features: %d computed (%d tokens), %d from memory, %d from disk in %.1f s%s",
        stats.computed,
        stats.computed_tokens,
        stats.memory_hits,
        stats.disk_hits,
        stats.seconds,
        f"; cache {disk.root} holds {disk.size / 1e6:.1f} MB (cap {disk.max_bytes / 1e9:.1f} GB), "
        f"{stats.bytes_written / 1e6:.1f} MB written"
        if disk
        else "",
    )
