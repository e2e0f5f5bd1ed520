"""Training sequences: the target regenerates every response, cached as token ids.

Responses are the target's own greedy continuations (DFLASH.md §4), so the label at anchor + k is
the target's greedy token there. Sequences are cached as token ids in shards under
`<cache_dir>/train_data/<key>/shard_<i>.pt`, each written to a temporary file and renamed; the key
hashes the target identity and dtype (bf16 and fp32 greedy tokens differ), the prompts' token ids
and the generation settings.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.stages.prompts import Prompt, render
from dflash.util.files import atomic_write
from dflash.util.progress import log


@dataclass
class TrainSeq:
    ids: list[int]  # rendered prompt + greedy response
    prompt_len: int


def _atomic_torch_save(obj: Any, path: Path) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def data_key(identity: str, prompt_ids: list[list[int]], max_new_tokens: int, template: dict[str, Any]) -> str:
    h = hashlib.sha256(json.dumps([identity, max_new_tokens, sorted(template.items())], default=str).encode())
    for ids in prompt_ids:
        h.update(json.dumps(ids).encode())
    return h.hexdigest()[:24]


def generate_shard(target: Any, prompts: list[list[int]], max_new_tokens: int, batch_size: int, path: Path) -> tuple[list[int], list[int], list[int]]:
    """Greedy responses to rendered prompts, saved as one shard -> flat ids, lengths, prompt lengths."""
    from dflash.stages.references import greedy_generate

    t0 = time.time()
    comps = greedy_generate(target, prompts, max_new_tokens, batch_size)
    flat, lens, plens = [], [], []
    for p, c in zip(prompts, comps):
        flat += p + c
        lens.append(len(p) + len(c))
        plens.append(len(p))
    _atomic_torch_save({"flat": torch.tensor(flat, dtype=torch.int32), "lens": torch.tensor(lens), "prompt_lens": torch.tensor(plens)}, path)
    ntok, dt = sum(len(c) for c in comps), time.time() - t0
    log.info("data: shard %s: %d prompts, %d new tokens in %.1fs (%.0f tok/s)", path.name, len(prompts), ntok, dt, ntok / max(dt, 1e-9))
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
) -> list[TrainSeq]:
    """Render, regenerate greedily with the target, cache: -> prompt + response sequences
    (prompts over max_prompt_tokens and responses under min_response_tokens left out)."""
    rendered = [render(p, target.tokenizer, template) for p in prompts]
    rendered = [r for r in rendered if len(r) <= max_prompt_tokens]
    key = data_key(f"{target.identity}:{target.dtype}", rendered, max_new_tokens, template)
    root = Path(cache_dir).expanduser() / "train_data" / key
    seqs: list[TrainSeq] = []
    for s0 in range(0, len(rendered), shard_size):
        shard = root / f"shard_{s0 // shard_size:04d}.pt"
        if shard.is_file():
            obj = torch.load(shard, weights_only=True)
            flat, lens, plens = obj["flat"].tolist(), obj["lens"].tolist(), obj["prompt_lens"].tolist()
            log.info("data: shard %s from cache (%d sequences)", shard.name, len(lens))
        else:
            flat, lens, plens = generate_shard(target, rendered[s0 : s0 + shard_size], max_new_tokens, batch_size, shard)
        o = 0
        for n, pl in zip(lens, plens):
            if n - pl >= min_response_tokens:
                seqs.append(TrainSeq(ids=flat[o : o + n], prompt_len=pl))
            o += n
    return seqs
