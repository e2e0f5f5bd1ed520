"""Grouped-query attention under an explicit mask without copying the keys: the engine's attention.

transformers' `sdpa` attention runs SDPA's native GQA only without a mask on CUDA; with the 4D mask
the static-cache engine passes (dflash/models/engine/decode.py), releases up to 5.17 repeat every key and
value head once per query head of its group (`repeat_kv`) on every forward: at batch 1024 and a
768-position cache that copy is most of a decode step. Packing the query instead is exact: the G
query heads that share key head k become G x q query rows of one head k, the mask repeated G times
along its query axis (a [b, 1, G*q, n] copy, small beside the keys):

    query [b, k*G, q, d] -> [b, k, G*q, d];  mask [b, 1, q, n] -> [b, 1, G*q, n]
    out = sdpa(query, keys [b, k, n, d], values, mask) -> [b, k, G*q, d] -> [b, q, k*G, d]

`ATTN` is the name the engine sets for its forwards (`engaged(config)`); any call it does not cover
(no mask, no groups) goes to transformers' own `sdpa`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import Tensor

ATTN = "dflash_packed_gqa"


def packed_gqa(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: query [b, h, q, d], key/value [b, k, n, d] -> ([b, q, h, d],
    None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or dropout:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    b, h, q, d = query.shape
    k = key.shape[1]
    packed = query.reshape(b, k, groups * q, d)  # head k*G+g, row t -> head k, row g*q+t
    mb = attention_mask.shape[0]
    mask = attention_mask[:, :, None].expand(mb, 1, groups, q, attention_mask.shape[-1]).reshape(mb, 1, groups * q, -1)
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=mask, scale=scaling
    )  # [b, k, G*q, dv]
    return out.reshape(b, h, q, value.shape[-1]).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTN, packed_gqa)
    AttentionMaskInterface.register(ATTN, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # only read if a 2D mask ever comes


def applies(config) -> bool:
    """Whether the engine's forwards of a target of this (text) config use `packed_gqa`: sdpa with grouped heads."""
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    return getattr(config, "_attn_implementation", None) == "sdpa" and bool(heads and kv and heads > kv)


@contextmanager
def engaged(config) -> Iterator[None]:
    """Within: the config's attention layers call `packed_gqa` (when `applies`); restored after, so the rest
    of the run (features, replay) keeps the attention the target was loaded with."""
    if not applies(config):
        yield
        return
    _register()
    config._attn_implementation = ATTN
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
