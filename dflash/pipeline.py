"""The evaluation pipeline: config -> load -> references -> features -> replay -> metrics.

`run(cfg)` takes the resolved config as a plain dict (see dflash/config.py for its schema) and
returns an `EvalResult`: plain data, no tracking. evaluate.py hands the result to tracking.py.
Every stage is timed (`EvalResult.timings`, seconds) so the README can report where time goes.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from dflash.checkpoint import LoadedDrafter, load_drafter
from dflash.drafter import ATTENTION_BACKENDS
from dflash.metrics import Counters, accept_rate, accept_rate_cond, acceptance_length, accuracy, confidence, nll, scored, summarize
from dflash.errors import PromptError
from dflash.prompts import Prompt, load_prompts, render
from dflash.references import get_references
from dflash.replay import Block, evaluate_sequence
from dflash.target import Target, load_target, tapped_forward


from dflash.errors import ConfigError, UserError


USER_ERRORS = (UserError,)


@dataclass
class EvalResult:
    metrics: dict[str, float]
    curves: dict[str, list[float]]  # per-position series, index k-1 for slot k
    per_prompt: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    timings: dict[str, float]
    info: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


@contextmanager
def timed(timings: dict[str, float], stage: str) -> Iterator[None]:
    t = time.perf_counter()
    yield
    timings[stage] = timings.get(stage, 0.0) + time.perf_counter() - t


def resolve_device(dev: dict[str, Any], attention: dict[str, Any], target_dtype: str | None = None) -> tuple[str, str]:
    name = dev["name"]
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible; use device=cpu (or device=auto)")
    dtype = target_dtype or dev["dtype"]
    if dtype == "auto":
        dtype = "bfloat16" if name.startswith("cuda") else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"device.dtype={dtype!r}: use float32, bfloat16, float16 or auto")
    if attention["drafter"] not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention.drafter={attention['drafter']!r}: use one of {ATTENTION_BACKENDS}")
    if attention["drafter"] == "flex" and not name.startswith("cuda"):
        raise ConfigError("attention=flex needs a CUDA device (flex_attention is compiled for GPU); on CPU use attention=sdpa or attention=eager")
    if dev.get("threads"):
        torch.set_num_threads(int(dev["threads"]))
    return name, dtype


def job_device(name: str, job_num: int) -> str:
    """The GPU of sweep job `job_num`: one job per GPU, round robin (CPU stays CPU)."""
    n = torch.cuda.device_count() if name.startswith("cuda") or name == "auto" else 0
    return f"cuda:{job_num % n}" if n else name


def check_lengths(prompts: list[Prompt], ids: list[list[int]], max_new_tokens: int, max_context: int) -> None:
    for p, x in zip(prompts, ids):
        if len(x) + max_new_tokens > max_context:
            raise PromptError(
                f"prompt {p.id!r} has {len(x)} tokens; with prompts.max_new_tokens={max_new_tokens} that exceeds the target's "
                f"context of {max_context} tokens. Shorten the prompt, lower prompts.max_new_tokens, or drop it from the set"
            )


def load_models(cfg: dict[str, Any], timings: dict[str, float]) -> tuple[Target, LoadedDrafter]:
    device, dtype = resolve_device(cfg["device"], cfg["attention"], cfg["target"].get("dtype"))
    t, d = cfg["target"], cfg["drafter"]
    with timed(timings, "load_target"):
        target = load_target(
            t["kind"], t["path"], dtype=dtype, device=device, attn=cfg["attention"]["target"], cache_dir=cfg["cache_dir"],
            max_context=t.get("max_context"), device_map=cfg["device"].get("device_map"),
        )
    with timed(timings, "load_drafter"):
        overrides = {k: d.get(k) for k in ("block_size", "mask_token_id", "target_layer_ids")}
        if d["kind"] == "init":  # shape the random drafter by the target config's defaults
            overrides["mask_token_id"] = overrides["mask_token_id"] if overrides["mask_token_id"] is not None else t.get("mask_token_id")
            overrides["target_layer_ids"] = overrides["target_layer_ids"] or t.get("default_taps")
            if overrides["mask_token_id"] is None:
                raise ConfigError("drafter=init needs a mask token id: set drafter.mask_token_id or target.mask_token_id")
        name = d.get("name") or _default_name(d)
        drafter = load_drafter(
            target, d["kind"], name, run_dir=d.get("run_dir"), step=d.get("step"), path=d.get("path"), overrides=overrides,
            init={"num_layers": d.get("num_layers", 1), "num_taps": d.get("num_taps", 5), "seed": d.get("seed", 0), "mask_token_id": overrides["mask_token_id"]},
        )
        drafter.model.to(device=target.head_device, dtype=target.dtype).eval().requires_grad_(False)  # beside the last layers
    return target, drafter


def _default_name(d: dict[str, Any]) -> str:
    src = d.get("run_dir") if d["kind"] == "training" else d.get("path") if d["kind"] == "hf" else None
    return Path(src).name if src else d["kind"]


def run_name(drafter_cfg: dict[str, Any], step: int | None = None) -> str:
    name = drafter_cfg.get("name") or _default_name(drafter_cfg)
    step = step if step is not None else drafter_cfg.get("step")
    if drafter_cfg["kind"] == "init":
        return f"{name}@seed_{drafter_cfg.get('seed', 0)}"
    return f"{name}@step_{step}" if step is not None else f"{name}@latest"


def run(cfg: dict[str, Any]) -> EvalResult:
    timings: dict[str, float] = {}
    torch.manual_seed(int(cfg.get("seed", 0)))
    target, drafter = load_models(cfg, timings)
    pc, tmpl = cfg["prompts"], cfg["target"]["template"]
    with timed(timings, "prompts"):
        prompts = load_prompts(pc["source"], pc.get("path"), pc.get("num_prompts"), pc.get("subsets"))
        ids = [render(p, target.tokenizer, tmpl) for p in prompts]
        check_lengths(prompts, ids, int(pc["max_new_tokens"]), target.max_context)
    rc = cfg["references"]
    with timed(timings, "references"):
        refs, ref_stats = get_references(
            target, ids, int(pc["max_new_tokens"]), tmpl, cfg["cache_dir"], source=rc["source"], batch_size=int(rc["batch_size"]),
            url=rc.get("url"), model=rc.get("model"), use_cache=bool(rc.get("use_cache", True)),
        )
    backend, layer_ids = cfg["attention"]["drafter"], drafter.model.cfg.target_layer_ids
    chunk = int(cfg.get("anchors_per_chunk") or (256 if target.device.type == "cuda" else 32))
    per_prompt: list[tuple[str, Counters]] = []
    leak: list[tuple[str, Counters]] = []
    rows, samples = [], []
    for i, (p, x, r) in enumerate(zip(prompts, ids, refs)):
        with timed(timings, "features"):
            taps = tapped_forward(target, torch.tensor([x + r], device=target.device), layer_ids)[0]  # [T, n*H]
        with timed(timings, "replay"):
            t0 = time.perf_counter()
            c, blocks = evaluate_sequence(drafter.model, target, x, r, taps, backend, chunk, scores=bool(cfg.get("scores")))
            c.wall_s = time.perf_counter() - t0
        per_prompt.append((p.subset, c))
        if cfg.get("leak_probe"):
            with timed(timings, "leak_probe"):
                leak.append((p.subset, evaluate_sequence(drafter.model, target, x, r, taps, backend, chunk, see_anchor=True)[0]))
        rows.append({"id": p.id, "subset": p.subset, "prompt_tokens": len(x), "new_tokens": c.new_tokens, "steps": c.steps, "committed": c.committed, "acceptance_length": acceptance_length(c),
                     "tf_correct": c.tf_correct, "tf_total": c.tf_total, "tf_nll": sum(c.tf_nll) if scored(c) else None})
        if i < int(cfg.get("num_samples", 3)):
            samples.append(sample_record(target, p, x, r, blocks))
    metrics = summarize(per_prompt)
    total = sum((c for _, c in per_prompt[1:]), per_prompt[0][1])
    curves = {"accept_rate": accept_rate(total), "accept_rate_cond": accept_rate_cond(total), "accuracy": accuracy(total)}
    if scored(total):
        curves.update(nll=nll(total), confidence=confidence(total))
    if leak:
        lm = summarize(leak)
        metrics["leak_probe/acceptance_length"] = lm["acceptance_length"]
        metrics["leak_probe/tau_gain"] = lm["acceptance_length"] - metrics["acceptance_length"]
    metrics["tokens_per_second_replay"] = total.new_tokens / max(timings.get("replay", 0.0), 1e-9)
    info = {
        "drafter_name": drafter.name, "drafter_step": drafter.step, "checkpoint_path": drafter.path, "checkpoint_sha256": drafter.sha256,
        "run_name": run_name(cfg["drafter"], drafter.step), "device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""),
        "target_identity": target.identity, "target_source": target.source, "block_size": drafter.model.cfg.block_size,
        "target_layer_ids": layer_ids, "mask_token_id": drafter.model.cfg.mask_token_id,
        "references": {"cached": ref_stats.hits, "generated": ref_stats.generated, "new_tokens": ref_stats.new_tokens},
    }
    return EvalResult(metrics, curves, rows, samples, timings, info, drafter.warnings)


def sample_record(target: Target, p: Prompt, x: list[int], r: list[int], blocks: list[Block]) -> dict[str, Any]:
    tok = target.tokenizer
    seq = x + r
    return {
        "id": p.id,
        "subset": p.subset,
        "prompt": p.messages[-1][1],
        "reference": tok.decode(r, skip_special_tokens=False),
        "blocks": [
            {
                "anchor": tok.decode([seq[b.anchor_pos]]),
                "proposal": tok.decode(b.proposal),
                "accepted": b.accepted,
                "accepted_text": tok.decode(b.proposal[: b.accepted]),
            }
            for b in blocks
        ],
    }
