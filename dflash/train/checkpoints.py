"""A variant's run state on disk: resumable checkpoints and weights-only exports.

- `<out_dir>/<variant>/step_<N>/checkpoint.pt`: weights, optimizer state, step, drafter config,
  variant, bugs, and the throughput counters (`train_meta`); written atomically by
  dflash.models.drafter.files, read back by the evaluator as kind=training.
- `<export_dir>/<variant>/step_<N>/`: a weights-only bf16 HF folder (what checkpoints/ holds), for
  `export_steps`, the last step and a stop.
A run resumes from the latest checkpoint.pt of its folder: weights, optimizer, step, counters. A
run with none may start warm (`init_from`): the weights of an earlier run's latest export of the
same variant (or of `init_variant`, for every variant), a new optimizer, step 0 of its own schedule.
A DSpark variant may start from a DFlash or DFlash2 export (`backbone_start`): the backbone transfers
(fc, hidden_norm, layers, norm; the block convolutions where both have them, identity where only the
DSpark variant has them), DFlash2's candidate selector is dropped, the Markov and confidence heads keep
their fresh start. The transferred backbone is one slot off: its slot j was trained to predict the token
at anchor + j, where a DSpark row j predicts anchor + j + 1, so it starts as a drafter of the wrong
positions, not of nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.models.drafter.checkpoint import check_weights
from dflash.models.drafter.config import ARCHITECTURES
from dflash.models.drafter.files import list_steps, read_hf_folder, save_hf_folder, save_training_checkpoint
from dflash.models.drafter.model import DFlashDrafter
from dflash.train.variants import Variant
from dflash.util.errors import CheckpointError, ConfigError
from dflash.util.progress import log


@dataclass
class RunState:
    variant: Variant
    model: DFlashDrafter
    opt: torch.optim.Optimizer
    run_dir: Path
    step: int = 0  # steps done
    tokens: int = 0  # labelled slots trained on
    time: float = 0.0  # the variant's own seconds (its steps plus its share of the target passes)


def save_checkpoint(rs: RunState) -> Path:
    path = rs.run_dir / f"step_{rs.step}" / "checkpoint.pt"
    meta = {"tokens": rs.tokens, "time": rs.time}
    save_training_checkpoint(
        path, rs.model, rs.opt, rs.step, {"variant": rs.variant.name, "bugs": vars(rs.variant.bugs), "train_meta": meta}
    )
    return path


def export(rs: RunState, export_dir: str | None) -> Path | None:
    if not export_dir:
        return None
    folder = Path(export_dir) / rs.variant.name / f"step_{rs.step}"
    save_hf_folder(rs.model, folder)
    return folder


def try_resume(rs: RunState, device: torch.device) -> None:
    """Load the latest checkpoint.pt of rs.run_dir into rs, if there is one."""
    steps = [s for s in list_steps(rs.run_dir) if (rs.run_dir / f"step_{s}" / "checkpoint.pt").is_file()]
    if not steps:
        return
    obj = torch.load(rs.run_dir / f"step_{steps[-1]}" / "checkpoint.pt", map_location=device, weights_only=True)
    rs.model.load_state_dict(obj["model"])
    if obj.get("optimizer"):
        rs.opt.load_state_dict(obj["optimizer"])
    rs.step = int(obj["step"])
    meta: dict[str, Any] = obj.get("train_meta") or {}
    rs.tokens, rs.time = int(meta.get("tokens", 0)), float(meta.get("time", 0.0))


def warm_start(rs: RunState, init_from: str, init_variant: str | None = None) -> Path:
    """Load the latest export <init_from>/<variant>/step_<N>/ into rs.model -> that folder; with `init_variant`,
    that variant's export whatever rs's variant is."""
    name = init_variant or rs.variant.name
    root = Path(init_from).expanduser() / name
    steps = [s for s in list_steps(root) if (root / f"step_{s}" / "config.json").is_file()]
    if not steps:
        raise ConfigError(
            f"init_from={init_from}: no export of variant {name} ({root}/step_<N>/config.json); "
            "point init_from at an earlier run's export_dir (and init_variant at a variant it holds), "
            "or drop it to start from random weights"
        )
    folder = root / f"step_{steps[-1]}"
    sd, raw = read_hf_folder(folder)
    arch = ARCHITECTURES.get((raw.get("architectures") or ["DFlashDraftModel"])[0])
    if rs.model.cfg.dspark is not None and arch in ("dflash", "dflash2"):
        backbone_start(rs.model, sd, folder)
        return folder
    try:
        check_weights(
            rs.model.cfg, sd, f"init_from: {folder}"
        )  # every tensor this variant needs, its shape, finite; none left over
    except CheckpointError as e:
        raise ConfigError(
            f"{e}. Warm-start a variant from an export of its own shape: the drafter.* settings it was trained with"
        ) from None
    own = rs.model.state_dict()
    rs.model.load_state_dict({k: sd[k].to(own[k].dtype) for k in own})
    return folder


HEADS = ("markov_head.", "confidence_head.")  # a DSpark drafter's own, started fresh from a DFlash backbone
CONV = ("attention_conv.", "mlp_conv.")  # DFlash2's block convolutions (identity where the export has none)


def backbone_start(model: DFlashDrafter, sd: dict[str, torch.Tensor], folder: Path) -> None:
    """A DSpark drafter's backbone from a DFlash / DFlash2 export's tensors (module docstring): every backbone
    tensor the export has, of the same shape and finite; the selector dropped; anything else refused by name."""
    own = model.state_dict()
    want = [k for k in own if not k.startswith(HEADS)]
    lacking = [k for k in want if k not in sd and not any(c in k for c in CONV)]
    shape = [
        f"{k} {tuple(sd[k].shape)} != {tuple(own[k].shape)}" for k in want if k in sd and sd[k].shape != own[k].shape
    ]
    extra = [k for k in sd if k not in own and not k.startswith("candidate_selector.")]
    bad = [k for k in want if k in sd and not torch.isfinite(sd[k].float()).all()]
    if lacking or shape or extra or bad:
        raise ConfigError(
            f"init_from: {folder} cannot start this DSpark variant's backbone: "
            + "; ".join(
                f"{what} {items[:4]}{' ...' if len(items) > 4 else ''}"
                for what, items in (
                    ("missing", lacking),
                    ("shapes differ", shape),
                    ("tensors it has no place for (block convolutions: set drafter.conv_kernel_size)", extra),
                    ("non-finite", bad),
                )
                if items
            )
            + ". Warm-start it from an export of the same backbone (drafter.num_layers, num_taps, intermediate_size)"
        )
    moved = [k for k in want if k in sd]
    model.load_state_dict({**own, **{k: sd[k].to(own[k].dtype) for k in moved}})
    fresh = sorted(
        {"block convolutions (identity)" if any(c in k for c in CONV) else k.split(".")[0] for k in own if k not in sd}
    )
    log.info(
        "init_from %s: %d backbone tensors transferred (one slot off: DFlash slot j predicted anchor + j, a DSpark "
        "row j predicts anchor + j + 1); fresh: %s; dropped: %d tensors of DFlash2's selector",
        folder,
        len(moved),
        ", ".join(fresh),
        sum(k.startswith("candidate_selector.") for k in sd),
    )
