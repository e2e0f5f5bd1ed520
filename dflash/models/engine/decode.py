"""The static-cache decoding engine: prefill, one-token steps, B-token verify, rollback.

One engine serves two loops: `Generator` (dflash/models/engine/generator.py: local references on CUDA,
target-only decoding for the online speed-up's baseline) and the online DFlash loop
(`speculative.OnlineDecoder`).

The cache. Every full-attention layer's keys and values live in one preallocated tensor
[b, kv_heads, L, d]. A forward writes its q tokens at cache positions `write` [q] (shared by the
rows) and attends through a 4D mask built here: the query of row r at cache position w sees key
k iff start[r] <= k <= w, where start[r] is the first position of row r's left-padded prompt; its
position id is w - start[r]. So rolling back is moving the write position back: whatever lies
beyond is masked until it is overwritten. Gated DeltaNet layers (Qwen3.5 / 3.6) carry a
convolution and a recurrent state that no mask can undo: `save_state` copies them before a
verify, and `rollback` restores that copy and re-advances it over the kept tokens (one more
forward of a + 1 tokens whenever a block is cut; docs/family.md §6).

Speed (CUDA). Fixed shapes let a whole step be captured once as a CUDA graph and replayed with one
launch: `Generator`'s step and the online loop's draft and verify passes. `compile=True` runs
inductor over the step first, fusing the small kernels a CUDA graph still launches one by one.
Both costs are paid once per engine and reported apart (`Engine.setup_s`). Prefill runs eagerly, in chunks that bound
its memory. On CPU
the same step functions run eagerly, attending over the written positions only.

transformers glue lives here and nowhere else in the engine: the forward's cache keyword
(`past_key_values` in 5.17, `cache` in 5.24, via `forward.cache_kwarg`), `StaticCache` built from
the config with our own layer class for full attention (both releases keep a running count in
their `StaticLayer`; ours writes where it is told), and the linear-attention layers' `conv_states`
/ `recurrent_states` dicts and `reset()`, which both releases share. Hybrid targets take a mask
per layer type (`{"full_attention": 4D, "linear_attention": 2D padding mask}`), others the 4D mask.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
from torch import Tensor

from dflash.models.engine import gqa
from dflash.models.target.forward import cache_kwarg, tap
from dflash.models.target.model import Target
from dflash.util.errors import TargetError

# --- the cache ------------------------------------------------------------------------------


class _Slots:
    """Where the next forward writes ([q] cache positions) and how many positions it reads."""

    def __init__(self, write: Tensor, view: int):
        self.write, self.view = write, view


def _kv_layer_class():
    from transformers.cache_utils import StaticLayer

    class KVLayer(StaticLayer):
        """Full attention's static keys/values, written at `slots.write` (not at a running count)."""

        def __init__(self, max_cache_len: int, slots: _Slots):
            super().__init__(max_cache_len=max_cache_len)
            self.slots = slots

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            write = self.slots.write.to(self.keys.device)  # a no-op unless the target is sharded
            self.keys.index_copy_(2, write, key_states)  # [b, h, L, d]
            self.values.index_copy_(2, write, value_states)
            n = self.slots.view
            return self.keys[:, :, :n], self.values[:, :, :n]

    return KVLayer


def unsupported(config) -> str | None:
    """Why the engine cannot run a target of this config (a sliding-window layer, say), or None."""
    from transformers import StaticCache
    from transformers.cache_utils import LinearAttentionLayer, StaticLayer

    for i, layer in enumerate(StaticCache(config=config, max_cache_len=1).layers):  # layers allocate lazily: cheap
        if type(layer) not in (StaticLayer, LinearAttentionLayer):
            return (
                f"decoder layer {i} keeps a {type(layer).__name__} cache: the static decoding engine handles full "
                "attention and Gated DeltaNet layers only"
            )
    return None


