"""The DFlash drafter: config and model (../shared/DFLASH.md §1).

A drafter predicts the B-1 masked slots of a block `[anchor, mask, ..., mask]` in one pass.
It has no embedding and no LM head: block tokens are embedded by the target's `embed_tokens`
and its final hidden states go through the target's `lm_head` (the caller does both).

Context: the target's tapped hidden states (`target_layer_ids`, concatenated) are fused by
`fc` + `hidden_norm` into one vector per position, which every draft layer turns into extra
keys and values with its own k_proj / v_proj / k_norm. Queries come only from block tokens.

One layout serves inference, the offline replay and training: for S sequences with N blocks
each, queries are the N*B block slots flattened, keys are `[T context positions] + [N*B block
slots]`. Block n (anchor at position p_n) sees context positions t < p_n and the slots of its
own block, bidirectionally; nothing else. `visibility_mask` builds that as a dense boolean
mask (sdpa, eager) and `flex_block_mask` as a flex_attention BlockMask (CUDA). One block at
inference is the case N = 1 with T = committed positions.

Parameter names follow the public HF format, so a public checkpoint loads as it is.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ATTENTION_BACKENDS = ("sdpa", "eager", "flex")


def build_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Public default: taps spread evenly over layers 1 .. L-3 (the last layer never tapped)."""
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(start + i * span / (num_taps - 1)) for i in range(num_taps)]


@dataclass
class DrafterConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    extra: dict[str, Any] = field(default_factory=dict)  # unknown config.json keys, kept

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def to_hf(self) -> dict[str, Any]:
        """config.json of the public HF format."""
        d = {k: v for k, v in asdict(self).items() if k not in ("extra", "target_layer_ids", "mask_token_id")}
        d = {**self.extra, **d}
        d.update(
            architectures=["DFlashDraftModel"],
            model_type="qwen3",
            dflash_config={"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            layer_types=["full_attention"] * self.num_hidden_layers,
        )
        return d

    @classmethod
    def from_hf(cls, d: dict[str, Any], overrides: dict[str, Any] | None = None) -> "DrafterConfig":
        """Parse a config.json dict; `overrides` fill only what the checkpoint lacks."""
        overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
        dflash = d.get("dflash_config") or {}
        flat = {**d, **dflash}
        if "head_dim" not in flat and "hidden_size" in flat and "num_attention_heads" in flat:
            flat["head_dim"] = flat["hidden_size"] // flat["num_attention_heads"]
        fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        kwargs = {n: flat[n] if flat.get(n) is not None else overrides[n] for n in fields if flat.get(n) is not None or n in overrides}
        required = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING]
        if required:
            raise ValueError(
                f"drafter config lacks {sorted(required)}; the checkpoint should store them, or set them "
                f"as overrides (e.g. drafter.mask_token_id=..., drafter.target_layer_ids=[...])"
            )
        for n, v in kwargs.items():  # config.json is user input: a wrong type is named here, not a TypeError deep in the model
            if flat.get(n) is None:
                continue  # an override (typed by the config schema)
            want = fields[n].type
            ok = (isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v) if n == "target_layer_ids"
                  else isinstance(v, (int, float)) and not isinstance(v, bool) if want == "float"
                  else isinstance(v, int) and not isinstance(v, bool))
            if not ok:
                raise ValueError(f"config.json field {n!r} is {v!r} ({type(v).__name__}); it must be {'a list of integers' if n == 'target_layer_ids' else want}")
        kwargs["target_layer_ids"] = [int(x) for x in kwargs["target_layer_ids"]]
        skip = {"dflash_config", "architectures", "model_type", "layer_types", *fields}
        return cls(**kwargs, extra={k: v for k, v in d.items() if k not in skip})


# --- building blocks -------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(pos: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """pos [..., L] -> cos, sin [..., L, D] (HF's rotate_half convention)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim))
    ang = pos.float()[..., None] * inv  # [..., L, D/2]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [S, Hx, L, D]; cos/sin [S, L, D]."""
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def visibility_mask(anchor_pos: Tensor, ctx_len: int, block_size: int, see_anchor: bool = False) -> Tensor:
    """anchor_pos [S, N] -> bool [S, N*B, T + N*B]: True where a query slot may attend.

    Context position t is visible to block n iff t < p_n (t <= p_n with `see_anchor`, the
    training-time leak of DFLASH.md §4 bug 2); block slots see their own block only.
    """
    S, N = anchor_pos.shape
    B = block_size
    t = torch.arange(ctx_len, device=anchor_pos.device)
    p = anchor_pos.repeat_interleave(B, dim=1)  # [S, N*B]
    ctx = (t[None, None, :] <= p[..., None]) if see_anchor else (t[None, None, :] < p[..., None])
    blk = torch.arange(N * B, device=anchor_pos.device) // B
    own = blk[:, None] == blk[None, :]  # [N*B, N*B]
    return torch.cat([ctx, own[None].expand(S, -1, -1)], dim=-1)


