"""DSpark's heads and its left-to-right rollout (docs/dspark.md; config: dflash/models/drafter/dspark_config.py).

A DSpark drafter is a DFlash drafter (dflash/models/drafter/model.py: one forward over the block) plus two heads on
its final-normed slot states h_j, registered on `DFlashDrafter` as `markov_head` and `confidence_head`:

- `MarkovHead`: a low-rank bias on each slot's logits from the token drafted at the slot before:
  e_j = markov_w1[prev_j] (an embedding, rank r), bias_j = markov_w2 · u_j with u_j by type:
  vanilla e_j; gated σ(gate_proj [h_j ; e_j]) ⊙ e_j; rnn tanh(o_j) where (a, c, o) = joint_proj [s_j ; e_j ; h_j]
  and the state s_{j+1} = σ(a) ⊙ s_j + (1 - σ(a)) ⊙ tanh(c), s_0 = 0 (reset every block).
- `ConfidenceHead`: logit_j = proj [h_j ; markov_w1[prev_j]] (or proj h_j), in float32 (its weights stay float32
  whatever the drafter's dtype, as SGLang keeps them); σ(logit_j) predicts that slot j is accepted.

`rollout` is the greedy walk both loops take (SGLang's `draft_markov_block`): prev_0 = the anchor, then the drafted
token; step_j = base_j + bias_j summed in float32 and rounded to the step dtype (the promotion of the base logits'
and markov_w1's dtypes); the token is the argmax, the lowest id among equal maxima (torch.argmax's rule). It returns
the drafted tokens and the confidence of each slot of that walk. Everything is batched over rows and runs on the
device of its inputs: no host synchronisation inside the walk.

The same modules are what a trainer builds: `MarkovHead.step` with a teacher-forced `prev` gives the training bias,
`ConfidenceHead.forward` the training logit (docs/dspark.md, "Training against this module").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from dflash.models.drafter.dspark_config import DSparkConfig


class MarkovHead(nn.Module):
    def __init__(self, kind: str, vocab: int, out_vocab: int, rank: int, hidden: int):
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab, rank)  # [V, r]: indexed by the target's token ids
        self.markov_w2 = nn.Linear(rank, out_vocab, bias=False)  # [V_out, r]: the drafter's vocabulary
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def init_state(self, h: Tensor) -> Tensor | None:
        """The rnn state of R rows at a block's first slot (zeros in the hidden's dtype); None for the others."""
        return h.new_zeros((h.shape[0], self.rank)) if self.kind == "rnn" else None

    def step(self, prev: Tensor, h: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """prev [R] token ids, h [R, H] the slot's final state, state [R, r] | None -> (bias [R, V_out], state)."""
        e = self.markov_w1(prev)  # [R, r]
        if self.kind == "vanilla":
            return self.markov_w2(e), state
        h = h.to(e.dtype)
        if self.kind == "gated":
            g = torch.sigmoid(self.gate_proj(torch.cat([h, e], -1))).to(e.dtype)  # hidden first, as SGLang
            return self.markov_w2(g * e), state
        a, c, o = self.joint_proj(torch.cat([state, e, h], -1)).chunk(3, -1)  # state, prev embedding, hidden
        gate = torch.sigmoid(a)
        return self.markov_w2(torch.tanh(o)), gate * state + (1.0 - gate) * torch.tanh(c)


class ConfidenceHead(nn.Module):
    def __init__(self, hidden: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden + (rank if with_markov else 0), 1)

    def forward(self, h: Tensor, e: Tensor | None) -> Tensor:
        """h [..., H], e [..., r] (markov_w1[prev]; None without markov) -> the acceptance logit [...] in float32."""
        x = torch.cat([h, e.to(h.dtype)], -1) if self.with_markov else h
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1).float()


def build_heads(ds: DSparkConfig, vocab: int, out_vocab: int, hidden: int) -> tuple[MarkovHead, ConfidenceHead | None]:
    """The two heads a DSparkConfig describes (`vocab`: markov_w1's rows, `out_vocab`: markov_w2's)."""
    markov = MarkovHead(ds.markov_head_type, vocab, out_vocab, ds.markov_rank, hidden)
    conf = ConfidenceHead(hidden, ds.markov_rank, ds.confidence_with_markov) if ds.confidence else None
    return markov, conf


def rollout(
    markov: MarkovHead,
    confidence: ConfidenceHead | None,
    base: Tensor,
    h: Tensor,
    anchor: Tensor,
    to_target: Callable[[Tensor, float], Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """base [R, K, V] the base logits (target ids), h [R, K, H] the slots' final states, anchor [R] -> (the drafted
    tokens [R, K], the confidence σ(logit) of each slot of this walk [R, K] float32, or None without the head).
    `to_target` maps a bias over the drafter's own vocabulary onto target ids (a reduced draft vocabulary)."""
    R, K, _ = base.shape
    dtype = torch.promote_types(base.dtype, markov.markov_w1.weight.dtype)
    prev, state = anchor.to(base.device).long(), markov.init_state(h[:, 0] if K else h.new_zeros((R, h.shape[-1])))
    tokens, conf = [], []
    for j in range(K):
        if confidence is not None:
            conf.append(torch.sigmoid(confidence(h[:, j], markov.markov_w1(prev) if confidence.with_markov else None)))
        bias, state = markov.step(prev, h[:, j], state)
        if to_target is not None:
            bias = to_target(bias, 0.0)
        step = (base[:, j].float() + bias.float()).to(dtype)  # SGLang: summed in float32, rounded to the step dtype
        prev = step.argmax(-1)  # the lowest id among equal maxima
        tokens.append(prev)
    empty = base.new_zeros((R, 0), dtype=torch.long)
    out = torch.stack(tokens, 1) if tokens else empty
    if confidence is None:
        return out, None
    return out, torch.stack(conf, 1) if conf else empty.float()
