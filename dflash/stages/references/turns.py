"""Multi-turn prompts: a user turn asked after the target's own answer to the turn before.

A prompt whose user messages follow one another without an assistant answer between them (MT-Bench's
two turns; any such JSONL line) is expanded into one prompt per unanswered user turn (`expand`):
turn k holds the conversation up to its user message, the target's answers to turns 1..k-1 as
assistant messages with content None, id `<id>/turn_<k>` and subset `<subset>/turn_<k>`. A prompt
with one unanswered turn passes unchanged.

References come in rounds (`references_in_rounds`): round k renders every turn-k prompt with the
decoded references of its earlier turns filled in, then gets its references (the reference cache
keys on the rendered ids, so every round is cached and an interrupted run resumes). The answer is
decoded as z-lab's transformers loop does: `tokenizer.decode(reference, skip_special_tokens=True)`,
nothing else stripped (a chat template that drops earlier thinking, like Qwen3's, does so itself).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from dflash.stages.prompts.sets import Prompt
from dflash.stages.references.collect import ReferenceStats


def unanswered(p: Prompt) -> int:
    """User turns whose answer the target gives: each user message followed by another, and the last."""
    roles = [r for r, _ in p.messages]
    return sum(1 for i, r in enumerate(roles) if r == "user" and (i + 1 == len(roles) or roles[i + 1] == "user"))


def expand(prompts: list[Prompt]) -> list[Prompt]:
    """One prompt per unanswered user turn, turns of a prompt in order (see the module docstring)."""
    out = []
    for p in prompts:
        if unanswered(p) <= 1:
            out.append(p)
            continue
        msgs: list[tuple[str, str | None]] = []
        k = 0
        for i, (role, content) in enumerate(p.messages):
            msgs.append((role, content))
            last = i + 1 == len(p.messages)
            if role == "user" and (last or p.messages[i + 1][0] == "user"):
                k += 1
                out.append(Prompt(f"{p.id}/turn_{k}", f"{p.subset}/turn_{k}", tuple(msgs)))
                msgs.append(("assistant", None))
    return out


def turn_of(p: Prompt) -> int:
    """1 + the answers the prompt waits for."""
    return 1 + sum(1 for _, c in p.messages if c is None)


def fill(p: Prompt, answers: list[str]) -> Prompt:
    """The prompt with its None answers replaced, in order."""
    it = iter(answers)
    return replace(p, messages=tuple((r, next(it) if c is None else c) for r, c in p.messages))


def merge_stats(a: ReferenceStats, b: ReferenceStats) -> ReferenceStats:
    """Reference counters of two rounds together (the first round's source and server stand)."""
    return replace(
        a,
        hits=a.hits + b.hits,
        generated=a.generated + b.generated,
        new_tokens=a.new_tokens + b.new_tokens,
        retokenized=a.retokenized + b.retokenized,
        served={**a.served, **b.served},
        keys={**a.keys, **b.keys},
        warnings=a.warnings + [w for w in b.warnings if w not in a.warnings],
    )


def references_in_rounds(
    prompts: list[Prompt],
    tokenizer: Any,
    render: Callable[[Prompt], list[int]],
    references: Callable[[list[Prompt], list[list[int]]], tuple[list[list[int]], ReferenceStats]],
    first: tuple[list[list[int]], list[list[int]], ReferenceStats] | None = None,
) -> tuple[list[Prompt], list[list[int]], list[list[int]], ReferenceStats]:
    """Every (expanded) prompt's rendered ids and reference, round by round.

    render(prompt) -> ids (checked against the context); references(prompts, ids) -> (refs, stats);
    first: round 1's (ids, refs, stats) when the caller has them. -> (prompts filled, ids, refs, stats), in `prompts`
    order."""
    rounds = sorted({turn_of(p) for p in prompts})
    done: dict[str, tuple[Prompt, list[int], list[int]]] = {}
    stats: ReferenceStats | None = None
    for k in rounds:
        todo = [p for p in prompts if turn_of(p) == k]
        filled = [fill(p, [_answer(done, p, j, tokenizer) for j in range(1, k)]) for p in todo]
        if k == rounds[0] and first is not None:
            ids, refs, st = first
        else:
            ids = [render(p) for p in filled]
            refs, st = references(filled, ids)
        stats = st if stats is None else merge_stats(stats, st)
        done.update({p.id: (f, x, r) for p, f, x, r in zip(todo, filled, ids, refs)})
    assert stats is not None
    out = [done[p.id] for p in prompts]
    return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out], stats


def _answer(done: dict[str, tuple[Prompt, list[int], list[int]]], p: Prompt, j: int, tokenizer: Any) -> str:
    base = p.id.rsplit("/turn_", 1)[0]
    return tokenizer.decode(done[f"{base}/turn_{j}"][2], skip_special_tokens=True)
