"""Drafter load time at Qwen3.6-27B width, measured in one run: the old build (torch's default init, then the
weights loaded) against build_drafter (meta device, the weights assigned), and drafter=init both ways; then a
checkpoint read from an HF folder to the device as the pipeline reads it (read_drafter: the finite check by one
min/max reduction per tensor, the sha256 in a thread; build_drafter) against the same with the checks as they
were (isfinite().all() per tensor, the sha256 read before the build).

    python scripts/drafter_load_bench.py [num_layers] [device]     # 1 layer, cpu by default; a public 27B drafter has 5
"""

import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from dflash.models.drafter.checkpoint import build_drafter, read_drafter
from dflash.models.drafter.config import DrafterConfig
from dflash.models.drafter.files import read_hf_folder, save_hf_folder
from dflash.models.drafter.model import DFlashDrafter
from dflash.models.target.weights import sha256_file

SHAPE = dict(
    hidden_size=5120,
    intermediate_size=17408,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    block_size=16,
    mask_token_id=0,
    num_target_layers=64,
    rms_norm_eps=1e-6,
    max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7},
)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def from_file(model: DFlashDrafter, device: str) -> None:
    """A checkpoint folder read to `device`, now and with the checks as they were, in one run (best of 2 each)."""
    with tempfile.TemporaryDirectory(prefix="dflash-load-") as tmp:
        folder = Path(tmp) / "drafter"
        save_hf_folder(model, folder)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9
        read_drafter("hf", "x", path=str(folder))  # imports and the page cache warm for both

        def now() -> float:
            t = time.perf_counter()
            src = read_drafter("hf", "x", path=str(folder))
            build_drafter(src, device=device, dtype=torch.bfloat16)
            sync(device)
            load = time.perf_counter() - t
            src.digest.result()
            return load

        def before() -> float:
            t = time.perf_counter()
            sd, _ = read_hf_folder(folder)
            assert all(bool(torch.isfinite(v).all()) for v in sd.values())
            sha256_file(next(folder.glob("*.safetensors")))
            src = read_drafter(
                "hf", "x", path=str(folder)
            )  # its own checks are today's: ~0.1 s (its digest thread not awaited)
            build_drafter(src, device=device, dtype=torch.bfloat16)
            sync(device)
            return time.perf_counter() - t

        t_now, t_before = min(now() for _ in range(2)), min(before() for _ in range(2))
        print(
            f"  from an HF folder ({size:.2f} GB) to {device}: {t_now:.2f} s now (its sha256 in a thread), "
            f"{t_before:.2f} s with "
            f"isfinite().all() and the sha256 first ({t_before / t_now:.1f}x)"
        )


def main(layers: int = 1, device: str = "cpu") -> None:
    names = {f.name for f in dataclasses.fields(DrafterConfig)}
    taps = [1 + 15 * i for i in range(layers)]
    shape = {**SHAPE, "num_hidden_layers": layers, "target_layer_ids": taps, "layer_types": ["full_attention"] * layers}
    cfg = DrafterConfig(**{k: v for k, v in shape.items() if k in names})
    with torch.device("meta"):
        sd = {k: v for k, v in DFlashDrafter(cfg).state_dict().items()}
    sd = {k: torch.randn(v.shape, dtype=torch.bfloat16) for k, v in sd.items()}  # as a bf16 checkpoint holds them
    src = SimpleNamespace(config=cfg, state_dict=sd, init={}, name="x", step=0, path=None, digest=None, warnings=[])

    def old_build():
        m = DFlashDrafter(cfg)
        m.load_state_dict(sd)
        return m.to(torch.bfloat16)

    new, t_new = timed(lambda: build_drafter(src, dtype=torch.bfloat16))
    _, t_old = timed(old_build)
    _, t_init_old = timed(lambda: DFlashDrafter(cfg).init_weights(0).to(torch.bfloat16))
    _, t_init_new = timed(
        lambda: build_drafter(SimpleNamespace(**{**vars(src), "state_dict": None}), dtype=torch.bfloat16)
    )
    n = sum(p.numel() for p in new.model.parameters()) / 1e6
    print(
        f"{layers} draft layer(s) at Qwen3.6-27B width ({n:.0f}M params), bf16, {torch.get_num_threads()} CPU threads:"
    )
    print(
        f"  file-loaded: old build {t_old:.2f} s, build_drafter {t_new:.3f} s ({t_old / max(t_new, 1e-6):.0f}x faster)"
    )
    print(f"  drafter=init: old {t_init_old:.2f} s, now {t_init_new:.2f} s ({t_init_old / t_init_new:.2f}x)")
    from_file(new.model.to(torch.bfloat16), device)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1, sys.argv[2] if len(sys.argv) > 2 else "cpu")
