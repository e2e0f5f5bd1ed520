"""Engine and online-loop speed on one CUDA GPU, without the config stack (no hydra, mlflow, gguf).

    PYTHONPATH=. python scripts/gpu_decode_bench.py [--budget-s 400] [--out DIR]

Target: random weights of SmolLM2-135M's shape (LlamaConfig: hidden 576, 30 layers, 9 heads, 3 KV
heads, intermediate 1536, vocab 49152, tied embeddings), bfloat16. Drafter: the shipped weights
(checkpoints/fixed/step_5037; on a random target τ is ~1, so the speed at τ 1.8 is predicted from
the measured time per step, see dflash/bench/speed.py). Prompts: random token ids, 20..120 long.
First checks (float32, tiny random Qwen3 and Qwen3.5 hybrid): engine with CUDA graphs == eager ==
transformers' generate; the online loop == greedy. Then the benchmarks, most important first,
each skipped once the time budget is spent. Everything lands in OUT/decode_bench.json as it comes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from dflash.bench.speed import bench_generation, bench_online, format_generation, format_online  # noqa: E402
from dflash.models.drafter.model import DFlashDrafter, DrafterConfig  # noqa: E402
from dflash.models.engine.generator import generate  # noqa: E402
from dflash.models.target.model import Target  # noqa: E402
from dflash.online.speculative import speculative_generate  # noqa: E402
from dflash.util.progress import configure  # noqa: E402

RESULTS: dict = {}


def save(out: Path) -> None:
    tmp = out / "decode_bench.json.tmp"
    tmp.write_text(json.dumps(RESULTS, indent=1, default=str))
    os.replace(tmp, out / "decode_bench.json")


def as_target(model, name: str) -> Target:
    model = model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=None, identity=name, source=name, max_context=1 << 20)


def smollm2_shaped(device: str) -> Target:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if device == "cuda" else torch.float32)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 2
    return as_target(model, "random-smollm2-shape")


def shipped_drafter(target: Target) -> DFlashDrafter:
    from safetensors.torch import load_file

    folder = ROOT / "checkpoints" / "fixed" / "step_5037"
    cfg = DrafterConfig.from_hf(json.loads((folder / "config.json").read_text()))
    d = DFlashDrafter(cfg)
    d.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    return d.to(target.device, target.dtype).eval().requires_grad_(False)


def checks(dev: str) -> dict:
    """float32, tiny random models: graphs == eager == HF generate; online loop == greedy."""
    from conftest import MASK_ID, make_tokenizer, qwen3_5_vl_config, qwen3_config
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3ForCausalLM

    from dflash.models.drafter.checkpoint import init_config
    from dflash.models.target.model import load_target

    res = {}
    prompts = [[5, 9, 11, 4], [7, 3], [12, 8, 6, 10, 9, 5, 4], [20, 21, 22], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        Qwen3ForCausalLM(qwen3_config()).save_pretrained(d)
        make_tokenizer().save_pretrained(d)
        t = load_target("hf", d, dtype="float32", device=dev)
        eos = t.eos_ids
        hf = []
        for p in prompts:
            o = t.model.generate(
                torch.tensor([p], device=dev), max_new_tokens=48, do_sample=False, eos_token_id=eos, pad_token_id=0
            )[0, len(p) :].tolist()
            hf.append(o[: next((i + 1 for i, x in enumerate(o) if x in eos), len(o))])
        cuda = dev == "cuda"
        g = generate(t, prompts, 48, 3, graphs=cuda)
        e = generate(t, prompts, 48, 3, graphs=False)
        gc = generate(t, prompts, 48, 3, graphs=cuda, compile=True)
        res["qwen3_fp32_graphs_eq_eager"] = g == e
        res["qwen3_fp32_graphs_eq_hf"] = g == hf
        res["qwen3_fp32_compiled_eq_hf"] = gc == hf
        dr = DFlashDrafter(init_config(t, 1, 3, MASK_ID, 8)).init_weights(3, std=0.3).to(dev).eval()
        for comp in (False, True):
            out = speculative_generate(t, dr, prompts[2], 48, compile=comp)
            res[f"qwen3_fp32_online_compile={comp}_eq_hf"] = out.tokens == hf[2]
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(1)
        Qwen3_5ForConditionalGeneration(qwen3_5_vl_config()).save_pretrained(d)
        make_tokenizer().save_pretrained(d)
        v = load_target("vlm_text", d, dtype="float32", device=dev)
        ref = v.model.generate(
            torch.tensor([prompts[2]], device=dev),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=v.eos_ids,
            pad_token_id=0,
        )[0, len(prompts[2]) :].tolist()
        dr = DFlashDrafter(init_config(v, 1, 3, MASK_ID, 8)).init_weights(3, std=0.3).to(dev).eval()
        for graphs in (False, True) if dev == "cuda" else (False,):
            try:
                out = speculative_generate(v, dr, prompts[2], 24, graphs=graphs)
                res[f"qwen3_5_hybrid_online_graphs={graphs}_eq_hf"] = (
                    out.tokens == ref[: len(out.tokens)] and len(out.tokens) > 0
                )
            except Exception as e:  # noqa: BLE001
                res[f"qwen3_5_hybrid_online_graphs={graphs}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script's logic")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    configure(True)
    t_start = time.perf_counter()
    RESULTS["machine"] = {
        "gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    import transformers

    RESULTS["machine"]["transformers"] = transformers.__version__

    def section(name: str, cost_s: float, fn):
        left = a.budget_s - (time.perf_counter() - t_start)
        if left < cost_s:
            RESULTS[name] = f"skipped: {left:.0f} s left of the budget, needs ~{cost_s:.0f}"
            print(f"== {name}: skipped ({left:.0f} s left)", flush=True)
            save(out)
            return
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            RESULTS[name] = fn()
        except Exception as e:  # noqa: BLE001
            RESULTS[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            print(traceback.format_exc()[-3000:], flush=True)
        RESULTS.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 1)
        save(out)

    section("checks", 60, lambda: checks(a.device))
    target = smollm2_shaped(a.device)
    drafter = shipped_drafter(target)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, 49000, (int(n),), generator=g).tolist() for n in torch.randint(20, 121, (12,), generator=g)
    ]
    N = a.new

    def online(compile: bool, hf_static: bool):
        def run():
            o = bench_online(target, drafter, prompts[:4], N, compile=compile, hf_static=hf_static)
            print(format_online(o), flush=True)
            return dataclasses.asdict(o) | {"predicted_tok_s": {t: o.predicted_tok_s(t) for t in (1.8, 3.0)}}

        return run

    def gen(batch: int, n_prompts: int, compile: bool | None, hf: bool = True):
        def run():
            r = bench_generation(target, prompts[:n_prompts], N, batches=(batch,), compile=compile, hf=hf)
            print(format_generation(r), flush=True)
            return dataclasses.asdict(r) | {"tok_s": {f"{x.method}@{x.batch}": x.tok_s for x in r.rates}}

        return run

    section("online_graphs", 90, online(False, True))
    section("online_graphs_inductor", 120, online(True, False))
    section("generation_b1", 60, gen(1, 4, None))
    section("generation_b12", 90, gen(12, 12, None))
    RESULTS["total_s"] = round(time.perf_counter() - t_start, 1)
    save(out)
    print(f"== done in {RESULTS['total_s']} s", flush=True)


if __name__ == "__main__":
    main()
