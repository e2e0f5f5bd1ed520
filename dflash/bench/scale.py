"""The bench at the users' shape: a random Qwen3.6-27B-shaped VL checkpoint, evaluated stage by stage.

    dflash-bench --skip sweep,online,generation --scale qwen3_6_27b [--scale-devices cuda,cpu] [--scale-gpu
    12x256]
        [--scale-cpu 4x64] [--scale-engine] [--scale-tokenizer DIR] [--scale-drafter dflash2] [--scale-profile]

`build_vl(shape, folder, tokenizer)` writes a `Qwen3_5ForConditionalGeneration` of random weights
(the real config's text decoder: 64 layers, 3 Gated DeltaNet layers to 1 full-attention layer,
hidden 5120, vocabulary 248,320; and its vision tower) as a VL folder: built on the GPU in bf16
where there is one and saved shard by shard (safetensors, `model.safetensors.index.json`), with
the given tokenizer beside it (SmolLM2's: ids past its 49,152 decode to nothing). Not committed;
under `<cache_dir>/bench/<shape>` (rebuilt when absent). The random model is freed before any child
starts (and the CUDA cache emptied): the child loads the 27B target on the same GPU.

`scale_eval` (a child process per device, so peak RSS is its own): `pipeline.run` with
`target=qwen3_6_27b target.path=<folder> drafter=init drafter.num_layers=5` (`--scale-drafter`, DRAFTERS:
`dflash`, or `dflash2` as SpecForge's 27B example: block 8, every layer sliding at 2048 and non-causal,
random convolutions and selector) on builtin prompts,
then the replay again in each mode (`replay.anchors`, `replay.tf_stride`), the drafter saved as an
HF folder and loaded back from it (what a checkpoint evaluation pays)
and, with `--scale-engine` on CUDA, the references engine with and without inductor
(`speed.bench_generation`): its set-up and time per step, whose ratio is the compile's break-even.
First use and steady state apart: `steady` runs the references and features stages again in the same
process (kernels compiled and autotuned by the first run; a new engine, every reference regenerated, the
features' caches emptied), and each is held against its floor measured on the same device
(dflash/bench/floors.py: the forward's arithmetic at the GEMM rate, one read of the weights at the copy
rate); `--scale-profile` adds the top ops of a steady feature pass and of a few decode steps.
`report` prints the stage table, the ratios of issue 21 and the field's protocol projected from
the per-token costs measured here (docs/family.md §7: 2048 new tokens, 128 prompts per data set).
"""

from __future__ import annotations

import gc
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dflash.bench.floors import counted_flops
from dflash.bench.steady import (
    against_floors,
    amdahl,
    at_threads,
    floors_of,
    profiles,
    reference_steps,
    steady,
    steady_rows,
)
from dflash.config import schema as config_mod
from dflash.config.compose import compose
from dflash.evaluation import pipeline
from dflash.util.files import atomic_dir, remove_stale
from dflash.util.progress import log

SHAPES: dict[
    str, dict[str, Any]
] = {  # Qwen3.5 / 3.6-27B's config.json (text and vision), as transformers' Qwen3_5Config takes it
    "qwen3_6_27b": dict(
        text_config=dict(
            hidden_size=5120,
            intermediate_size=17408,
            num_hidden_layers=64,
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=256,
            vocab_size=248320,
            max_position_embeddings=262144,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=16,
            linear_num_value_heads=48,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            attn_output_gate=True,
            full_attention_interval=4,
            eos_token_id=248044,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000000,
                partial_rotary_factor=0.25,
                mrope_interleaved=True,
                mrope_section=[11, 11, 10],
            ),
        ),
        vision_config=dict(
            depth=27,
            hidden_size=1152,
            intermediate_size=4304,
            num_heads=16,
            out_hidden_size=5120,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=2304,
        ),
        tie_word_embeddings=False,
    ),
    "tiny_vl": dict(  # the tests' shape: the same code path in seconds
        text_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=49152,
            max_position_embeddings=4096,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            eos_token_id=2,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=4,
            num_position_embeddings=16,
        ),
    ),
}
DRAFTERS = {  # --scale-drafter: the drafter=init overrides of the 5-layer drafter the bench evaluates
    "dflash": [],
    "dflash2": ["drafter.arch=dflash2", "drafter.block_size=8", "drafter.window=2048", "drafter.is_causal=false"],
}
SHARD_BYTES = 4 << 30
PROTOCOL_TOKENS, PROTOCOL_PROMPTS = (
    2048,
    128,
)  # docs/family.md §7: max_new_tokens, prompts per data set (gsm8k, math500, mbpp: 128)


