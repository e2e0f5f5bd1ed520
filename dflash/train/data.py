"""Training sequences: the target regenerates every response, cached as token ids.

Responses are the target's own greedy continuations (docs/family.md §4), so the label at anchor + k is
the target's greedy token there. Sequences are cached as token ids in shards under
`<cache_dir>/train_data/<key>/shard_<i>.pt`, each written to a temporary file and renamed; the key
hashes the target identity and dtype (bf16 and fp32 greedy tokens differ), the prompts' token ids
and the generation settings. A `deadline` (data.max_gen_minutes) stops generating new shards once
passed: training then runs on the shards made (and cached) so far, and a later run with a later
deadline adds the rest.

Multi-turn prompts (a user turn after the target's answer: dflash.stages.references.turns) come in rounds
(`build_chat_sequences`): round 1 regenerates every single prompt and every first turn; round 2
asks each second turn after the target's decoded answer to its first, and so on. Every turn's
answer is a training sequence; a later turn's context holds the target's earlier answers.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.stages.prompts.sets import Prompt, render
from dflash.util.files import atomic_write
from dflash.util.progress import log


@dataclass
class TrainSeq:
    ids: list[int]  # rendered prompt + greedy response
    prompt_len: int
    pid: str = ""  # the prompt's id


def _atomic_torch_save(obj: Any, path: Path) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def data_key(identity: str, prompt_ids: list[list[int]], max_new_tokens: int, template: dict[str, Any]) -> str:
    h = hashlib.sha256(json.dumps([identity, max_new_tokens, sorted(template.items())], default=str).encode())
    for ids in prompt_ids:
        h.update(json.dumps(ids).encode())
    return h.hexdigest()[:24]


def generate_shard(
    target: Any, prompts: list[list[int]], max_new_tokens: int, batch_size: int, path: Path
) -> tuple[list[int], list[int], list[int]]:
    """Greedy responses to rendered prompts, saved as one shard -> flat ids, lengths, prompt lengths."""
    from dflash.stages.references.collect import greedy_generate

    t0 = time.time()
    comps = greedy_generate(target, prompts, max_new_tokens, batch_size)
    flat, lens, plens = [], [], []
    for p, c in zip(prompts, comps):
        flat += p + c
        lens.append(len(p) + len(c))
        plens.append(len(p))
    _atomic_torch_save(
        {"flat": torch.tensor(flat, dtype=torch.int32), "lens": torch.tensor(lens), "prompt_lens": torch.tensor(plens)},
        path,
    )
    ntok, dt = sum(len(c) for c in comps), time.time() - t0
    log.info(
        "data: shard %s: %d prompts, %d new tokens in %.1fs (%.0f tok/s)",
        path.name,
        len(prompts),
        ntok,
        dt,
        ntok / max(dt, 1e-9),
    )
    return flat, lens, plens


def build_sequences(
    target: Any,
    prompts: list[Prompt],
    template: dict[str, Any],
    max_new_tokens: int,
    max_prompt_tokens: int,
    batch_size: int,
    cache_dir: str | Path,
    shard_size: int = 1024,
    min_response_tokens: int = 16,
    deadline: float | None = None,
) -> list[TrainSeq]:
    """Render, regenerate greedily with the target, cache: -> prompt + response sequences
    (prompts over max_prompt_tokens and responses under min_response_tokens left out; past
    `deadline` (time.time()), shards not yet cached are not generated)."""
    pairs = [(p.id, render(p, target.tokenizer, template)) for p in prompts]
    pairs = [(i, r) for i, r in pairs if len(r) <= max_prompt_tokens]
    pids, rendered = [i for i, _ in pairs], [r for _, r in pairs]
    key = data_key(f"{target.identity}:{target.dtype}", rendered, max_new_tokens, template)
    root = Path(cache_dir).expanduser() / "train_data" / key
    seqs: list[TrainSeq] = []
    for s0 in range(0, len(rendered), shard_size):
        shard = root / f"shard_{s0 // shard_size:04d}.pt"
        if shard.is_file():
            obj = torch.load(shard, weights_only=True)
            flat, lens, plens = obj["flat"].tolist(), obj["lens"].tolist(), obj["prompt_lens"].tolist()
            log.info("data: shard %s from cache (%d sequences)", shard.name, len(lens))
        elif deadline is not None and time.time() > deadline:
            log.info("data: generation deadline passed: %d of %d prompts regenerated", s0, len(rendered))
            break
        else:
            flat, lens, plens = generate_shard(
                target, rendered[s0 : s0 + shard_size], max_new_tokens, batch_size, shard
            )
        o = 0
        for j, (n, pl) in enumerate(zip(lens, plens)):
            if n - pl >= min_response_tokens:
                seqs.append(TrainSeq(ids=flat[o : o + n], prompt_len=pl, pid=pids[s0 + j]))
            o += n
    return seqs


def build_chat_sequences(
    target: Any,
    prompts: list[Prompt],
    template: dict[str, Any],
    max_new_tokens: int,
    max_prompt_tokens: int,
    batch_size: int,
    cache_dir: str | Path,
    shard_size: int = 1024,
    min_response_tokens: int = 16,
    deadline: float | None = None,
    chat_prompt_tokens: int | None = None,
) -> list[TrainSeq]:
    """Single prompts and multi-turn chats (turns in rounds, each after the target's own answers; a
    later turn's prompt may hold up to `chat_prompt_tokens`) -> every turn's sequence. Under a
    `deadline`, round 1 stops early enough to leave the later rounds their prompts' share of the time."""
    from dflash.stages.references.turns import expand, fill, turn_of

    turns = expand(prompts)
    later = sum(1 for p in turns if turn_of(p) > 1) / max(len(turns), 1)
    base = {p.id: p for p in prompts}
    answers: dict[str, dict[int, str]] = {}  # prompt id -> turn -> the target's decoded answer
    seqs: list[TrainSeq] = []
    for k in range(1, max((turn_of(p) for p in turns), default=1) + 1):
        todo = [p for p in turns if turn_of(p) == k]
        if k > 1:
            got_all = {r: [a[j] for j in range(1, k)] for r, a in answers.items() if all(j in a for j in range(1, k))}
            todo = [
                fill(p, got_all[p.id.rsplit("/turn_", 1)[0]]) for p in todo if p.id.rsplit("/turn_", 1)[0] in got_all
            ]
        if not todo:
            break
        until = deadline - later * (deadline - time.time()) if deadline is not None and k == 1 else deadline
        got = build_sequences(
            target,
            todo,
            template,
            max_new_tokens,
            max_prompt_tokens if k == 1 else (chat_prompt_tokens or max_prompt_tokens),
            batch_size,
            cache_dir,
            shard_size,
            0,
            until,
        )
        for s in got:
            root = s.pid.rsplit("/turn_", 1)[0] if "/turn_" in s.pid else s.pid
            if root in base and "/turn_" in s.pid:
                answers.setdefault(root, {})[k] = target.tokenizer.decode(
                    s.ids[s.prompt_len :], skip_special_tokens=True
                )
        seqs += [s for s in got if len(s.ids) - s.prompt_len >= min_response_tokens]
    return seqs
