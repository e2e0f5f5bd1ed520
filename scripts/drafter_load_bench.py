"""Drafter build time at Qwen3.6-27B width, measured in one run: the old build (torch's default init, then the
weights loaded) against build_drafter (meta device, the weights assigned), and drafter=init both ways.

    python scripts/drafter_load_bench.py [num_layers]     # 1 by default; a public 27B drafter has 5
"""

import dataclasses
import sys
import time
from types import SimpleNamespace

import torch

from dflash.models.checkpoint import build_drafter
from dflash.models.drafter import DFlashDrafter
from dflash.models.drafter_config import DrafterConfig

SHAPE = dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4, head_dim=256, block_size=16,
             mask_token_id=0, num_target_layers=64, rms_norm_eps=1e-6, max_position_embeddings=262144,
             rope_parameters={"rope_type": "default", "rope_theta": 1e7})


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main(layers: int = 1) -> None:
    names = {f.name for f in dataclasses.fields(DrafterConfig)}
    taps = [1 + 15 * i for i in range(layers)]
    shape = {**SHAPE, "num_hidden_layers": layers, "target_layer_ids": taps, "layer_types": ["full_attention"] * layers}
    cfg = DrafterConfig(**{k: v for k, v in shape.items() if k in names})
    with torch.device("meta"):
        sd = {k: v for k, v in DFlashDrafter(cfg).state_dict().items()}
    sd = {k: torch.randn(v.shape, dtype=torch.bfloat16) for k, v in sd.items()}  # as a bf16 checkpoint holds them
    src = SimpleNamespace(config=cfg, state_dict=sd, init={}, name="x", step=0, path=None, sha256=None, warnings=[])

    def old_build():
        m = DFlashDrafter(cfg)
        m.load_state_dict(sd)
        return m.to(torch.bfloat16)

    new, t_new = timed(lambda: build_drafter(src, dtype=torch.bfloat16))
    _, t_old = timed(old_build)
    _, t_init_old = timed(lambda: DFlashDrafter(cfg).init_weights(0).to(torch.bfloat16))
    _, t_init_new = timed(lambda: build_drafter(SimpleNamespace(**{**vars(src), "state_dict": None}), dtype=torch.bfloat16))
    n = sum(p.numel() for p in new.model.parameters()) / 1e6
    print(f"{layers} draft layer(s) at Qwen3.6-27B width ({n:.0f}M params), bf16, {torch.get_num_threads()} CPU threads:")
    print(f"  file-loaded: old build {t_old:.2f} s, build_drafter {t_new:.3f} s ({t_old / max(t_new, 1e-6):.0f}x faster)")
    print(f"  drafter=init: old {t_init_old:.2f} s, now {t_init_new:.2f} s ({t_init_old / t_init_new:.2f}x)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
