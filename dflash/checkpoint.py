"""Drafter checkpoints: find, load, check against the target, save (DFLASH.md §5).

Kinds:
- `training`: `<run_dir>/step_<N>/checkpoint.pt`, a torch pickle with the weights under a key
  such as `model`, plus optimizer state, step and config. Loaded with `weights_only=True` and
  `mmap=True`; `module.` / `_orig_mod.` prefixes stripped; optimizer state never touched.
  A `step_<N>/` folder holding the HF format (config.json + safetensors) is accepted too.
- `hf`: a public HF-format folder (config.json + model.safetensors).
- `init`: deterministic random weights with the target's shapes (smoke runs, training start).

Block size, taps and mask id come from the checkpoint's config; the `overrides` dict only fills
what a checkpoint lacks. `check_against_target` runs before any work.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash.drafter import DFlashDrafter, DrafterConfig, build_target_layer_ids
from dflash.references import atomic_write_text
from dflash.target import Target, sha256_file

WEIGHT_KEYS = ("model", "state_dict", "model_state_dict", "drafter", "module")
PREFIXES = ("module.", "_orig_mod.")


from dflash.errors import CheckpointError


@dataclass
class LoadedDrafter:
    model: DFlashDrafter
    name: str  # for run names: "<drafter>@step_<N>"
    step: int | None
    path: str | None
    sha256: str | None
    warnings: list[str] = field(default_factory=list)


def list_steps(run_dir: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in run_dir.glob("step_*") if (m := re.fullmatch(r"step_(\d+)", p.name)))


PROJECT_ROOT = Path(__file__).resolve().parents[1]


def find_path(p: str | Path) -> Path:
    """A relative path is looked up in the working directory, then in the project root (so the
    shipped `checkpoints/...` work from anywhere)."""
    path = Path(p).expanduser()
    if not path.is_absolute() and not path.exists() and (PROJECT_ROOT / path).exists():
        return PROJECT_ROOT / path
    return path


def resolve_step(run_dir: str | Path, step: int | None) -> tuple[Path, int]:
    """-> (file or folder of that step, step). step=None takes the latest."""
    run = find_path(run_dir)
    if not run.is_dir():
        raise CheckpointError(f"drafter.run_dir={run} does not exist; point it at a training run folder holding step_<N>/ folders")
    steps = list_steps(run)
    if not steps:
        raise CheckpointError(f"{run} holds no step_<N>/ folders; is drafter.run_dir right?")
    if step is None:
        step = steps[-1]
    d = run / f"step_{step}"
    if step not in steps:
        raise CheckpointError(f"no checkpoint for step {step} in {run}; steps that exist: {', '.join(map(str, steps))}")
    if (d / "checkpoint.pt").is_file():
        return d / "checkpoint.pt", step
    if (d / "config.json").is_file():
        return d, step
    raise CheckpointError(f"{d} holds neither checkpoint.pt nor config.json + safetensors")


def strip_prefixes(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        changed = True
        while changed:
            changed = False
            for p in PREFIXES:
                if k.startswith(p):
                    k, changed = k[len(p) :], True
        out[k] = v
    return out


def read_training_pickle(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated, not a zip, unpickling refused...
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {str(e)[:200]}. The file is corrupt or not a torch checkpoint") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a dict checkpoint, got {type(obj).__name__}")
    sd = next((obj[k] for k in WEIGHT_KEYS if isinstance(obj.get(k), dict)), None)
    if sd is None and all(isinstance(v, torch.Tensor) for v in obj.values()):
        sd = obj  # a bare state dict
    if sd is None:
        raise CheckpointError(f"{path}: no weights found under any of {WEIGHT_KEYS}; keys are {sorted(obj)[:10]}")
    cfg = obj.get("config") or obj.get("drafter_config") or {}
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: 'config' should be a dict, got {type(cfg).__name__}")
    cfg = cfg.get("drafter", cfg) if isinstance(cfg.get("drafter"), dict) else cfg
    return strip_prefixes(sd), cfg


def read_hf_folder(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file

    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{folder} has no config.json; a public DFlash drafter folder needs config.json + model.safetensors")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no .safetensors weights")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(str(f)))
        except Exception as e:
            raise CheckpointError(f"cannot read {f}: {type(e).__name__}: {str(e)[:200]}. The file is corrupt") from None
    return strip_prefixes(sd), cfg


def init_config(target: Target, num_layers: int, num_taps: int, mask_token_id: int, block_size: int, target_layer_ids: list[int] | None = None) -> DrafterConfig:
    """A drafter shaped like the target's layers (Qwen3-style), taps by the public default."""
    c = target.config
    heads = int(c.num_attention_heads)
    rope = getattr(c, "rope_parameters", None) or {}
    return DrafterConfig(
        hidden_size=int(c.hidden_size),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(c, "num_key_value_heads", heads) or heads),
        head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
        intermediate_size=int(c.intermediate_size),
        num_target_layers=int(c.num_hidden_layers),
        target_layer_ids=list(target_layer_ids) if target_layer_ids else build_target_layer_ids(int(c.num_hidden_layers), num_taps),
        mask_token_id=mask_token_id,
        block_size=block_size,
        rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 1e6) or 1e6)),
    )