def static_cache(config, max_len: int, slots: _Slots):
    """transformers' StaticCache for `config`, its full-attention layers swapped for ours."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    if (why := unsupported(config)) is not None:
        raise TargetError(why + ": the online loop cannot run this target (the offline replay and the references can)")
    cache = StaticCache(config=config, max_cache_len=max_len)
    KVLayer = _kv_layer_class()
    for i, layer in enumerate(cache.layers):
        if type(layer) is StaticLayer:
            cache.layers[i] = KVLayer(max_len, slots)
    return cache


# --- the engine -----------------------------------------------------------------------------


class Engine:
    """Static-cache forwards of one target for `batch` rows of at most `max_len` positions.

    taps: decoder layers whose outputs `forward` also returns (DFlash's context features).
    graphs: capture step functions as CUDA graphs (default: on one CUDA device). compile: inductor first.
    """

    def __init__(
        self,
        target: Target,
        batch: int,
        max_len: int,
        taps: Sequence[int] = (),
        graphs: bool | None = None,
        compile: bool = False,
    ):
        self.target, self.batch, self.max_len, self.taps = target, batch, max_len, list(taps)
        dev = self.device = target.device
        sharded = len(set(getattr(target.model, "hf_device_map", {}).values())) > 1
        self.graphs = dev.type == "cuda" and not sharded if graphs is None else graphs
        if self.graphs and (dev.type != "cuda" or sharded):
            raise TargetError(
                f"CUDA graphs need a target on one CUDA device; this one is on {dev}"
                + (" and others" if sharded else "")
            )
        self.compile = compile
        self.decoder = target.model.get_decoder()
        self.head = target.model.get_output_embeddings()
        self.cache_kw = cache_kwarg(type(self.decoder))
        self.slots = _Slots(torch.zeros(1, dtype=torch.long, device=dev), 1)
        self.cache = static_cache(target.config, max_len, self.slots)
        self.linear = [layer for layer in self.cache.layers if hasattr(layer, "recurrent_states")]
        self._saved: list[tuple[Tensor, Tensor]] = []
        self.start = torch.zeros(batch, dtype=torch.long, device=dev)  # [b] first cache position of each row
        self.positions = torch.arange(max_len, device=dev)  # [L] cache positions
        self.neg = torch.finfo(target.dtype).min
        self.length = 0  # positions written by prefill (the host tracks the rest)
        self.view = max_len  # positions a step function reads when it runs eagerly (Step sets it)
        self.setup_s: dict[str, float] = {}  # name -> seconds of compile (+ warm-up) and of capture
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None
        with torch.no_grad():  # allocate every cache tensor now, before any capture
            self.forward(torch.zeros(batch, 1, dtype=torch.long, device=dev), self.positions[:1], view=1)

    # -- forwards --

    def forward(self, ids: Tensor, write: Tensor, view: int | None = None) -> tuple[Tensor, Tensor | None]:
        """ids [b, q] at cache positions write [q], reading positions < view (default self.view).
        -> final hidden states [b, q, H], taps [b, q, n*H] (None without taps)."""
        n = self.view if view is None else view
        self.slots.write, self.slots.view = write, n
        k = self.positions[:n]
        ok = (k[None, None, :] <= write[None, :, None]) & (k[None, None, :] >= self.start[:, None, None])  # [b, q, n]
        mask = torch.zeros(ok.shape, dtype=self.target.dtype, device=self.device).masked_fill_(~ok, self.neg)[:, None]
        if self.linear:  # hybrid: Gated DeltaNet layers take the 2D padding mask (zeroes left padding)
            mask = {"full_attention": mask, "linear_attention": (write[None, :] >= self.start[:, None]).long()}
        pos = (write[None, :] - self.start[:, None]).clamp(min=0)  # [b, q]
        with gqa.engaged(self.decoder.config):  # grouped heads without repeat_kv under our mask (gqa.py)
            out = self.decoder(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                use_cache=True,
                output_hidden_states=bool(self.taps),
                **{self.cache_kw: self.cache},
            )
        taps = tap(out.hidden_states, self.taps) if self.taps else None
        return out.last_hidden_state, taps

    def greedy(self, h: Tensor) -> Tensor:
        """Final hidden states [..., H] -> the target's greedy tokens [...]."""
        return self.head(h).argmax(-1)

    @torch.no_grad()
    def prefill(
        self, prompts: list[list[int]], pad: int = 0, chunk: int = 512, choose: Callable[[Tensor], Tensor] | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Left-pad the prompts (rows beyond them: one pad token) to P and write positions 0..P-1.
        -> greedy next token [batch], taps [batch, P, n*H] (None without taps)."""
        if not 0 < len(prompts) <= self.batch:
            raise ValueError(f"prefill takes 1..{self.batch} prompts, got {len(prompts)}")
        if min(map(len, prompts)) == 0:
            raise ValueError("prefill got an empty prompt")
        rows = list(prompts) + [[pad]] * (self.batch - len(prompts))
        P = max(len(r) for r in rows)
        if P >= self.max_len:
            raise TargetError(f"a prompt of {P} tokens does not fit the engine's {self.max_len} positions")
        ids = torch.full((self.batch, P), pad, dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, P - len(row) :] = torch.tensor(row)
        ids = ids.to(self.device)
        self.start.copy_(torch.tensor([P - len(r) for r in rows]))
        for layer in self.linear:
            layer.reset()  # recurrent state from zero
        taps = []
        for c0 in range(0, P, chunk):
            c1 = min(P, c0 + chunk)
            h, t = self.forward(ids[:, c0:c1], self.positions[c0:c1], view=c1)
            taps.append(t)
        self.length = P
        first = (
            self.greedy(h[:, -1]) if choose is None else choose(self.head(h[:, -1]))
        )  # choose: logits [batch, V] -> tokens
        return first, (torch.cat(taps, dim=1) if self.taps else None)

    # -- rollback of recurrent state --

    def save_state(self) -> None:
        """Copy the Gated DeltaNet states (before a verify); nothing for attention-only targets."""
        if not self._saved:
            self._saved = [(L.conv_states[0].clone(), L.recurrent_states[0].clone()) for L in self.linear]
            return
        for L, (conv, rec) in zip(self.linear, self._saved):
            conv.copy_(L.conv_states[0])
            rec.copy_(L.recurrent_states[0])

    @torch.no_grad()
    def rollback(self, at: int, kept: Sequence[int]) -> None:
        """After a verify written at positions at.., keep its first len(kept) tokens `kept` (batch 1).
        Attention: nothing to do (later positions are masked until overwritten). Gated DeltaNet:
        restore the state saved before the verify and re-advance it over `kept`."""
        if not self.linear:
            return
        for L, (conv, rec) in zip(self.linear, self._saved):
            L.conv_states[0].copy_(conv)
            L.recurrent_states[0].copy_(rec)
        n = len(kept)
        self.forward(torch.tensor([list(kept)], device=self.device), self.positions[at : at + n], view=at + n)

    # -- capture --

    @torch.no_grad()
    def capture(self, fn: Callable[[], None], name: str) -> "Step":
        """fn (no arguments: it reads and writes static buffers) as a CUDA graph, compiled first
        with `compile`; eager when graphs are off. Seconds spent -> setup_s[name + '_compile_s' / '_capture_s']."""
        if not self.graphs:
            return Step(self, fn, None)
        f = torch.compile(fn, dynamic=False) if self.compile else fn
        self.view = self.max_len
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (and compilation) away from the capture
            for _ in range(3):
                f()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            f()
        torch.cuda.synchronize()
        self.setup_s[f"{name}_compile_s" if self.compile else f"{name}_warmup_s"] = t1 - t0
        self.setup_s[f"{name}_capture_s"] = time.perf_counter() - t1
        return Step(self, fn, graph)


class Step:
    """A captured step: `step(view)` replays the graph, or runs fn eagerly reading `view` positions."""

    def __init__(self, engine: Engine, fn: Callable[[], None], graph):
        self.engine, self.fn, self.graph = engine, fn, graph

    @torch.no_grad()
    def __call__(self, view: int) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.engine.view = view
            self.fn()
