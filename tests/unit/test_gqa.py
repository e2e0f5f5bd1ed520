"""The engine's packed grouped-query attention equals transformers' sdpa (repeat_kv) under the same mask."""

import pytest
import torch

from dflash.models.engine import gqa


class _Attn(torch.nn.Module):
    num_key_value_groups = 3


@pytest.mark.parametrize("q", [1, 4])
def test_packed_gqa_equals_repeated_heads(q):
    from transformers.integrations.sdpa_attention import repeat_kv

    g = torch.Generator().manual_seed(0)
    b, k, n, d = 2, 2, 11, 8
    query = torch.randn(b, k * 3, q, d, generator=g)
    key, value = torch.randn(b, k, n, d, generator=g), torch.randn(b, k, n, d, generator=g)
    ok = torch.rand(b, 1, q, n, generator=g) > 0.4
    ok[..., 0] = True  # every row sees a key
    mask = torch.zeros(b, 1, q, n).masked_fill_(~ok, torch.finfo(torch.float32).min)
    out, _ = gqa.packed_gqa(_Attn(), query, key, value, mask, scaling=0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, 3), repeat_kv(value, 3), attn_mask=mask, scale=0.3
    )
    assert out.shape == (b, q, k * 3, d)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_engaged_sets_and_restores_the_attention(qwen3_target):
    cfg = qwen3_target.model.get_decoder().config
    assert gqa.applies(cfg), "the tiny Qwen3 has grouped heads and sdpa"
    with gqa.engaged(cfg):
        assert cfg._attn_implementation == gqa.ATTN
    assert cfg._attn_implementation == "sdpa"
