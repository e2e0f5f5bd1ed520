"""The DFlash drafter model (docs/family.md §1); its config is dflash/models/drafter/config.py.

A drafter predicts the B-1 masked slots of a block `[anchor, mask, ..., mask]` in one pass.
Block tokens are embedded by the target's `embed_tokens` and its final hidden states go through
the target's `lm_head` (`embed`, `logits`: the caller passes the target's), unless the checkpoint
carries its own (vLLM's rule; a reduced draft vocabulary maps its ids to the target's: docs/formats.md).

Context: the target's tapped hidden states (`target_layer_ids`, concatenated) are fused by
`fc` + `hidden_norm` into one vector per position, which every draft layer turns into extra
keys and values with its own k_proj / v_proj / k_norm. Queries come only from block tokens.
Layers are Qwen3 layers as transformers builds them from the config: q/k/v/o biases with
`attention_bias`; rotary frequencies and attention scaling from transformers' own rope
initialisation (`Rotary`: every rope type, yarn's attention factor).

One layout serves inference, the offline replay and training: for S sequences with N blocks
each, queries are the N*B block slots flattened, keys are `[T context positions] + [N*B block
slots]`. Block n (anchor at position p_n) sees context positions t < p_n and the slots of its
own block, bidirectionally (causally with vLLM's `dflash_config.causal`); nothing else. A
`sliding_attention` layer (config `layer_types` + `sliding_window` w) applies SGLang's rule on top: causal
(unless the config says `is_causal: false`, as public DFlash2 configs do), and only keys at positions
> q - w (the window includes the query itself); `sliding_window="ignore"` treats those layers as full
attention, as z-lab's transformers loop under sdpa/eager did. `mask_mod` states the rule once:
`visibility_mask` evaluates it densely (sdpa, eager), `flex_block_mask` as a flex_attention
BlockMask (CUDA). One block at inference is the case N = 1 with T = committed positions.

DFlash2 (`cfg.arch == "dflash2"`, dflash/models/drafter/dflash2.py): each layer wraps its attention and its
MLP in a `BlockConv` (within each block of B slots of the flattened layout), and the drafter holds a
`candidate_selector`; the proposal rule (`dflash2.propose`) is the caller's, as the LM head is.
DSpark (`cfg.arch == "dspark"`, dflash/models/drafter/dspark.py): the same forward over its block (B = its rows,
block convolutions where its config has them), plus `markov_head` and `confidence_head` for the rollout.

Parameter names follow the public HF format, so a public checkpoint loads as it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.models.drafter.config import DrafterConfig, build_target_layer_ids
from dflash.models.drafter.dflash2 import BlockConv, CandidateSelector
from dflash.models.drafter.dspark import ConfidenceHead, build_heads
from dflash.models.drafter.rope import rotary_parameters
from dflash.util.errors import CheckpointError

__all__ = [
    "DFlashDrafter",
    "DrafterConfig",
    "SLIDING_WINDOW",
    "build_target_layer_ids",
    "visibility_mask",
    "flex_block_mask",
    "mask_mod",
]

ATTENTION_BACKENDS = ("sdpa", "eager", "flex")
SLIDING_WINDOW = ("apply", "ignore")


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


class Rotary:
    """cos/sin of absolute positions from transformers' own rope initialisation for this config
    (`rope.rotary_parameters`: inv_freq and attention scaling of every rope type), times
    positions elementwise in float32 as transformers 5.24's Qwen3RotaryEmbedding does. Not a
    module: moving the drafter to bfloat16 must not round inv_freq."""

    def __init__(self, cfg: DrafterConfig):
        self.inv_freq, self.scaling, self.limit = rotary_parameters(cfg)
        self.rope_type = cfg.rope_parameters["rope_type"]

    def _past_limit(self, pos: Tensor) -> bool:
        if pos.is_cuda and torch.cuda.is_current_stream_capturing():  # a CUDA graph (the online loop) cannot sync
            return False
        return bool(pos.numel()) and int(pos.max()) + 1 > self.limit

    def __call__(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """pos [..., L] -> cos, sin [..., L, D] (HF's rotate_half convention)."""
        if self.limit is not None and self._past_limit(pos):
            raise CheckpointError(
                f"position {int(pos.max())} is past this drafter's {self.rope_type} rope limit of {self.limit} "
                f"positions: there "
                "transformers recomputes the frequencies from the loop's history and SGLang differs; not implemented. "
                "Use shorter prompts or fewer prompts.max_new_tokens"
            )
        if self.inv_freq.device != pos.device:
            self.inv_freq = self.inv_freq.to(pos.device)
        ang = pos[..., None].float() * self.inv_freq  # [..., L, D/2]
        ang = torch.cat([ang, ang], dim=-1)
        return (ang.cos() * self.scaling).to(dtype), (ang.sin() * self.scaling).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [S, Hx, L, D]; cos/sin [S, L, D]."""
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def mask_mod(
    anchor_pos: Tensor,
    ctx_len: int,
    block_size: int,
    see_anchor: bool = False,
    window: int | None = None,
    causal: bool | None = None,
):
    """The visibility rule as a flex_attention mask_mod (b, h, q, kv) -> bool; the dense mask
    calls the same function on broadcast index tensors, so the two cannot disagree.

    Query q is slot i = q % B of block n = q // B (anchor p_n, position p_n + i). Context key t
    (position t) is visible iff t < p_n (t <= p_n with `see_anchor`); block key kv is visible iff it
    is a slot j of the query's own block. `causal` (default: with a window) also requires j <= i
    (vLLM's `causal` layers). With a sliding `window` w (SGLang's sliding_attention layers, window_left
    = w - 1) a key at position k must also satisfy q_pos - k < w: context t > p_n + i - w, and slots
    with i - j < w. A non-causal sliding layer (`causal=False`: public DFlash2 configs, `is_causal:
    false`) sees its block both ways (the window bounds it on the left only: i - j < w, no j <= i) and
    the context windowed from the query's own position, as SGLang and SpecForge read it (the config
    parser refuses w < B, the one case where SGLang's attention backends differ).
    """
    B, T = block_size, ctx_len
    causal = window is not None if causal is None else causal

    def mod(b, h, q, kv):
        n, i = q // B, q % B
        p = anchor_pos[b, n]
        j = kv - T - n * B  # the key's slot in the query's own block when 0 <= j < B
        ctx = (kv < T) & ((kv <= p) if see_anchor else (kv < p))
        own = (j >= 0) & (j < B)
        if causal:
            own = own & (j <= i)
        if window is not None:
            ctx = ctx & (p + i - kv < window)
            own = own & (i - j < window)
        return ctx | own

    return mod


def visibility_mask(
    anchor_pos: Tensor,
    ctx_len: int,
    block_size: int,
    see_anchor: bool = False,
    window: int | None = None,
    causal: bool | None = None,
) -> Tensor:
    """anchor_pos [S, N] -> bool [S, N*B, T + N*B]: True where a query slot may attend (`mask_mod`)."""
    S, N = anchor_pos.shape
    Q, dev = N * block_size, anchor_pos.device
    b = torch.arange(S, device=dev)[:, None, None]
    q = torch.arange(Q, device=dev)[None, :, None]
    kv = torch.arange(ctx_len + Q, device=dev)[None, None, :]
    return mask_mod(anchor_pos, ctx_len, block_size, see_anchor, window, causal)(b, None, q, kv).expand(
        S, Q, ctx_len + Q
    )


def flex_block_mask(
    anchor_pos: Tensor,
    ctx_len: int,
    block_size: int,
    see_anchor: bool = False,
    window: int | None = None,
    causal: bool | None = None,
):
    """The same visibility as `visibility_mask`, as a flex_attention BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    S, N = anchor_pos.shape
    Q = N * block_size
    mod = mask_mod(anchor_pos, ctx_len, block_size, see_anchor, window, causal)
    return create_block_mask(mod, S, None, Q, ctx_len + Q, device=anchor_pos.device)


def attend(q: Tensor, k: Tensor, v: Tensor, mask, backend: str) -> Tensor:
    """q [S, H, Q, D], k/v [S, Hkv, K, D]; mask bool [S, Q, K] (or BlockMask for flex) -> [S, H, Q, D]."""
    # flex_attention is not autocast-aware: under autocast its three inputs take autocast's dtype (RMSNorm's q/k
    # stay fp32)
    if backend == "flex":
        if torch.is_autocast_enabled(q.device.type):
            dt = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
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
        H, D, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.nh * D, bias=bias)
        self.k_proj = nn.Linear(H, self.nkv * D, bias=bias)
        self.v_proj = nn.Linear(H, self.nkv * D, bias=bias)
        self.o_proj = nn.Linear(self.nh * D, H, bias=bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def _kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        S, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(S, L, self.nkv, self.hd)).transpose(1, 2)  # [S, Hkv, L, D]
        v = self.v_proj(x).view(S, L, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, kv_ctx: tuple[Tensor, Tensor], rope_blk, mask, backend: str) -> Tensor:
        """x [S, Q, H] block slots; kv_ctx: this layer's context keys and values [S, Hkv, T, D] -> [S, Q, H]."""
        S, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(S, Q, self.nh, self.hd)).transpose(1, 2)  # [S, H, Q, D]
        q = apply_rope(q, *rope_blk)
        k_ctx, v_ctx = kv_ctx
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
        self.B = cfg.block_size
        if cfg.conv is not None:  # DFlash2's (or a DSpark drafter's): both sublayers wrapped in a block convolution
            self.attention_conv = BlockConv(cfg.hidden_size, *cfg.conv)
            self.mlp_conv = BlockConv(cfg.hidden_size, *cfg.conv)

    def _sublayer(self, f, x: Tensor, conv: BlockConv | None) -> Tensor:
        if conv is None:
            return f(x)
        x, delta = conv.prepare(x, self.B)
        return conv.finish(f(x), delta, self.B)

    def forward(self, x: Tensor, kv_ctx: tuple[Tensor, Tensor], rope_blk, mask, backend: str) -> Tensor:
        attn = lambda h: self.self_attn(h, kv_ctx, rope_blk, mask, backend)  # noqa: E731
        x = x + self._sublayer(attn, self.input_layernorm(x), getattr(self, "attention_conv", None))
        return x + self._sublayer(self.mlp, self.post_attention_layernorm(x), getattr(self, "mlp_conv", None))


