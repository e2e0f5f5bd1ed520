"""SpecForge's unified step payload (`<run_id>-step<N>/training_state.pt`) read as a drafter, or refused by name.

`read_payload`: the weights are the payload's `draft_state_dict` (public tensor names, `draft_model.` already
stripped by SpecForge), loaded with `weights_only=True` (an object a weights-only load refuses is refused here, never
unpickled) and `mmap=True`; nothing else of the payload is kept but plain values (the step, the run id, the strategy,
the training contract, the provenance). Rank files, optimizer state and `replicated_optimizer_state` are never read.
Only strategy `dflash` (DFlash and DFlash2) is a drafter this evaluator implements; DSpark, Domino, EAGLE-3 and
P-EAGLE payloads are refused by name.

The payload holds no config.json: the drafter's config is the JSON the run was launched with (`launch_json`:
`drafter.config`, else the file the payload's provenance names, if it is still there with the digest it had). The
payload's contract (`CONTRACT`: layer count, taps, block size, mask id, DFlash2's sizes) is what was trained, and it
wins over the JSON (`apply_contract`), with a warning naming both values. What neither holds is left to the parser
(dflash/models/drafter/config.py), which refuses it by name.
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import torch

from dflash.models.drafter.files import strip_prefixes
from dflash.util.errors import CheckpointError
from dflash.util.files import find_path

OTHER_STRATEGIES = {"dspark": "DSpark", "domino": "Domino", "eagle3": "EAGLE-3", "peagle": "P-EAGLE"}
CONTRACT = (  # the payload's key -> where the drafter JSON holds it (first: where the trained value is written)
    ("dflash_draft_num_hidden_layers", ("num_hidden_layers",)),
    ("dflash_target_layer_ids", ("dflash_config.target_layer_ids", "target_layer_ids")),
    ("dflash_block_size", ("dflash_config.block_size", "block_size")),
    ("dflash_mask_token_id", ("dflash_config.mask_token_id", "mask_token_id")),
    ("dflash2_conv_kernel_size", ("dflash_config.conv_kernel_size",)),
    ("dflash2_conv_group_size", ("dflash_config.conv_group_size",)),
    ("dflash2_selector_rank", ("dflash_config.selector_rank",)),
    ("dflash2_selector_top_k", ("dflash_config.selector_top_k",)),
)
PLAIN = (bool, int, float, str, type(None))


def _plain(v: Any) -> Any:
    """A payload value kept as plain data (tuples as lists); tensors and anything else dropped (None)."""
    if isinstance(v, PLAIN):
        return v
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return None


def read_payload(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """training_state.pt -> (draft weights, the payload's plain values: step, run id, strategy, contract, ...)."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # an object a weights-only load refuses, a damaged file...
        first = (str(e).strip().splitlines() or [""])[0][:240]
        raise CheckpointError(
            f"cannot read {path} safely ({type(e).__name__}: {first}): a weights-only load refuses it, and this "
            "evaluator never unpickles code. SpecForge's own export reads it: `specforge export --to hf --checkpoint "
            f"{path.parent} --draft-config <the run's drafter JSON> --output-dir <dir>`, then drafter=hf "
            "drafter.path=<dir>"
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected SpecForge's payload (a dict), got {type(obj).__name__}")
    strategy = obj.get("strategy")
    if strategy in OTHER_STRATEGIES:
        raise CheckpointError(
            f"{path}: trained with SpecForge's {strategy!r} strategy ({OTHER_STRATEGIES[strategy]} drafter), which "
            "this evaluator does not implement; it evaluates strategy 'dflash' (DFlash and DFlash2) drafters"
        )
    if strategy not in (None, "dflash"):
        raise CheckpointError(f"{path}: strategy={strategy!r} is not implemented; 'dflash' (DFlash, DFlash2) is")
    sd = obj.get("draft_state_dict")
    if not isinstance(sd, dict) or not sd:
        raise CheckpointError(
            f"{path} has no draft_state_dict (keys: {', '.join(sorted(map(str, obj))[:10])}): not a step of "
            "SpecForge's unified trainer"
        )
    if bad := [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]:
        raise CheckpointError(f"{path}: draft_state_dict holds non-tensors ({bad[:4]})")
    skip = ("draft_state_dict", "replicated_optimizer_state")
    meta = {str(k): _plain(v) for k, v in obj.items() if k not in skip and isinstance(k, str)}
    return strip_prefixes(sd), meta


def provenance(meta: dict[str, Any]) -> dict[str, Any]:
    """The payload's `specforge_model_provenance` ((key, value) pairs) as a dict; {} where absent or malformed."""
    pairs = meta.get("specforge_model_provenance") or []
    try:
        return {str(k): v for k, v in pairs}
    except (TypeError, ValueError):
        return {}


def _named_json(meta: dict[str, Any]) -> tuple[str | None, str | None]:
    """(path, sha256) of the launch JSON the payload's provenance names: ["file-stat-v2", path, ["sha256", "", size,
    hex]]; (None, None) where it names none."""
    dc = provenance(meta).get("draft_config")
    if not (isinstance(dc, list) and len(dc) >= 2 and isinstance(dc[0], str) and dc[0].startswith("file")):
        return None, None
    digest = dc[2] if len(dc) > 2 and isinstance(dc[2], list) else []
    sha = digest[3] if len(digest) >= 4 and digest[0] == "sha256" and isinstance(digest[3], str) else None
    return (dc[1] if isinstance(dc[1], str) else None), sha


def _sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def launch_json(given: str | None, meta: dict[str, Any], where: Path) -> tuple[Path, list[str]]:
    """The drafter JSON the run was launched with -> (its path, warnings): `given` (drafter.config), else the one the
    payload names if it is there unchanged; CheckpointError naming what is missing."""
    named, sha = _named_json(meta)
    if given:
        p = find_path(given)
        if not p.is_file():
            raise CheckpointError(f"drafter.config={given}: no such file (the drafter JSON the run was launched with)")
        if sha and _sha256(p) != sha:
            return p, [
                f"drafter.config={p} is not byte for byte the JSON the run was launched with (training_state.pt names "
                f"{named}, sha256 {sha[:12]}...): where they differ on what was trained, the payload's values are used"
            ]
        return p, []
    if named and Path(named).is_file():
        if sha is None or _sha256(Path(named)) == sha:
            return Path(named), []
        raise CheckpointError(
            f"{where}: the drafter JSON it names ({named}) changed since training (sha256 "
            f"{_sha256(Path(named))[:12]}... vs {sha[:12]}...): pass drafter.config=<the JSON the run was launched "
            "with>"
        )
    hint = f"; training_state.pt names {named}, which is not there" if named else ""
    raise CheckpointError(
        f"{where}: SpecForge's unified layout (<run_id>-step<N>/training_state.pt) holds no config.json, and no "
        f"drafter config was given: pass drafter.config=<the drafter JSON the run was launched with, its "
        f"model.draft_model_config>{hint}"
    )


def _get(raw: dict[str, Any], place: str) -> Any:
    if place.startswith("dflash_config."):
        return (raw.get("dflash_config") or {}).get(place.split(".", 1)[1])
    return raw.get(place)


def _set(raw: dict[str, Any], place: str, v: Any) -> None:
    if place.startswith("dflash_config."):
        raw.setdefault("dflash_config", {})[place.split(".", 1)[1]] = v
    else:
        raw[place] = v


def _drop(raw: dict[str, Any], place: str) -> None:
    if place.startswith("dflash_config."):
        (raw.get("dflash_config") or {}).pop(place.split(".", 1)[1], None)
    else:
        raw.pop(place, None)


def apply_contract(raw: Any, meta: dict[str, Any], json_path: Path) -> tuple[Any, list[str]]:
    """The launch JSON with the payload's contract written over it -> (config dict, warnings naming both values
    where they differ). CheckpointError where the two cannot be reconciled (a layer count over mixed layer kinds,
    DFlash2 sizes for a JSON of another architecture)."""
    if not isinstance(raw, dict):
        return raw, []  # the parser refuses it
    raw = copy.deepcopy(raw)
    raw["dflash_config"] = dict(raw.get("dflash_config") or {})
    warnings = []
    for key, places in CONTRACT:
        want = meta.get(key)
        if want is None:
            continue
        here = next((p for p in places if _get(raw, p) is not None), None)
        have = None if here is None else _get(raw, here)
        if have is not None and have != want:
            warnings.append(
                f"drafter.config {json_path.name} has {here}={have!r}, but the run trained {key}={want!r} "
                f"(training_state.pt): using the trained {want!r}"
            )
            if key == "dflash_draft_num_hidden_layers" and raw.get("layer_types"):
                kinds = set(raw["layer_types"])
                if len(kinds) != 1:
                    raise CheckpointError(
                        f"{json_path}: layer_types lists {len(raw['layer_types'])} layers of kinds {sorted(kinds)}, "
                        f"but the run trained {want} draft layers: which kind is each? Pass the JSON the run was "
                        "launched with as drafter.config"
                    )
                raw["layer_types"] = [next(iter(kinds))] * int(want)
        for p in places:
            _drop(raw, p)
        _set(raw, places[0], want)
        if key == "dflash_mask_token_id":
            raw["dflash_config"].pop("mask_token", None)
            raw.pop("mask_token", None)
    arch = (raw.get("architectures") or ["DFlashDraftModel"])[0]
    if arch != "DFlash2DraftModel" and (d2 := [k for k, _ in CONTRACT if k.startswith("dflash2_") and meta.get(k)]):
        raise CheckpointError(
            f"training_state.pt was trained as DFlash2 ({', '.join(f'{k}={meta[k]!r}' for k in d2)}), but "
            f"drafter.config {json_path} describes {arch}: pass the DFlash2 JSON the run was launched with"
        )
    return raw, warnings