def build_vl(shape: str, folder: Path, tokenizer: Any) -> Path:
    """A random-weight VL checkpoint of `shape` (bf16; on CUDA when there is one), saved shard by shard."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    if (folder / "config.json").is_file():
        return folder
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    config = Qwen3_5Config(**SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen3_5ForConditionalGeneration._from_config(config, dtype=torch.bfloat16).eval()
    built = time.perf_counter() - t0
    for d in remove_stale(folder):
        log.info("scale: removed %s, left by a process that was killed", d)
    sd = model.state_dict()
    shards: list[list[str]] = [[]]
    size = 0
    for k, v in sd.items():
        if size and size + v.numel() * v.element_size() > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += v.numel() * v.element_size()
    total = sum(v.numel() * v.element_size() for v in sd.values())
    params = sum(v.numel() for v in sd.values())
    with atomic_dir(
        folder, replace=True
    ) as tmp:  # renamed when complete; modes follow the umask; a folder without config.json is replaced
        index: dict[str, str] = {}
        for i, keys in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(
                {k: sd[k].detach().to("cpu").contiguous() for k in keys}, str(tmp / name), metadata={"format": "pt"}
            )
            index.update({k: name for k in keys})
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": index})
        )
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    del model, sd
    release(dev)
    log.info(
        "scale: %s written to %s: %.2fB parameters, %.1f GB, built in %.1f s on %s, %.1f s in all",
        shape,
        folder,
        params / 1e9,
        total / 1e9,
        built,
        dev,
        time.perf_counter() - t0,
    )
    return folder


def release(device: str) -> None:
    """Free what was built on `device`: collected now (modules hold reference cycles) and, on CUDA, the allocator's
    cache emptied, so that a child process loading the target on the same GPU finds the memory."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def drafter_from_file(cfg: config_mod.EvalConfig, info: Any, where: Path) -> dict[str, float]:
    """drafter=init built (its random init), saved as an HF folder, then loaded back as a checkpoint evaluation loads
    it."""
    from dflash.models.drafter.checkpoint import build_drafter, fit_drafter
    from dflash.models.drafter.files import save_hf_folder

    device, dtype = pipeline.resolve_device(cfg.device, cfg.attention, cfg.target.dtype)
    out: dict[str, float] = {}
    for kind in ("init", "hf"):
        saved = replace(
            cfg.drafter, kind="hf", path=str(where), name="saved", arch="dflash", window=None, is_causal=None
        )  # the folder says
        c = cfg if kind == "init" else replace(cfg, drafter=saved)
        t0 = time.perf_counter()
        d = build_drafter(fit_drafter(pipeline.read_drafter_conf(c), info), device=device, dtype=getattr(torch, dtype))
        d.model.eval().requires_grad_(False)  # built on the device in its dtype, as pipeline.build_beside builds it
        _sync(device)
        out[f"drafter_{kind}_s"] = time.perf_counter() - t0
        if (
            d.digest is not None
        ):  # the checkpoint's sha256 runs in a thread beside the load: what it adds when awaited at once
            t1 = time.perf_counter()
            d.digest.result()
            out["drafter_digest_wait_s"] = time.perf_counter() - t1
        if kind == "init":
            out["drafter_params"] = sum(p.numel() for p in d.model.parameters())
            save_hf_folder(d.model, where)
        del d
    return out


