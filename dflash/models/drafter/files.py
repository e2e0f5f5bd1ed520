"""Drafter checkpoint files: a step folder's files, reading the two formats, writing them (which step folders a run
holds, in which layout: dflash/models/drafter/layouts.py).

Formats (the loader's phases are in dflash/models/drafter/checkpoint.py):
- training: `<run_dir>/step_<N>/checkpoint.pt`, a torch pickle with the weights under a key such as
  `model` (WEIGHT_KEYS), plus optimizer state, step and config. Read with `weights_only=True` (a
  pickle that would run code is refused) and `mmap=True`; `module.` / `_orig_mod.` prefixes stripped;
  the optimizer state is never touched. A legacy (non-zip) pickle is refused with the command that
  converts it.
- hf: a folder of config.json + *.safetensors (a `step_<N>/` folder may hold it too; so does SpecForge's legacy
  `epoch_<e>_step_<s>/`, whose optimizer pickle beside it the caller names as not the drafter). A folder
  holding both a pickle and safetensors is refused: which one is the drafter? A file this user may not read
  (safetensors >= 0.8 writes 0600) is refused saying so.
Reading returns (state dict, raw config dict); parsing and checking the config is the caller's.
Writing (the trainer's) is atomic and follows the umask (dflash/util/files.py).
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from dflash.models.drafter.model import DFlashDrafter
from dflash.util.errors import CheckpointError
from dflash.util.files import PROJECT_ROOT, atomic_dir, atomic_write

WEIGHT_KEYS = ("model", "state_dict", "model_state_dict", "drafter", "module")
PREFIXES = ("module.", "_orig_mod.")
PICKLES = ("checkpoint.pt", "*.bin", "*.pt", "*.pth")

# --- finding and reading -----------------------------------------------------------------------


def list_steps(run_dir: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in run_dir.glob("step_*") if (m := re.fullmatch(r"step_(\d+)", p.name)))


def _formats(folder: Path, ignore: tuple[str, ...] = ()) -> tuple[list[Path], list[Path]]:
    """(pickles, safetensors) in a folder, the `ignore`d names left out (a trainer's optimizer state beside its
    safetensors); both at once is refused: which one is the drafter?"""
    pickles = sorted({p for pat in PICKLES for p in folder.glob(pat) if p.name not in ignore})
    st = sorted(folder.glob("*.safetensors"))
    if pickles and st:
        raise CheckpointError(
            f"{folder} holds both a torch pickle ({', '.join(p.name for p in pickles)}) and safetensors "
            f"({', '.join(p.name for p in st)}): it is not clear which is the drafter. Keep one format in the folder "
            "(move the other away): checkpoint.pt for a training checkpoint, config.json + model.safetensors for the "
            "HF format"
        )
    return pickles, st


def in_git_history(run: Path) -> bool:
    """Whether checkpoints/extra.txt lists step folders of this run: a shipped drafter outside the tree's budget."""
    listed = PROJECT_ROOT / "checkpoints" / "extra.txt"
    lines = listed.read_text().splitlines() if listed.is_file() else []
    return any(
        (PROJECT_ROOT / line.split()[0]).parent.resolve() == run.resolve()
        for line in lines
        if line.strip() and not line.startswith("#")
    )


def native_step(folder: Path) -> Path:
    """A `step_<N>/` folder -> what holds its drafter: checkpoint.pt, or the folder itself (HF format)."""
    _formats(folder)
    if (folder / "checkpoint.pt").is_file():
        return folder / "checkpoint.pt"
    if (folder / "config.json").is_file():
        return folder
    raise CheckpointError(f"{folder} holds neither checkpoint.pt nor config.json + safetensors")


TEMP_NAME = re.compile(r"\.tmp(-|$)|\.(incomplete|partial|part)$")  # a writer's file not yet renamed into place


def checkpoint_files(folder: Path) -> list[Path]:
    """The files a step folder's digest is taken of (weights.checkpoint_sha256): checkpoint.pt, else every
    safetensors shard in name order (empty: neither)."""
    if (folder / "checkpoint.pt").is_file():
        return [folder / "checkpoint.pt"]
    return sorted(folder.glob("*.safetensors"))


def unreadable(path: Path) -> str:
    """The refusal of a file this user may not read (safetensors >= 0.8 writes its files owner-only, 0600)."""
    return (
        f"cannot read {path}: permission denied (safetensors 0.8 and later write weights readable by their owner "
        "only). Run the evaluator as the trainer's user, or make the files readable (chmod a+r)"
    )