def own_heads(cfg: DrafterConfig) -> dict[str, nn.Module | Tensor | None]:
    """The modules a checkpoint's own tensors fill (vLLM's has_own_embed_tokens / has_own_lm_head / d2t):
    embed_tokens [vocab_size, H], lm_head [draft_vocab_size or vocab_size, H], d2t [draft_vocab_size]."""
    H, V = cfg.hidden_size, cfg.vocab_size
    rows = cfg.draft_vocab_size or V
    return {
        "embed_tokens": nn.Embedding(V, H) if cfg.own_embed else None,
        "lm_head": nn.Linear(H, rows, bias=False) if cfg.own_lm_head else None,
        "d2t": torch.zeros(rows, dtype=torch.long) if cfg.vocab_map else None,
    }


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, sliding_window: str = "apply"):
        super().__init__()
        if sliding_window not in SLIDING_WINDOW:
            raise ValueError(f"sliding_window={sliding_window!r}: use one of {SLIDING_WINDOW}")
        self.cfg = cfg
        self.sliding_window = sliding_window
        H = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_taps * (cfg.target_hidden_size or H), H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        if cfg.dflash2 is not None:
            d2 = cfg.dflash2
            self.candidate_selector = CandidateSelector(H, d2.vocab_size or 1, d2.selector_rank)
        self.confidence_head: ConfidenceHead | None = None
        if cfg.dspark is not None:  # DSpark: the Markov head (and the confidence head when enabled)
            vocab = cfg.dspark.vocab_size or 1
            self.markov_head, self.confidence_head = build_heads(cfg.dspark, vocab, cfg.draft_vocab_size or vocab, H)
        apply = sliding_window == "apply"
        self.windows = [cfg.sliding_window if apply and t == "sliding_attention" else None for t in cfg.layer_types]
        self.causal = [
            w is not None if cfg.causal is None else cfg.causal for w in self.windows
        ]  # "ignore": as full layers
        heads = own_heads(cfg)  # the drafter's own embedding / LM head / id map, where its checkpoint has them
        self.embed_tokens, self.lm_head = heads["embed_tokens"], heads["lm_head"]
        self.register_buffer("d2t", heads["d2t"], persistent=heads["d2t"] is not None)
        self._rotary: Rotary | None = None  # built on first use (not on the meta device a shape check uses)

    @property
    def rotary(self) -> Rotary:
        if self._rotary is None:
            self._rotary = Rotary(self.cfg)
        return self._rotary

    def init_weights(self, seed: int, std: float = 0.02, identity: bool = True) -> "DFlashDrafter":
        """Deterministic random weights (smoke runs, training start). DFlash2 with `identity` starts as SpecForge
        trains it: identity convolutions and a zero successor codebook, so its proposals are DFlash's until trained;
        without (drafter=init), random ones: each tap-0 kernel 1 + noise, the others and the projection noise, the
        codebooks N(0, 1/rank) so that the selector's term is of the order of the unary logits' gaps."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
            for m in self.modules():
                if isinstance(m, BlockConv):
                    if identity:
                        m.identity_()
                    else:
                        m.base_kernel[:, 0] += 1.0
            if self.confidence_head is not None:
                self.confidence_head.float()
            if self.cfg.dflash2 is not None:
                sel = self.candidate_selector
                if identity:
                    sel.successor_codebook.zero_()
                else:
                    for book in (sel.predecessor_codebook, sel.successor_codebook):
                        book.copy_(torch.randn(book.shape, generator=g) / book.shape[1] ** 0.5)
        return self

    def context_kv(self, taps: Tensor) -> list[tuple[Tensor, Tensor]]:
        """taps [S, T, n*H] -> per layer the context's keys and values [S, Hkv, T, D] (rope at positions
        0..T-1). They depend on the taps alone, not on any block: the offline replay computes them once
        per sequence and every anchor's block reads a prefix (`forward(ctx_kv=...)`)."""
        S, T, _ = taps.shape
        ctx = self.hidden_norm(self.fc(taps))  # [S, T, H]
        rope_ctx = self.rotary(torch.arange(T, device=taps.device).expand(S, T), ctx.dtype)
        return [layer.self_attn._kv(ctx, *rope_ctx) for layer in self.layers]

    def forward(
        self,
        taps: Tensor | None,  # [S, T, n*H] concatenated target taps of the context (None with ctx_kv)
        block_emb: Tensor,  # [S, N, B, H] embedded [anchor, mask, ...] blocks
        anchor_pos: Tensor,  # [S, N] absolute position of each anchor
        backend: str = "sdpa",
        see_anchor: bool = False,
        ctx_kv: list[tuple[Tensor, Tensor]]
        | None = None,  # context_kv(taps), or a prefix of it: [S, Hkv, T, D] per layer
    ) -> Tensor:  # [S, N, B, H] final-normed hidden states (feed to the target's lm_head)
        S, N, B, H = block_emb.shape
        kv = ctx_kv if ctx_kv is not None else self.context_kv(taps)
        T = kv[0][0].shape[2]
        x = block_emb.reshape(S, N * B, H)
        pos_blk = (anchor_pos[..., None] + torch.arange(B, device=anchor_pos.device)).reshape(S, N * B)
        rope_blk = self.rotary(pos_blk, x.dtype)
        build = flex_block_mask if backend == "flex" else visibility_mask
        kinds = list(zip(self.windows, self.causal))  # per layer (window, causal)
        masks = {k: build(anchor_pos, T, B, see_anchor, *k) for k in set(kinds)}  # one per kind: full, sliding, causal
        for layer, k, kv_l in zip(self.layers, kinds, kv):
            x = layer(x, kv_l, rope_blk, masks[k], backend)
        return self.norm(x).view(S, N, B, H)

    def embed(self, target_embed: Callable[[Tensor], Tensor], ids: Tensor) -> Tensor:
        """Block tokens [...] -> embeddings [..., H]: the drafter's own `embed_tokens` when it has one, else the
        target's."""
        if self.embed_tokens is None:
            return target_embed(ids)
        return self.embed_tokens(ids.to(self.embed_tokens.weight.device))

    def logits(self, target_head: Callable[[Tensor], Tensor], h: Tensor) -> Tensor:
        """Final-normed states [..., H] -> draft logits over the target's vocabulary [..., V] (vLLM's compute_logits):
        own `lm_head` or the target's, times `logit_scale`; a reduced draft vocabulary's logits land at their
        target ids (i + d2t[i]), every other id -inf, so an argmax is a target id."""
        z = target_head(h) if self.lm_head is None else self.lm_head(h)
        if self.cfg.logit_scale != 1.0:
            z = z * self.cfg.logit_scale
        return self.to_target(z, float("-inf"))

    def to_target(self, z: Tensor, fill: float) -> Tensor:
        """Values over the drafter's vocabulary [..., V_draft] -> over the target's [..., V]: draft id i lands at
        i + d2t[i], every other id `fill`; the identity without a reduced draft vocabulary."""
        if self.d2t is None:
            return z
        full = z.new_full((*z.shape[:-1], self.cfg.vocab_size), fill)
        full[..., self.d2t.to(z.device) + torch.arange(z.shape[-1], device=z.device)] = z
        return full

    def keep_float32_(self) -> "DFlashDrafter":
        """The confidence head back to float32 after a cast of the whole drafter (SGLang keeps it float32)."""
        if self.confidence_head is not None:
            self.confidence_head.float()
        return self
