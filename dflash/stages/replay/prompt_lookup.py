"""Prompt lookup: the n-gram drafter vLLM serves as `method: ngram`, replayed on the same references as a yardstick.

It needs no model: at each verify step it looks for the context's last n tokens earlier in the context
(prompt + tokens committed so far) and proposes the tokens that followed them. A drafter that does not
beat it on the same references is not worth serving. Its rule, as vLLM's v1 `NgramProposer` has it:

- n: the longest in [`prompt_lookup_min`, `prompt_lookup_max`] whose last-n tokens occur earlier (an
  occurrence may overlap the suffix, never be the suffix itself); none: no proposal;
- of that n-gram the earliest occurrence; propose the up to k tokens after it (fewer where the
  context ends); k is vLLM's `num_speculative_tokens`, here B - 1, the slots the drafter drafts.

`propose` is that rule read straight off; `lookup_replay` walks the draft-verify loop with it under the
replay's verify rule (`replay.verify`: the same τ convention and capping), an index of the n-grams seen so
far giving each step's proposal in O(max - min + 1) lookups. `yardstick` pools the prompts: τ ± SE and the
drafter's paired gain over it (`metrics.paired_ratio_diff`, prompts as the unit); dflash.tracking names
and logs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dflash.stages.metrics import Counters, Rate, acceptance_length, count_step, paired_ratio_diff, ratio_se
from dflash.stages.replay.loop import verify


@dataclass(frozen=True)
class PromptLookup:
    """The yardstick over a run's prompts; None where undefined (no verify step; an SE over one prompt)."""

    min_n: int  # vLLM's prompt_lookup_min
    max_n: int  # vLLM's prompt_lookup_max
    k: int  # vLLM's num_speculative_tokens: the drafter's B - 1
    tau: Rate  # committed tokens per verify step, as the drafter's τ
    tau_se: Rate
    gain: Rate  # the drafter's τ minus this one, over the same prompts
    gain_se: Rate  # its paired SE


def propose(context: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The tokens prompt lookup proposes after `context` (the rule in the module docstring, read straight off)."""
    L = len(context)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = list(context[L - n :])
        start = next((s for s in range(L - n) if list(context[s : s + n]) == suffix), None)
        if start is not None:
            return list(context[start + n : start + n + k])
    return []


class _Index:
    """The earliest start of every n-gram (n in [min_n, max_n]) of a growing context, added as it grows."""

    def __init__(self, seq: Sequence[int], min_n: int, max_n: int):
        self.seq, self.ns = seq, range(min_n, max_n + 1)
        self.first: dict[tuple[int, ...], int] = {}  # n-gram -> its earliest start
        self.done = {n: 0 for n in self.ns}  # per n: the starts below this are indexed

    def propose(self, L: int, k: int) -> list[int]:
        """Prompt lookup on seq[:L] (L never shrinks between calls): an earlier occurrence of the last n
        tokens starts at s with s + n < L, so it is never the suffix itself."""
        for n in self.ns:
            for s in range(self.done[n], L - n):
                self.first.setdefault(tuple(self.seq[s : s + n]), s)
            self.done[n] = max(self.done[n], L - n)
        for n in reversed(self.ns):
            start = self.first.get(tuple(self.seq[L - n : L])) if n < L else None
            if start is not None:
                return list(self.seq[start + n : min(start + n + k, L)])
        return []


def lookup_replay(prompt: Sequence[int], reference: Sequence[int], block_size: int, min_n: int, max_n: int) -> Counters:
    """The draft-verify loop over one prompt's reference with prompt lookup drafting B - 1 tokens a step."""
    seq = list(prompt) + list(reference)
    c = Counters(block_size=block_size, prompts=1, new_tokens=1)  # the first new token comes from the prefill
    index, pos = _Index(seq, min_n, max_n), len(prompt)
    while pos < len(seq) - 1:
        a, commit = verify(seq, pos, index.propose(pos + 1, block_size - 1), block_size)
        count_step(c, a, commit)
        pos += commit
    return c


def yardstick(drafter: list[Counters], lookup: list[Counters], min_n: int, max_n: int) -> PromptLookup:
    """Per prompt the drafter's and prompt lookup's counters (same prompts, same order) -> the pooled yardstick."""
    total = sum(lookup[1:], lookup[0])
    gain, gain_se = paired_ratio_diff(
        [c.committed for c in lookup],
        [c.steps for c in lookup],
        [c.committed for c in drafter],
        [c.steps for c in drafter],
    )  # drafter - lookup
    return PromptLookup(
        min_n,
        max_n,
        total.block_size - 1,
        acceptance_length(total),
        ratio_se([c.committed for c in lookup], [c.steps for c in lookup]),
        gain,
        gain_se,
    )
