"""The target's forward, its KV cache and its taps: the one place that knows transformers' forward and cache API.

transformers renamed the forward's `past_key_values` to `cache` and changed `DynamicCache.crop`'s
argument across the releases this project supports (a length before 5.24, a negative count to drop
from it on): `forward`, `new_cache`, `crop_cache` hide both.

Taps: tap `L` is the output of decoder layer L, i.e. `hidden_states[L + 1]` of a forward with
`output_hidden_states=True` (`hidden_states[0]` is the embedding output; the last entry is after
the final norm). `tapped_forward` computes them without that forward: it stops after the deepest
tapped layer (no later layer, no LM head), keeps only the tapped layers' outputs, and runs long
sequences in chunks through the KV cache so activation memory is bounded.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from dflash.models.target.model import Target
from dflash.util.errors import TargetError


@lru_cache(maxsize=None)
def _forward_params(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def cache_kwarg(cls: type) -> str:
    """The keyword a transformers model class's forward takes its cache by: `past_key_values` (5.17) or `cache`
    (5.24)."""
    return "cache" if "cache" in _forward_params(cls) else "past_key_values"


def new_cache(target: Target):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=target.config)
    except TypeError:
        return DynamicCache()


def forward(
    target: Target,
    ids: Tensor,
    cache=None,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    hidden_states: bool = False,
    last_logits_only: bool = False,
):
    """One target forward; `cache` (a DynamicCache) is extended in place. `last_logits_only` skips
    the lm_head at every position but the last (taps need no logits)."""
    kw: dict[str, Any] = dict(
        input_ids=ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=cache is not None,
        output_hidden_states=hidden_states,
    )
    if cache is not None:
        kw[cache_kwarg(type(target.model))] = cache
    if last_logits_only and "logits_to_keep" in _forward_params(type(target.model)):
        kw["logits_to_keep"] = 1
    return target.model(**kw)


def crop_cache(cache, new_len: int) -> None:
    """Keep the first new_len positions. Passes a negative drop count: older releases take that as
    well as a length, 5.24+ takes only that."""
    drop = cache.get_seq_length() - new_len
    if drop > 0:
        cache.crop(-drop)


def tap(hidden_states: tuple[Tensor, ...], layer_ids: list[int]) -> Tensor:
    """Concatenate the outputs of decoder layers `layer_ids`: hidden_states[L + 1]. -> [S, T, n*H]
    (on the device of the last layer, when the target is sharded)."""
    dev = hidden_states[-1].device
    return torch.cat([hidden_states[L + 1].to(dev) for L in layer_ids], dim=-1)


class _Stop(Exception):
    """Raised by the deepest tapped layer's hook: nothing after it is needed."""


def _chunked_prefill_ok(config: Any) -> bool:
    """Hybrid decoders (Gated DeltaNet layers) carry their conv and recurrent state across chunks
    only in transformers releases tested here (>= 5.24); older ones run such targets unchunked."""
    if "linear_attention" not in (getattr(config, "layer_types", None) or ()):
        return True
    import transformers

    return tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24)


@torch.no_grad()
def tapped_forward(
    target: Target,
    ids: Tensor,
    layer_ids: list[int],
    attention_mask: Tensor | None = None,
    chunk_tokens: int | None = None,
) -> Tensor:
    """ids [S, T] -> taps [S, T, n*H] (on the head device; right padding is harmless: attention is
    causal). Runs the decoder only up to the deepest tapped layer and keeps only the tapped layers'
    outputs; with `chunk_tokens`, positions go through the decoder that many at a time with a KV cache
    (equal to one pass up to rounding), bounding activation memory on long sequences."""
    decoder = target.model.get_decoder()
    layers, n = decoder.layers, target.num_layers
    if not layer_ids or not all(0 <= L < n for L in layer_ids):
        raise TargetError(f"taps {list(layer_ids)} must be decoder layers 0..{n - 1} of the target")
    wanted = sorted(set(layer_ids))
    deepest = wanted[-1]
    got: dict[int, Tensor] = {}

    def hook(L: int):
        def capture(_mod, _inp, out):
            got[L] = out[0] if isinstance(out, tuple) else out
            if L == deepest:
                raise _Stop

        return capture

    S, T = ids.shape
    step = T if not chunk_tokens or not _chunked_prefill_ok(target.config) else int(chunk_tokens)
    cache = new_cache(target) if step < T else None
    dev = target.head_device
    parts: list[Tensor] = []
    handles = [layers[L].register_forward_hook(hook(L)) for L in wanted]
    try:
        for s in range(0, T, step):
            e = min(T, s + step)
            kw: dict[str, Any] = dict(input_ids=ids[:, s:e], use_cache=cache is not None)
            if attention_mask is not None:
                kw["attention_mask"] = attention_mask[:, :e]
            if cache is not None:
                kw[cache_kwarg(type(decoder))] = cache
                kw["position_ids"] = torch.arange(s, e, device=ids.device).expand(S, -1)
            got.clear()
            try:
                decoder(**kw)
            except _Stop:
                pass
            if deepest == n - 1:  # hidden_states[n] is the final layer's output after the final norm
                got[deepest] = decoder.norm(got[deepest])
            parts.append(torch.cat([got[L].to(dev) for L in layer_ids], dim=-1))  # [S, e-s, n*H]
    finally:
        for h in handles:
            h.remove()
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