def scale_eval(spec: dict[str, Any]) -> None:
    """In a child process: one evaluation of the VL folder on one device; prints JSON last."""
    from dflash.models.target.model import inspect_target
    from dflash.util.memo import PROCESS
    from dflash.util.progress import configure

    configure(True)
    n, m = spec["prompts"], spec["max_new_tokens"]
    ov = [
        "target=qwen3_6_27b",
        f"target.path={spec['folder']}",
        "drafter=init",
        "drafter.num_layers=5",
        f"device={spec['device']}",
        "device.dtype=bfloat16",
        f"prompts.num_prompts={n}",
        f"prompts.max_new_tokens={m}",
        "num_samples=0",
        "tracking.enabled=false",
        f"cache_dir={spec['cache_dir']}",
        *spec.get("overrides", []),
    ]
    cfg = compose(ov)
    t0 = time.perf_counter()
    res = pipeline.run(cfg)
    wall = time.perf_counter() - t0
    r = res.prompts
    dc = res.info.drafter_config
    out: dict[str, Any] = dict(
        device=spec["device"],
        timings=res.timings,
        wall=wall,
        prompts=len(r),
        max_new_tokens=m,
        block_size=res.info.block_size,
        drafter=f"{dc.get('architecture', 'DFlashDraftModel')}, block {res.info.block_size}, sliding layers "
        f"{dc.get('sliding_layers')} (window {dc.get('sliding_window')}), causal layers {dc.get('causal_layers')}",
        prompt_tokens=sum(len(p.prompt_ids) for p in r),
        new_tokens=sum(len(p.reference) for p in r),
        kernel=res.info.linear_attention_kernel,
        engine=res.info.references.engine,
        tau=res.metrics["acceptance_length"],
        peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        threads=torch.get_num_threads(),
    )
    out["replay_modes"] = {}  # the replay again in each mode, references cached and features in memory
    default = (cfg.replay.mode(), cfg.replay.tf_stride)
    out["default_replay"] = mode_key(*default)
    for anchors, stride in dict.fromkeys(
        [("all", 1), ("visited", 1), ("visited", 4), default]
    ):  # at τ 1 the visited pair gives the per-anchor costs; the default's mode at its stride: the steady replay
        again = pipeline.run(replace(cfg, replay=replace(cfg.replay, anchors=anchors, tf_stride=stride)))
        out["replay_modes"][mode_key(anchors, stride)] = again.timings["replay"]
    out["replay_flops"] = counted_flops(lambda: pipeline.run(cfg))  # the default mode once more, counted (not timed)
    taps = res.info.target_layer_ids
    out["steady"], prep = steady(cfg, taps)
    out["reference_steps"] = reference_steps(prep, cfg.references.batch_size, m)
    out["floors"] = floors_of(prep, taps, out["steady"]["feature_tokens"])
    if spec.get("profile"):
        out["profiles"] = profiles(cfg, prep, taps)
    if spec["device"] == "cpu" and torch.get_num_threads() > 1:  # thread scaling: a user's box has other core counts
        out["half_threads"] = at_threads(cfg, prep, taps, torch.get_num_threads() // 2)
    del prep
    out["weight_bytes"] = sum(p.stat().st_size for p in Path(spec["folder"]).glob("*.safetensors"))
    if spec["device"].startswith("cuda"):
        out["peak_cuda"] = torch.cuda.max_memory_allocated()
    info = inspect_target("vlm_text", spec["folder"], spec["cache_dir"])
    with tempfile.TemporaryDirectory(prefix="dflash-scale-drafter-") as tmp:
        out.update(drafter_from_file(cfg, info, Path(tmp) / "drafter"))
    if spec.get("engine") and spec["device"] == "cuda":
        from dflash.bench.speed import bench_generation
        from dflash.models.target.model import load_target

        PROCESS.clear()
        target = load_target(info, dtype="bfloat16", device="cuda", cache_dir=spec["cache_dir"])
        g = bench_generation(target, [p.prompt_ids for p in r], m, batches=(len(r),), compile=None, hf=False)
        out["engine_rates"] = [
            dict(method=x.method, batch=x.batch, tokens=x.tokens, seconds=x.seconds, setup_s=x.setup_s) for x in g.rates
        ]
    print(json.dumps(out))


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    log.info(
        "scale: evaluating on %s (%d prompts x %d tokens)", spec["device"], spec["prompts"], spec["max_new_tokens"]
    )
    p = subprocess.run(
        [sys.executable, "-m", "dflash.bench", "--scale-eval", json.dumps(spec)], stdout=subprocess.PIPE, text=True
    )
    if p.returncode:
        raise RuntimeError(f"the {spec['device']} evaluation failed (exit {p.returncode}); its log is above")
    return json.loads(p.stdout.strip().splitlines()[-1])


def mode_key(anchors: str, stride: int) -> str:
    return f"replay.anchors={anchors} replay.tf_stride={stride}"


STEADY_REPLAY = mode_key("all", 1)  # the steady replay of a run that does not name its default (`default_replay`)


def _steady(r: dict[str, Any]) -> dict[str, float] | None:
    """The stages' seconds when the child ran them again in its process (`bench_steady`; the replay: its default mode
    at its default stride again, `replay_modes`), else None."""
    s, again = r.get("steady"), r.get("replay_modes", {}).get(r.get("default_replay", STEADY_REPLAY))
    if not s or again is None:
        return None
    return dict(
        references=s["references"], references_setup=s["references_setup"] or 0.0, features=s["features"], replay=again
    )


def _per_token(r: dict[str, Any]) -> dict[str, float]:
    """Seconds per token of each stage, steady where measured (`_steady`; first use otherwise): references per new
    token (set-up apart), features per token of prompt + reference, replay per reference token."""
    t = r["timings"]
    x = _steady(r) or dict(
        references=t["references"],
        references_setup=t.get("references_setup") or 0.0,
        features=t["features"],
        replay=t["replay"],
    )
    return dict(
        references=(x["references"] - x["references_setup"]) / r["new_tokens"],
        features=x["features"] / (r["prompt_tokens"] + r["new_tokens"]),
        replay=x["replay"] / r["new_tokens"],
    )


def _first_use(r: dict[str, Any]) -> float:
    """Seconds a process pays once, at first use, over the steady stages (kernels compiled and autotuned, the
    engine's first capture, the references' set-up apart): 0 without a steady run."""
    t, x = r["timings"], _steady(r)
    if x is None:
        return 0.0
    first_refs = t["references"] - (t.get("references_setup") or 0.0)
    return sum(
        max(0.0, a - b)
        for a, b in (
            (first_refs, x["references"] - x["references_setup"]),
            (t["features"], x["features"]),
            (t["replay"], x["replay"]),
        )
    )


PUBLISHED_TAU = 6.55  # docs/family.md §7: Qwen3-8B-DFlash-b16 on GSM8K (and HumanEval), temperature 0


def projected_replay(modes: dict[str, float], tokens: int, tau: float, feature_s: float, block: int = 16) -> list[str]:
    """At τ = 1 (a random drafter) the loop visits every anchor, so the `visited` runs at strides 1 and 4
    give the two per-anchor costs: c_full (all `block` slots through the LM head: a teacher-forced anchor) =
    r(1), and c_walk (a visited anchor, the LM head on the slots the walk reads) from r(4) = c_full / 4
    + 3 c_walk / 4. A trained drafter's replay per token is then about c_full / s + c_walk (1 - 1/s) / τ:
    printed for τ of the public drafters, labelled as projected."""
    r1, r4 = modes.get(mode_key("visited", 1)), modes.get(mode_key("visited", 4))
    if r1 is None or r4 is None or abs(tau - 1.0) > 1e-9:
        return []
    c_full, c_walk = r1 / tokens, (4 * r4 - r1) / 3 / tokens
    lines = [
        f"  per anchor at τ 1: teacher-forced ({block} slots, LM head on {block - 1}) {c_full * 1e3:.2f} ms, visited "
        f"only (LM head on the slots "
        f"the walk reads) {c_walk * 1e3:.2f} ms"
    ]
    for s in (1, 4, 16):
        per_tok = c_full / s + c_walk * (1 - 1 / s) / PUBLISHED_TAU
        lines.append(
            f"  projected at τ {PUBLISHED_TAU} (a public drafter's), replay.tf_stride={s}: {per_tok * 1e3:.2f} ms per "
            f"token = "
            f"{per_tok / feature_s:.2f}x the feature pass per token (target <= 0.5x)"
        )
    return lines


def format_device(r: dict[str, Any]) -> list[str]:
    t, pt = r["timings"], _per_token(r)
    toks = r["prompt_tokens"] + r["new_tokens"]
    lines = [
        f"scale on {r['device']} ({r['threads']} CPU threads), bf16, {r['prompts']} builtin prompts x "
        f"{r['max_new_tokens']} new tokens "
        f"({r['prompt_tokens']} prompt + {r['new_tokens']} new tokens), linear attention: {r['kernel']}; references "
        f"engine: {r['engine']}",
        f"  drafter: drafter=init, 5 layers, {r.get('drafter', '-')}",
    ]
    rows = [
        ("prepare (drafter read, target inspected, prompts)", t.get("prepare"), ""),
        ("load target", t.get("load_target"), ""),
        (
            f"load drafter (drafter=init: random init of {r['drafter_params'] / 1e9:.2f}B parameters)",
            t.get("load_drafter"),
            "",
        ),
        (
            "references, first use in the process",
            t.get("references"),
            f"{r['new_tokens'] / (t['references'] - (t.get('references_setup') or 0.0)):.1f} new tok/s after set-up",
        ),
        ("  of which engine set-up", t.get("references_setup"), ""),
        *steady_rows(r, "references"),
        ("features, first use in the process", t.get("features"), f"{toks / t['features']:.1f} tok/s"),
        *steady_rows(r, "features"),
        ("replay", t.get("replay"), f"{r['new_tokens'] / t['replay']:.1f} tok/s"),
        ("drafter=init built again (its own cost)", r["drafter_init_s"], ""),
        ("drafter loaded from a saved HF folder (a checkpoint's load)", r["drafter_hf_s"], ""),
        ("the whole pipeline.run", r["wall"], ""),
    ]
    lines += [f"  {name:<62} {'-' if v is None else f'{v:8.2f} s'}  {extra}" for name, v, extra in rows]
    lines += against_floors(r)
    lines += memory_rows(r)
    ratio = pt["replay"] / pt["features"]
    lines.append(
        f"  replay per token / feature pass per token{' (steady)' if _steady(r) else ''}: {pt['replay'] * 1e3:.2f} / "
        f"{pt['features'] * 1e3:.2f} ms = {ratio:.2f}x (target <= 0.5x); τ {r['tau']:.3f} (random drafter)"
    )
    lines += per_token_floors(r, pt)
    lines += threads_rows(r, pt)
    modes = r.get("replay_modes", {})
    for mode, sec in modes.items():
        lines.append(
            f"  replay again, {mode}: {sec:.2f} s = {sec / r['new_tokens'] / pt['features']:.2f}x the feature pass per "
            f"token"
        )
    lines += projected_replay(modes, r["new_tokens"], r["tau"], pt["features"], r.get("block_size", 16))
    lines.append(
        f"  drafter load from a file: {r['drafter_hf_s']:.2f} s (target <= 2 s; its sha256 in a thread beside it, "
        f"+{r.get('drafter_digest_wait_s', 0):.2f} s if awaited at once); drafter=init: {r['drafter_init_s']:.2f} s"
    )
    ref_s = pt["references"] * PROTOCOL_TOKENS * PROTOCOL_PROMPTS
    feat_s = pt["features"] * (r["prompt_tokens"] / r["prompts"] + PROTOCOL_TOKENS) * PROTOCOL_PROMPTS
    rep_s = pt["replay"] * PROTOCOL_TOKENS * PROTOCOL_PROMPTS
    once = _first_use(r)
    first = (
        t.get("load_target", 0) + ref_s + (t.get("references_setup") or 0) + feat_s + rep_s + r["drafter_hf_s"] + once
    )
    lines.append(
        f"  projected, one data set of the field's protocol ({PROTOCOL_PROMPTS} prompts x {PROTOCOL_TOKENS} new "
        f"tokens, the per-token "
        f"costs above{', steady,' if _steady(r) else ''} at this run's batch and lengths): references {ref_s / 60:.1f} "
        f"min, "
        f"features {feat_s / 60:.1f} min, replay {rep_s / 60:.1f} min; first checkpoint {first / 3600:.2f} h (first "
        f"use's "
        f"{once:.0f} s once included), each further checkpoint (references and features cached) "
        f"{(rep_s + r['drafter_hf_s']) / 60:.1f} min"
    )
    for x in r.get("engine_rates", []):
        step_ms = x["seconds"] * 1e3 / max(1, r["max_new_tokens"])
        lines.append(
            f"  engine {x['method']:<16} batch {x['batch']}: set-up {x['setup_s']:.1f} s, {step_ms:.2f} ms per step "
            f"({x['tokens']} tokens in {x['seconds']:.2f} s)"
        )
    rates = {x["method"]: x for x in r.get("engine_rates", [])}
    if {"engine", "engine+inductor"} <= set(rates):
        a, b = rates["engine"], rates["engine+inductor"]
        save = (a["seconds"] - b["seconds"]) / max(
            1, r["max_new_tokens"]
        )  # per step (the timed run: max_new_tokens steps at most)
        extra = b["setup_s"] - a["setup_s"]
        lines.append(
            f"  compile break-even: {extra:.1f} s more set-up / {save * 1e3:.2f} ms saved per step = "
            + (f"{extra / save:.0f} decode steps" if save > 0 else "never (no saving per step)")
        )
    return lines


def memory_rows(r: dict[str, Any]) -> list[str]:
    """Peak memory against the weights' bytes (the target's safetensors + the drafter's parameters in bf16)."""
    target, drafter = r.get("weight_bytes"), 2 * r.get("drafter_params", 0)
    if not target:
        return [f"  peak RSS {r['peak_rss'] / 1e9:.1f} GB"]
    w = target + drafter
    line = (
        f"  peak RSS {r['peak_rss'] / 1e9:.1f} GB = {r['peak_rss'] / w:.2f}x the weights' {w / 1e9:.1f} GB (target "
        f"{target / 1e9:.1f} GB + drafter {drafter / 1e9:.2f} GB in bf16)"
    )
    if r.get("peak_cuda"):
        line += f"; peak CUDA memory allocated {r['peak_cuda'] / 1e9:.1f} GB = {r['peak_cuda'] / w:.2f}x the weights"
    return [line]


def per_token_floors(r: dict[str, Any], pt: dict[str, float]) -> list[str]:
    """Features and replay per token, each beside this device's matrix-product floor measured in the same run: the
    feature pass's linear layers (floors.forward_flops), the replay's products counted over one run of its default
    mode (floors.counted_flops), both at the GEMM rate measured here."""
    f, s = r.get("floors"), r.get("steady")
    if f is None or s is None or not r.get("replay_flops"):
        return []
    rate = f["gemm_tflops"] * 1e12
    feat_floor = f["arithmetic_s"] / s["feature_tokens"]
    rep_floor = r["replay_flops"] / rate / r["new_tokens"]
    gflop = r["replay_flops"] / r["new_tokens"] / 1e9
    fx, rx = pt["features"] / feat_floor, pt["replay"] / rep_floor
    return [
        f"  per token, steady, beside the matrix-product floor on {r['device']}: "
        f"features {pt['features'] * 1e3:.3f} ms (floor {feat_floor * 1e3:.3f} ms: {fx:.1f}x), "
        f"replay {pt['replay'] * 1e3:.3f} ms (floor {rep_floor * 1e3:.3f} ms: {rx:.1f}x; "
        f"{gflop:.1f} GFLOP a token, counted over a run); at the floors the replay is "
        f"{rep_floor / feat_floor:.2f}x the features"
    ]


THREADS_PROJECTED = 90  # the core count the thread-scaling row projects to (a user's CPU box)


def threads_rows(r: dict[str, Any], pt: dict[str, float]) -> list[str]:
    """The features and the replay at half the run's threads against all of them, and each projected to
    THREADS_PROJECTED threads by t(n) = serial + parallel / n through the two points."""
    h, s = r.get("half_threads"), _steady(r)
    if h is None or s is None:
        return []
    n, n2 = r["threads"], h["threads"]
    toks = r["prompt_tokens"] + r["new_tokens"]
    proj = {
        k: amdahl(n2, h[k], n, full, THREADS_PROJECTED) / tok
        for k, full, tok in (("features", s["features"], toks), ("replay", s["replay"], r["new_tokens"]))
    }
    fs, rs = h["features"] / s["features"], h["replay"] / s["replay"]
    return [
        f"  threads {n2} vs {n}: features {h['features']:.2f} vs {s['features']:.2f} s ({fs:.2f}x speed-up), "
        f"replay {h['replay']:.2f} vs {s['replay']:.2f} s ({rs:.2f}x); projected at {THREADS_PROJECTED} threads "
        f"(t = serial + parallel / n through the two): features {proj['features'] * 1e3:.3f} ms, "
        f"replay {proj['replay'] * 1e3:.3f} ms per token ({proj['replay'] / proj['features']:.2f}x)"
    ]


def report(
    shape: str,
    cache_dir: str,
    tokenizer: Any,
    devices: list[str],
    sizes: dict[str, tuple[int, int]],
    engine: bool,
    overrides: list[str],
    drafter: str = "dflash",
    profile: bool = False,
) -> str:
    folder = build_vl(shape, Path(cache_dir, "bench", shape), tokenizer)  # freed before any child starts
    overrides = [*DRAFTERS[drafter], *overrides]
    results = []
    with tempfile.TemporaryDirectory(prefix="dflash-scale-cache-") as cache:
        for dev in devices:
            n, m = sizes[dev]
            results.append(
                _child(
                    dict(
                        folder=str(folder),
                        device=dev,
                        prompts=n,
                        max_new_tokens=m,
                        cache_dir=cache,
                        engine=engine,
                        overrides=overrides,
                        profile=profile,
                    )
                )
            )
            shutil.rmtree(Path(cache, "features"), ignore_errors=True)
    lines = [
        f"scale: random {shape} VL checkpoint at {folder} "
        f"({sum(p.stat().st_size for p in folder.glob('*.safetensors')) / 1e9:.1f} GB)"
    ]
    for r in results:
        lines += format_device(r)
    lines.append("raw: " + json.dumps(results))
    return "\n".join(lines)
