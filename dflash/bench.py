"""Benchmark: where the evaluation's time goes, and the online speedup. Prints figures only.

    python -m dflash.bench [overrides...]              # the default job, cold then warm
    python -m dflash.bench --online 4 [overrides...]   # also target-only vs DFlash decoding, 4 prompts

Cold = references generated (the reference cache is bypassed); warm = references read from the
cache. Both runs load the target from the converted cache, as every run after the first does.
Online: wall time per output token of plain greedy decoding (batch 1, KV cache) against the
draft-verify loop (speculative.py) on the same prompts, same backend: the speedup of §3.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from dflash import config as config_mod
from dflash import pipeline
from dflash import target as target_mod
from dflash.prompts import load_prompts, render
from dflash.references import greedy_generate
from dflash.speculative import speculative_generate

CONF = Path(__file__).resolve().parents[1] / "conf"


def stage_table(label: str, timings: dict[str, float], wall: float) -> str:
    rows = [f"{label}: {wall:.1f} s wall"]
    for k, v in timings.items():
        rows.append(f"  {k:<13} {v:7.2f} s  {100 * v / wall:5.1f} %")
    rows.append(f"  {'other':<13} {wall - sum(timings.values()):7.2f} s  {100 * (wall - sum(timings.values())) / wall:5.1f} %")
    return "\n".join(rows)


def online(cfg: dict, n: int) -> str:
    t = cfg.target
    target, drafter = pipeline.load_models(cfg, target_mod.inspect_target(t.kind, t.path, cfg.cache_dir, t.max_context), {})
    pc = cfg.prompts
    prompts = load_prompts(pc.source, pc.path, n, pc.subsets)
    ids = [render(p, target.tokenizer, vars(cfg.target.template)) for p in prompts]
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    greedy_generate(target, ids[:1], 8, 1), speculative_generate(target, drafter.model, ids[0], 8)  # warm-up
    base_t = spec_t = 0.0
    base_n = spec_n = steps = 0
    for x in ids:
        sync(); t = time.perf_counter()
        ref = greedy_generate(target, [x], pc.max_new_tokens, 1)[0]
        sync(); base_t += time.perf_counter() - t
        out = speculative_generate(target, drafter.model, x, pc.max_new_tokens, cfg.attention.drafter)
        sync(); spec_t += out.counters.wall_s
        base_n += len(ref); spec_n += len(out.tokens); steps += out.counters.steps
    tpt_base, tpt_spec = base_t / base_n, spec_t / spec_n
    return (
        f"online, {len(ids)} prompts, batch 1, {target.device}: target-only {1 / tpt_base:.1f} tok/s, DFlash {1 / tpt_spec:.1f} tok/s "
        f"(τ {(spec_n - len(ids)) / max(steps, 1):.2f}), speedup {tpt_base / tpt_spec:.2f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--online", type=int, default=0, help="prompts for the online speedup measurement (0: skip)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    config_mod.register()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = config_mod.to_object(compose("config", overrides=a.overrides))
    for label, use_cache in (("cold (references generated)", False), ("warm (references cached)", True)):
        cfg.references.use_cache = use_cache
        target_mod._LAST = None  # load the target again, as a new process would
        t = time.perf_counter()
        res = pipeline.run(cfg)
        wall = time.perf_counter() - t
        print(stage_table(label, res.timings, wall))
        print(f"  τ {res.metrics['acceptance_length']:.3f}, {int(res.metrics['new_tokens'])} new tokens, {int(res.metrics['prompts'])} prompts")
    if a.online:
        print(online(cfg, a.online))


if __name__ == "__main__":
    main()