def check_against_target(cfg: DrafterConfig, target: Target) -> list[str]:
    """Raise CheckpointError on what cannot work; return warnings for what is suspicious."""
    errs = []
    if cfg.hidden_size != target.hidden_size:
        errs.append(f"hidden size {cfg.hidden_size} != the target's {target.hidden_size}: this drafter was trained for another target")
    bad = [L for L in cfg.target_layer_ids if not 0 <= L < target.num_layers]
    if bad:
        errs.append(f"taps {bad} are outside the target's decoder layers 0..{target.num_layers - 1}")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        errs.append(f"mask_token_id {cfg.mask_token_id} is not a row of the target's embedding (vocab {target.vocab_size})")
    if cfg.block_size < 2:
        errs.append(f"block_size {cfg.block_size} must be at least 2")
    if errs:
        raise CheckpointError("drafter does not fit the target: " + "; ".join(errs))
    warns = []
    if target.num_layers - 1 in cfg.target_layer_ids:
        warns.append(
            f"taps {cfg.target_layer_ids} include the target's final layer {target.num_layers - 1}: its state at a position "
            "encodes the next token, a training shortcut inference never offers (DFLASH.md §4 bug 2); expect poor real acceptance"
        )
    if cfg.num_target_layers != target.num_layers:
        warns.append(f"checkpoint was made for a {cfg.num_target_layers}-layer target, this one has {target.num_layers}")
    return warns


def build(cfg: DrafterConfig, sd: dict[str, torch.Tensor] | None, where: str) -> DFlashDrafter:
    model = DFlashDrafter(cfg)
    if sd is None:
        return model
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))  # extra keys (e.g. embed/lm_head copies some trainers keep) are ignored
    shapes = [f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}" for k in own if k in sd and sd[k].shape != own[k].shape]
    if missing or shapes:
        raise CheckpointError(
            f"{where}: weights do not fit the drafter its config describes"
            + (f"; missing {missing[:6]}" if missing else "")
            + (f"; shape mismatch {shapes[:4]}" if shapes else "")
        )
    model.load_state_dict({k: sd[k] for k in own}, strict=True)
    return model


def load_drafter(
    target: Target,
    kind: str,
    name: str,
    run_dir: str | None = None,
    step: int | None = None,
    path: str | None = None,
    overrides: dict[str, Any] | None = None,
    init: dict[str, Any] | None = None,
) -> LoadedDrafter:
    overrides = dict(overrides or {})
    if kind == "init":
        init = init or {}
        cfg = init_config(
            target, int(init.get("num_layers", 1)), int(init.get("num_taps", 5)),
            int(overrides.get("mask_token_id") if overrides.get("mask_token_id") is not None else init["mask_token_id"]),
            int(overrides.get("block_size") or 16), overrides.get("target_layer_ids"),
        )
        warns = check_against_target(cfg, target)
        return LoadedDrafter(DFlashDrafter(cfg).init_weights(int(init.get("seed", 0))), name, None, None, None, warns)
    if kind == "training":
        if not run_dir:
            raise CheckpointError("drafter=training needs drafter.run_dir=/path/to/run (holding step_<N>/ folders)")
        where, step = resolve_step(run_dir, step)
    elif kind == "hf":
        if not path:
            raise CheckpointError("drafter=hf needs drafter.path=/path/to/folder (config.json + model.safetensors)")
        where = find_path(path)
        if not where.is_dir():
            raise CheckpointError(f"drafter.path={where} is not a folder")
    else:
        raise CheckpointError(f"unknown drafter kind {kind!r}; use training, hf or init")
    sd, raw_cfg = read_training_pickle(where) if where.is_file() else read_hf_folder(where)
    try:
        cfg = DrafterConfig.from_hf(raw_cfg, overrides)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{where}: {e}") from None
    warns = check_against_target(cfg, target)
    model = build(cfg, sd, str(where))
    digest_src = where if where.is_file() else next(iter(sorted(where.glob("*.safetensors"))))
    return LoadedDrafter(model, name, step, str(where), sha256_file(digest_src), warns)


# --- saving (the trainer writes what the loader reads) ----------------------------------------


def save_hf_folder(model: DFlashDrafter, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """config.json + model.safetensors, written to a temp folder and renamed."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    sd = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(tmp / "model.safetensors"))
    atomic_write_text(tmp / "config.json", json.dumps(model.cfg.to_hf(), indent=2))
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    os.rename(tmp, folder)


def save_training_checkpoint(path: str | Path, model: DFlashDrafter, optimizer: Any, step: int, extra: dict[str, Any] | None = None) -> None:
    """`<run_dir>/step_<N>/checkpoint.pt`: weights, optimizer state, step, drafter config; atomic."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="checkpoint.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict() if optimizer else None, "step": step, "config": model.cfg.to_hf(), **(extra or {})},
            tmp,
        )
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