def flex_block_mask(anchor_pos: Tensor, ctx_len: int, block_size: int, see_anchor: bool = False):
    """The same visibility as `visibility_mask`, as a flex_attention BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    S, N = anchor_pos.shape
    B, T = block_size, ctx_len

    def mask_mod(b, h, q, kv):
        p = anchor_pos[b, q // B]
        in_ctx = kv < T
        ctx_ok = (kv <= p) if see_anchor else (kv < p)
        own = (kv - T) // B == q // B
        return (in_ctx & ctx_ok) | (~in_ctx & own)

    return create_block_mask(mask_mod, S, None, N * B, T + N * B, device=anchor_pos.device)


def attend(q: Tensor, k: Tensor, v: Tensor, mask, backend: str) -> Tensor:
    """q [S, H, Q, D], k/v [S, Hkv, K, D]; mask bool [S, Q, K] (or BlockMask for flex) -> [S, H, Q, D]."""
    if backend == "flex":
        return _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    m = mask[:, None] if mask is not None else None
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    if backend == "eager":
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [S, H, Q, K]
        if m is not None:
            scores = scores.masked_fill(~m, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
    raise ValueError(f"attention backend {backend!r} is not one of {ATTENTION_BACKENDS}")


@lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.nh * D, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * D, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * D, bias=False)
        self.o_proj = nn.Linear(self.nh * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def _kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        S, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(S, L, self.nkv, self.hd)).transpose(1, 2)  # [S, Hkv, L, D]
        v = self.v_proj(x).view(S, L, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, ctx: Tensor, rope_blk, rope_ctx, mask, backend: str) -> Tensor:
        """x [S, Q, H] block slots; ctx [S, T, H] fused context -> [S, Q, H]."""
        S, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(S, Q, self.nh, self.hd)).transpose(1, 2)  # [S, H, Q, D]
        q = apply_rope(q, *rope_blk)
        k_ctx, v_ctx = self._kv(ctx, *rope_ctx)
        k_blk, v_blk = self._kv(x, *rope_blk)
        k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
        o = attend(q, k, v, mask, backend)  # [S, H, Q, D]
        return self.o_proj(o.transpose(1, 2).reshape(S, Q, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, rope_blk, rope_ctx, mask, backend: str) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_blk, rope_ctx, mask, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_taps * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)

    def init_weights(self, seed: int, std: float = 0.02) -> "DFlashDrafter":
        """Deterministic random weights (smoke runs, training start)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        return self

    def forward(
        self,
        taps: Tensor,  # [S, T, n*H] concatenated target taps of the context
        block_emb: Tensor,  # [S, N, B, H] embedded [anchor, mask, ...] blocks
        anchor_pos: Tensor,  # [S, N] absolute position of each anchor
        backend: str = "sdpa",
        see_anchor: bool = False,
    ) -> Tensor:  # [S, N, B, H] final-normed hidden states (feed to the target's lm_head)
        S, N, B, H = block_emb.shape
        T = taps.shape[1]
        ctx = self.hidden_norm(self.fc(taps))  # [S, T, H]
        x = block_emb.reshape(S, N * B, H)
        pos_blk = (anchor_pos[..., None] + torch.arange(B, device=anchor_pos.device)).reshape(S, N * B)
        pos_ctx = torch.arange(T, device=taps.device).expand(S, T)
        rope_blk = rope_cos_sin(pos_blk, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        rope_ctx = rope_cos_sin(pos_ctx, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        if backend == "flex":
            mask = flex_block_mask(anchor_pos, T, B, see_anchor)
        else:
            mask = visibility_mask(anchor_pos, T, B, see_anchor)
        for layer in self.layers:
            x = layer(x, ctx, rope_blk, rope_ctx, mask, backend)
        return self.norm(x).view(S, N, B, H)
