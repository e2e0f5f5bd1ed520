"""Position-keyed sampling: the target's token at temperature T, reproducible whatever the batch.

z-lab's convention at temperature > 0: the reference is sampled from the target at T (with top-p /
top-k), and a greedy draft token is accepted where it equals the sampled token. For references
to be reproducible whatever the batch size, padding or order, the token at absolute position p
of a row is a pure function of (the target's logits at p, seed, prompt digest, p): Gumbel-max
with noise from a counter hash keyed by (seed, prompt digest, p, vocabulary index), never a
shared torch generator whose draws depend on batch order.

`Sampling` holds the four options (temperature 0 = greedy: argmax, today's behaviour); `row_keys`
turns prompts + seed into one int64 key per row; `pick(logits, s, keys, pos)` is the token. It is
plain tensor arithmetic (no host sync), so the CUDA static-cache engine captures it in its graph,
and the dynamic-cache CPU path, the online loop and the tests call the same function.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from torch import Tensor

M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p (1: all)
    top_k: int = 0  # keep the k most likely tokens (0: all)
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def key(self) -> dict[str, float | int] | None:
        """What decides the samples, for cache keys and run tags; None when greedy (keys unchanged)."""
        return (
            None
            if self.greedy
            else {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}
        )

    def convention(self) -> str:
        return (
            "greedy"
            if self.greedy
            else (
                f"z-lab sampled (T={self.temperature:g}, top_p={self.top_p:g}, top_k={self.top_k}, seed={self.seed}; "
                "greedy drafts accepted where they equal the sampled token)"
            )
        )


def prompt_key(prompt: list[int], seed: int) -> int:
    """A 31-bit key of (seed, prompt): the row's noise stream, independent of batch and padding."""
    return int.from_bytes(hashlib.sha256(json.dumps([seed, list(prompt)]).encode()).digest()[:4], "big") & 0x7FFFFFFF


def row_keys(prompts: list[list[int]], seed: int, device: torch.device | str = "cpu") -> Tensor:
    return torch.tensor([prompt_key(p, seed) for p in prompts], dtype=torch.long, device=device)  # [B]


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (products stay below 2^63 in int64)."""
    x = x & M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & M32
    return x ^ (x >> 16)


def gumbel(keys: Tensor, pos: Tensor, vocab: int) -> Tensor:
    """Gumbel(0, 1) noise [B, V] keyed by (row key [B], absolute position [B], vocabulary index)."""
    h = _mix32(keys ^ _mix32(pos * 0x9E3779B1 + 0x7F4A7C15))  # [B]
    v = torch.arange(vocab, device=keys.device, dtype=torch.long)  # [V]
    x = _mix32(_mix32((h[:, None] + v[None] * 0x27D4EB2F) & M32) ^ h[:, None])  # [B, V]
    u = (x.double() + 0.5) / 4294967296.0  # (0, 1)
    return -torch.log(-torch.log(u))


def _filter(z: Tensor, top_p: float, top_k: int) -> Tensor:
    """Scaled logits [B, V] with the tokens outside top-k / top-p set to -inf (ties kept)."""
    if top_k > 0 and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[:, -1:]  # [B, 1]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        srt = z.sort(dim=-1, descending=True).values  # [B, V]
        p = srt.softmax(-1)
        keep = (p.cumsum(-1) - p) < top_p  # [B, V] the first always kept
        last = srt.gather(1, (keep.sum(-1, keepdim=True) - 1).clamp(min=0))  # [B, 1] smallest kept logit
        z = z.masked_fill(z < last, float("-inf"))
    return z


def pick(logits: Tensor, s: Sampling, keys: Tensor | None = None, pos: Tensor | None = None) -> Tensor:
    """logits [B, V] at absolute positions pos [B] of rows keyed by keys [B] -> tokens [B]."""
    if s.greedy:
        return logits.argmax(-1)
    assert keys is not None and pos is not None, "sampling needs each row's key and position"
    z = _filter(logits.float() / s.temperature, s.top_p, s.top_k)
    return (z.double() + gumbel(keys, pos, logits.shape[-1])).argmax(-1)
