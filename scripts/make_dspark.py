"""Write a small DSpark drafter folder for SmolLM2-135M: the shipped default's backbone plus random heads.

    python scripts/make_dspark.py OUT [--head vanilla|gated|rnn] [--rank 64] [--gamma 15] [--anchor]
                                      [--layout sglang|specforge] [--no-confidence] [--seed 0]

The backbone (fc, hidden_norm, layers with their block convolutions, norm) is checkpoints/fixed-l4-dflash2-warm's,
trained in DFlash's slot convention (block 16: the anchor row, 15 proposals); its candidate selector is left out (a
DSpark drafter has none) and its Markov and confidence heads are random (a fixed seed): its τ shows what the
evaluator reads, not a trained DSpark. By default it is saved as it was trained: `sample_from_anchor: false`,
gamma 15 (`dspark_block_size`) and the model's block 16 (`dflash_config.block_size`, the convolutions' index), so
that SGLang runs 16 rows per request; `--anchor` saves the same weights with `sample_from_anchor: true`: the
convention trap, which the evaluation's convention check names. `--layout specforge` puts the head keys where
`specforge export --to hf` does (in dflash_config, which SGLang 0.5.23 does not build).

Evaluate it: python evaluate.py drafter=hf drafter.path=OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "checkpoints" / "fixed-l4-dflash2-warm" / "step_5000"
BACKBONE = ("fc.", "hidden_norm.", "layers.", "norm.")  # the block convolutions (layers.*_conv) included


def heads(kind: str, vocab: int, hidden: int, rank: int, confidence: bool, seed: int) -> dict[str, torch.Tensor]:
    """Random Markov (and confidence) head tensors, SGLang's names; scaled so that the bias moves the drafts."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, std: torch.randn(*s, generator=g) * std  # noqa: E731
    sd = {
        "markov_head.markov_w1.weight": rnd(vocab, rank, std=1.0),
        "markov_head.markov_w2.weight": rnd(vocab, rank, std=0.02),
    }
    if kind == "gated":
        sd |= {
            "markov_head.gate_proj.weight": rnd(rank, hidden + rank, std=0.05),
            "markov_head.gate_proj.bias": rnd(rank, std=0.5),
        }
    if kind == "rnn":
        sd |= {
            "markov_head.joint_proj.weight": rnd(3 * rank, 2 * rank + hidden, std=0.05),
            "markov_head.joint_proj.bias": rnd(3 * rank, std=0.5),
        }
    if confidence:
        sd |= {
            "confidence_head.proj.weight": rnd(1, hidden + rank, std=0.05),
            "confidence_head.proj.bias": torch.tensor([1.0]),
        }
    return sd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--head", default="gated", choices=["vanilla", "gated", "rnn"])
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=15, help="proposals per step (SGLang's DSpark block size)")
    ap.add_argument("--anchor", action="store_true", help="save with sample_from_anchor: true (the trap)")
    ap.add_argument("--layout", default="sglang", choices=["sglang", "specforge"])
    ap.add_argument("--no-confidence", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    base = json.loads((DEFAULT / "config.json").read_text())
    sd = {k: v for k, v in load_file(str(DEFAULT / "model.safetensors")).items() if k.startswith(BACKBONE)}
    H, V = base["hidden_size"], base["vocab_size"]
    sd |= heads(a.head, V, H, a.rank, not a.no_confidence, a.seed)
    cfg = {k: v for k, v in base.items() if k not in ("dflash_config", "architectures", "block_size")}
    keep = ("mask_token_id", "target_layer_ids", "conv_kernel_size", "conv_group_size")
    dc = {k: v for k, v in base["dflash_config"].items() if k in keep}
    dc["block_size"] = base["dflash_config"]["block_size"]  # the convolutions' block: the 16 rows it was trained on
    head_keys = {
        "markov_rank": a.rank,
        "markov_head_type": a.head,
        "enable_confidence_head": not a.no_confidence,
        "confidence_head_with_markov": True,
    }
    if a.layout == "sglang":  # every DSpark key at the top level, the convention explicit
        cfg |= {"architectures": ["Qwen3DSparkModel"], "dspark_block_size": a.gamma, "sample_from_anchor": a.anchor}
        cfg |= head_keys
        cfg["dflash_config"] = dc
    else:  # SpecForge's export: DSparkDraftModel, block_size at the top, the heads' keys in dflash_config
        cfg |= {"architectures": ["DSparkDraftModel"], "dspark_block_size": a.gamma, "sample_from_anchor": a.anchor}
        cfg["dflash_config"] = {**dc, **head_keys, "projector_type": "dspark", "attention_mode": "gqa"}
    a.out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}, str(a.out / "model.safetensors"))
    (a.out / "config.json").write_text(json.dumps(cfg, indent=2))
    print(
        f"wrote {a.out} ({a.layout} layout, {a.head} head rank {a.rank}, gamma {a.gamma}, "
        f"sample_from_anchor={a.anchor})"
    )


if __name__ == "__main__":
    main()
