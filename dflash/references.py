"""Reference completions: the target's own greedy output for each prompt, cached on disk.

Under greedy decoding DFlash is lossless, so the reference is exactly what speculative decoding
would output; the replay (replay.py) walks the draft-verify loop against it.

Sources:
- `local`: batched greedy decoding with a KV cache (left padding, stop at EOS per row).
- `sglang`: an SGLang server's `/generate` with `input_ids` (exact token ids back).
- `openai`: an OpenAI-compatible `/v1/completions` server (token-id prompt; the text answer is
  re-tokenized, so a server-side tokenizer mismatch shows as low τ: prefer sglang).

Cache: one JSON file per reference under `<cache_dir>/references/`, named by the sha256 of all
that decides it (target identity, source (with the target's dtype for `local`), rendered prompt ids,
max_new_tokens, template options).
Written to a temporary file and renamed, so a crash never leaves a half-written entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.target import Target, forward, new_cache


from dflash.errors import ReferenceError


@dataclass
class ReferenceStats:
    hits: int = 0
    generated: int = 0
    new_tokens: int = 0  # tokens generated in this run (not cached)


def reference_key(identity: str, source: str, prompt_ids: list[int], max_new_tokens: int, template: dict[str, Any]) -> str:
    blob = json.dumps([identity, source, prompt_ids, max_new_tokens, sorted(template.items())], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ReferenceCache:
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser() / "references"

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> list[int] | None:
        p = self._path(key)
        if not p.is_file():
            return None
        try:
            return [int(t) for t in json.loads(p.read_text())["completion_ids"]]
        except (ValueError, KeyError, TypeError):  # unreadable entry: regenerate rather than fail
            return None

    def put(self, key: str, completion_ids: list[int], meta: dict[str, Any]) -> None:
        atomic_write_text(self._path(key), json.dumps({**meta, "completion_ids": completion_ids}))


@torch.no_grad()
def greedy_generate(target: Target, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 16) -> list[list[int]]:
    """Greedy completions (EOS included when reached), batched with left padding. On CUDA the
    static-cache engine with CUDA graphs (decode.generate) where it supports the target; otherwise
    (and on CPU) a dynamic KV cache."""
    if target.device.type == "cuda":
        from dflash.decode import generate, unsupported

        if unsupported(target.config) is None:
            return generate(target, prompts, max_new_tokens, batch_size)
    eos = torch.tensor(target.eos_ids, device=target.device)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else target.eos_ids[0]
    out: list[list[int]] = [[] for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    for b0 in range(0, len(order), batch_size):
        rows = order[b0 : b0 + batch_size]
        P = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), P), pad, dtype=torch.long, device=target.device)
        mask = torch.zeros((len(rows), P), dtype=torch.long, device=target.device)
        for r, i in enumerate(rows):
            ids[r, P - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, P - len(prompts[i]) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [b, P]
        cache = new_cache(target)
        logits = forward(target, ids, cache, attention_mask=mask, position_ids=pos).logits[:, -1]
        done = torch.zeros(len(rows), dtype=torch.bool, device=target.device)
        gen = []
        for step in range(max_new_tokens):
            nxt = logits.argmax(-1)  # [b]
            gen.append(torch.where(done, -1, nxt))
            done |= torch.isin(nxt, eos)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            pos = pos[:, -1:] + 1
            logits = forward(target, nxt[:, None], cache, attention_mask=mask, position_ids=pos).logits[:, -1]
        toks = torch.stack(gen, dim=1).tolist()  # [b, steps]
        for r, i in enumerate(rows):
            out[i] = [t for t in toks[r] if t >= 0]
    return out


def _post_json(url: str, payload: dict[str, Any], timeout: float) -> Any:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, TimeoutError) as e:
        raise ReferenceError(f"reference server {url} did not answer ({e}); start it, or use references.source=local") from None


def server_generate(target: Target, prompts: list[list[int]], max_new_tokens: int, source: str, url: str, model: str | None, timeout: float = 600) -> list[list[int]]:
    out = []
    for ids in prompts:
        if source == "sglang":
            r = _post_json(url.rstrip("/") + "/generate", {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}}, timeout)
            r = r[0] if isinstance(r, list) else r
            if "output_ids" not in r:
                raise ReferenceError(f"SGLang answer has no output_ids (keys: {sorted(r)}); is {url} an SGLang server?")
            out.append([int(t) for t in r["output_ids"]][:max_new_tokens])
        elif source == "openai":
            r = _post_json(url.rstrip("/") + "/v1/completions", {"model": model, "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0.0}, timeout)
            text = r["choices"][0]["text"]
            comp = target.tokenizer(text, add_special_tokens=False)["input_ids"][:max_new_tokens]
            if r["choices"][0].get("finish_reason") == "stop" and len(comp) < max_new_tokens:
                comp.append(target.eos_ids[0])
            out.append(comp)
        else:
            raise ReferenceError(f"unknown reference source {source!r}; use local, sglang or openai")
    return out


def get_references(
    target: Target,
    prompts: list[list[int]],
    max_new_tokens: int,
    template: dict[str, Any],
    cache_dir: str | Path,
    source: str = "local",
    batch_size: int = 16,
    url: str | None = None,
    model: str | None = None,
    use_cache: bool = True,
) -> tuple[list[list[int]], ReferenceStats]:
    cache = ReferenceCache(cache_dir)
    # local greedy output depends on the dtype the target runs in (bf16 and fp32 diverge); a server's does not
    src = f"local:{target.dtype}" if source == "local" else f"{source}:{url}"
    keys = [reference_key(target.identity, src, p, max_new_tokens, template) for p in prompts]
    refs: list[list[int] | None] = [cache.get(k) if use_cache else None for k in keys]
    todo = [i for i, r in enumerate(refs) if r is None]
    stats = ReferenceStats(hits=len(prompts) - len(todo), generated=len(todo))
    if todo:
        todo_prompts = [prompts[i] for i in todo]
        if source == "local":
            gen = greedy_generate(target, todo_prompts, max_new_tokens, batch_size)
        else:
            gen = server_generate(target, todo_prompts, max_new_tokens, source, url or "", model)
        for i, comp in zip(todo, gen):
            if not comp:
                raise ReferenceError(f"prompt {i}: the reference completion is empty")
            refs[i] = comp
            stats.new_tokens += len(comp)
            cache.put(keys[i], comp, {"target": target.identity, "source": source, "max_new_tokens": max_new_tokens})
    return [r for r in refs if r is not None], stats