def _safetensors_short(path: Path) -> str | None:
    """Why a safetensors file is not whole (its header names more bytes than the file holds), None if whole (or not
    ours to read: the reader then says so)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                return f"{path.name} is shorter than its header"
            header = json.loads(f.read(n))
    except PermissionError:
        return None
    except (OSError, ValueError):
        return f"{path.name}'s header is not readable yet"
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    return None if 8 + n + end <= size else f"{path.name} holds {size} of its {8 + n + end} bytes"


def incomplete(folder: Path) -> str | None:
    """Why a step folder cannot be read yet (a trainer may still be writing it), None when it looks whole: a
    writer's temporary file is there; no checkpoint.pt nor config.json + safetensors; checkpoint.pt is not a whole
    zip (torch.save's format ends with the zip's central directory, written last); a safetensors file holds fewer
    bytes than its header names; config.json does not parse."""
    import zipfile

    names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    if tmp := [n for n in names if TEMP_NAME.search(n)]:
        return f"a writer's temporary file is there ({tmp[0]})"
    if "checkpoint.pt" in names:
        return (
            None
            if zipfile.is_zipfile(folder / "checkpoint.pt")
            else "checkpoint.pt is not a whole torch (zip) file yet"
        )
    st = sorted(n for n in names if n.endswith(".safetensors"))
    if "config.json" not in names or not st:
        return "neither checkpoint.pt nor config.json + safetensors is there yet"
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "config.json does not parse yet"
    return next((why for n in st if (why := _safetensors_short(folder / n))), None)


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


_LEGACY_MAGIC = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)  # torch.save's pre-1.6 (non-zip) header


def read_training_pickle(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    with open(path, "rb") as f:
        head = f.read(len(_LEGACY_MAGIC))
    if head == _LEGACY_MAGIC:
        raise CheckpointError(
            f"{path} is a legacy (non-zip) torch checkpoint, which cannot be memory-mapped. Convert it once with "
            f"python -c \"import torch; torch.save(torch.load('{path}', weights_only=True), '{path}.zip.pt')\" "
            "and evaluate the converted file (rename it checkpoint.pt)"
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated, not a zip, unpickling refused (a pickle that would run code)...
        raise CheckpointError(
            f"cannot read checkpoint {path}: {type(e).__name__}: {str(e)[:200]}. The file is corrupt or not a torch "
            f"checkpoint"
        ) from None
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


def read_hf_folder(folder: Path, ignore: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """config.json + every *.safetensors of a folder; `ignore`: files beside them that are not the drafter (SpecForge's
    legacy step folder: training_state.pt, never unpickled)."""
    from safetensors.torch import load_file

    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(
            f"{folder} has no config.json; a public DFlash drafter folder needs config.json + model.safetensors"
        )
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    pickles, files = _formats(folder, ignore)
    if not files:
        hint = (
            f" ({pickles[0].name} is a torch pickle: save its state dict with safetensors.torch.save_file as "
            f"model.safetensors)"
            if pickles
            else ""
        )
        raise CheckpointError(f"{folder} has no .safetensors weights{hint}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(str(f)))
        except PermissionError:
            raise CheckpointError(unreadable(f)) from None
        except Exception as e:
            raise CheckpointError(f"cannot read {f}: {type(e).__name__}: {str(e)[:200]}. The file is corrupt") from None
    return strip_prefixes(sd), cfg


# --- saving (the trainer writes what the loader reads) ----------------------------------------


def save_hf_folder(model: DFlashDrafter, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """config.json + model.safetensors, written to a temp folder and renamed."""
    from safetensors.torch import save_file

    sd = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    with atomic_dir(folder, replace=True) as tmp:
        save_file(sd, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(model.cfg.to_hf(), indent=2))


def save_training_checkpoint(
    path: str | Path, model: DFlashDrafter, optimizer: Any, step: int, extra: dict[str, Any] | None = None
) -> None:
    """`<run_dir>/step_<N>/checkpoint.pt`: weights, optimizer state, step, drafter config; atomic."""
    obj = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer else None,
        "step": step,
        "config": model.cfg.to_hf(),
        **(extra or {}),
    }
    atomic_write(path, lambda tmp: torch.save(obj, tmp))
