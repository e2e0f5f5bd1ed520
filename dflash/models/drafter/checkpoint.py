"""Drafter checkpoints loaded in three phases: read and check, fit to the target, build (docs/family.md §5).

Loading runs in three phases, so a drafter that cannot work fails before the target's weights load:

1. `read_drafter` (no target): find the files, read config and weights, parse the config
   (dflash/models/drafter/config.py: every refusal of a key or value), check the tensors against the
   model that config describes (missing, not consumed, wrong shape, not finite).
2. `fit_drafter(src, target)` (the target's config and tokenizer only: a `TargetInfo` or a
   `Target`): default taps from the target's layer count (the public rule), `mask_token` through the
   target's tokenizer, `drafter=init`'s shapes, `check_against_target`.
3. `build_drafter`: the module with its weights, built on the meta device (no random init for weights
   a file gives) and assigned in the target's dtype beside the target's last layers.

Kinds: `training` (a `step_<N>/` of a training run: a torch pickle, or the HF format), `hf` (a
public HF-format folder), `init` (deterministic random weights with the target's shapes: smoke
runs, training start). Finding and reading (and writing) the files: dflash/models/drafter/files.py.

Block size, taps and mask id come from the checkpoint's config; the `overrides` dict only fills
what a checkpoint lacks. Tensors: every one the model needs must be there and finite, and every
one there must be consumed, except transformers' rotary caches (`*rotary_emb.inv_freq`, recomputed
from the config as SGLang ignores them).
"""

from __future__ import annotations

import dataclasses
import json
import re
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash.models.drafter import layouts, specforge
from dflash.models.drafter.config import DrafterConfig, build_target_layer_ids, parse_config
from dflash.models.drafter.dflash2_config import check_dflash2_vocab, parse_dflash2
from dflash.models.drafter.dspark_config import check_dspark_vocab
from dflash.models.drafter.files import checkpoint_files, native_step, read_hf_folder, read_training_pickle
from dflash.models.drafter.formats import own_tensors, translate
from dflash.models.drafter.model import DFlashDrafter
from dflash.models.drafter.rope import rotary_parameters
from dflash.models.target.weights import all_finite, sha256_later
from dflash.util.errors import CheckpointError
from dflash.util.files import find_path
from dflash.util.progress import log

FLOAT32_HEADS = {"confidence_head.": torch.float32}  # tensor name prefixes kept in float32 whatever the dtype
IGNORED_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # transformers' rotary caches: recomputed from the config


INIT_DFLASH2 = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
)  # drafter=init's DFlash2 sizes


@dataclass
class DrafterSource:
    """A drafter read and checked (phase 1), then fitted to a target (phase 2: `config` complete)."""

    kind: str
    name: str  # for run names: "<drafter>@step_<N>"
    step: int | None
    path: str | None
    digest: (
        Future[str] | None
    )  # the checkpoint's sha256 over all its files, in a thread (weights.sha256_later); kind=init: None
    config: DrafterConfig | None  # kind=init: None until fitted
    state_dict: dict[str, torch.Tensor] | None  # kind=init: None
    warnings: list[str] = field(default_factory=list)
    init: dict[str, Any] = field(default_factory=dict)  # kind=init: num_layers, num_taps, seed, overrides
    origin: dict[str, Any] = field(default_factory=dict)  # kind=training: layout, step unit, epoch (layouts.origin)


@dataclass
class LoadedDrafter:
    model: DFlashDrafter
    name: str
    step: int | None
    path: str | None
    digest: Future[str] | None
    warnings: list[str] = field(default_factory=list)
    origin: dict[str, Any] = field(default_factory=dict)

    @property
    def sha256(self) -> str | None:
        """The checkpoint's sha256 (waits for its thread; None for drafter=init)."""
        return None if self.digest is None else self.digest.result()


# --- phase 1: read and check, no target ------------------------------------------------------------


def check_weights(cfg: DrafterConfig, sd: dict[str, torch.Tensor], where: str) -> None:
    """Every tensor the model needs is there, with its shape, finite; every tensor there is consumed."""
    with torch.device("meta"):
        own = {k: tuple(v.shape) for k, v in DFlashDrafter(cfg).state_dict().items()}
    missing = sorted(set(own) - set(sd))
    unused = sorted(k for k in set(sd) - set(own) if not IGNORED_TENSORS.search(k))
    shapes = [
        f"{k}: checkpoint {tuple(sd[k].shape)} vs model {own[k]}"
        for k in own
        if k in sd and tuple(sd[k].shape) != own[k]
    ]
    if missing or unused or shapes:
        hint = ""
        if any(k.startswith("fc.") for k in shapes) and not cfg.target_layer_ids:
            hint = (
                f"; the config has no target_layer_ids, so the public rule gives one tap per draft layer "
                f"({cfg.num_hidden_layers}): "
                "set drafter.target_layer_ids=[...] to the taps the drafter was trained with"
            )
        if any(k.endswith(".bias") for k in unused) and not any(k.startswith(DSPARK_HEADS) for k in unused):
            hint += "; bias tensors need attention_bias: true in the config"
        hint += dspark_hint(cfg, missing, unused)
        raise CheckpointError(
            f"{where}: weights do not fit the drafter its config describes"
            + (f"; missing {missing[:6]}" if missing else "")
            + (
                f"; not consumed by that drafter (refused: it would compute something else) {unused[:8]}"
                if unused
                else ""
            )
            + (f"; shape mismatch {shapes[:4]}" if shapes else "")
            + hint
        )
    bad = [k for k in own if sd[k].is_floating_point() and not all_finite(sd[k])]
    if bad:
        raise CheckpointError(
            f"{where}: non-finite weights (NaN or inf) in {bad[:6]}: the checkpoint is damaged (or training diverged)"
        )


DSPARK_HEADS = ("markov_head.", "confidence_head.", "logit_head.")


def dspark_hint(cfg: DrafterConfig, missing: list[str], unused: list[str]) -> str:
    """What a DSpark checkpoint's missing or extra head tensors mean, and which config key says otherwise."""
    ds, out = cfg.dspark, ""
    if any(k.startswith("logit_head.") for k in unused):
        out += "; logit_head.markov_head.* are SpecForge's legacy names: rename them to markov_head.*"
    if ds is None:
        if any(k.startswith(DSPARK_HEADS) for k in unused):
            out += "; markov_head / confidence_head tensors belong to a DSpark drafter: name it one in architectures"
        return out
    if any(k.startswith("markov_head.") for k in missing + unused):
        out += (
            f"; markov_head_type={ds.markov_head_type!r} (rank {ds.markov_rank}) needs markov_w1, markov_w2"
            + {"vanilla": "", "gated": " and gate_proj", "rnn": " and joint_proj"}[ds.markov_head_type]
            + " (SGLang would serve a missing one randomly initialised)"
        )
    if any(k.startswith("confidence_head.") for k in missing):
        out += "; enable_confidence_head is true (or absent: true): set it to false for a drafter without the head"
    if any(k.startswith("confidence_head.") for k in unused) and not ds.confidence:
        out += "; enable_confidence_head is false: set it to true to read the head"
    return out


def dspark_vocab(cfg: DrafterConfig, sd: dict[str, torch.Tensor]) -> DrafterConfig:
    """DSpark without `vocab_size` in its config: markov_w1's rows, as the checkpoint holds them (checked against the
    target's vocabulary in phase 2)."""
    ds, w1 = cfg.dspark, sd.get("markov_head.markov_w1.weight")
    if ds is None or ds.vocab_size is not None or w1 is None or w1.dim() != 2:
        return cfg
    return dataclasses.replace(cfg, dspark=dataclasses.replace(ds, vocab_size=int(w1.shape[0])))


def codebook_vocab(cfg: DrafterConfig, sd: dict[str, torch.Tensor]) -> DrafterConfig:
    """DFlash2 without `vocab_size` in its config: the selector codebooks' rows, as the checkpoint holds them
    (checked against the target's vocabulary in phase 2)."""
    d2 = cfg.dflash2
    book = sd.get("candidate_selector.predecessor_codebook", sd.get("candidate_selector.successor_codebook"))
    if d2 is None or d2.vocab_size is not None or book is None or book.dim() != 2:
        return cfg
    return dataclasses.replace(cfg, dflash2=dataclasses.replace(d2, vocab_size=int(book.shape[0])))


def read_training_step(
    run_dir: str, step: int | str | None, config: str | None = None
) -> tuple[Path, int, dict[str, torch.Tensor], dict[str, Any], list[str], list[Path], dict[str, Any]]:
    """A step of a training run, in any layout (dflash/models/drafter/layouts.py) -> (where, step, weights, raw
    config, warnings, the files its digest covers, its origin)."""
    run, f = layouts.find_step(run_dir, step)
    if config and f.layout != layouts.UNIFIED:
        raise CheckpointError(
            f"drafter.config={config}: {run.root} is a {f.layout} run, whose steps carry their own config; "
            "drafter.config is for SpecForge's unified layout (<run_id>-step<N>/training_state.pt). Drop it"
        )
    warns: list[str] = []
    if f.layout == layouts.UNIFIED:
        where = f.path / layouts.PAYLOAD
        sd, meta = specforge.read_payload(where)
        path, warns = specforge.launch_json(config, meta, where)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"drafter.config={path}: not a readable JSON file ({e})") from None
        raw, more = specforge.apply_contract(raw, meta, path)
        warns += more
        log.info("drafter: %s with the config of %s (the payload's contract applied)", where, path)
    elif f.layout == layouts.LEGACY:
        where = f.path
        sd, raw = read_hf_folder(where, ignore=layouts.LEGACY_EXTRAS)
    else:
        where = native_step(f.path)
        sd, raw = read_training_pickle(where) if where.is_file() else read_hf_folder(where)
    return where, f.step, sd, raw, warns, layouts.digest_files(f), layouts.origin(run, f)


def read_drafter(
    kind: str,
    name: str,
    run_dir: str | None = None,
    step: int | str | None = None,
    path: str | None = None,
    overrides: dict[str, Any] | None = None,
    init: dict[str, Any] | None = None,
    config: str | None = None,
) -> DrafterSource:
    """Phase 1: the files found and read, the config parsed, the tensors checked. `step`: N, null (the latest
    complete step) or "best" (the trainer's recorded best); `config`: SpecForge's unified layout, the launch JSON."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if kind == "init":
        return DrafterSource(kind, name, None, None, None, None, None, init={**(init or {}), "overrides": overrides})
    warns: list[str] = []
    origin: dict[str, Any] = {}
    if kind == "training":
        if not run_dir:
            raise CheckpointError("drafter=training needs drafter.run_dir=/path/to/run (holding its step folders)")
        where, step, sd, raw, warns, digest_src, origin = read_training_step(run_dir, step, config)
    elif kind == "hf":
        if not path:
            raise CheckpointError("drafter=hf needs drafter.path=/path/to/folder (config.json + model.safetensors)")
        where = find_path(path)
        if not where.is_dir():
            raise CheckpointError(f"drafter.path={where} is not a folder")
        sd, raw = read_hf_folder(where)
        digest_src = checkpoint_files(where)  # a sharded folder: every shard
    else:
        raise CheckpointError(f"unknown drafter kind {kind!r}; use training, hf or init")
    try:
        fmt = translate(raw, sd, None if where.is_file() else where)  # other formats -> the HF format (formats.py)
        cfg, parsed = parse_config(fmt.config, overrides)
        cfg, sd = own_tensors(cfg, fmt.state_dict)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    if cfg.dspark is not None and fmt.fmt == "hf":  # SGLang drops a DSpark drafter's own embedding and LM head
        dropped = [k for k in ("embed_tokens.weight", "lm_head.weight") if k in sd]
        if dropped:
            log.info("drafter: %s not read (SGLang's DSpark uses the target's, whatever these hold)", dropped)
            sd = {k: v for k, v in sd.items() if k not in dropped}
            cfg = dataclasses.replace(cfg, own_embed=False, own_lm_head=False)
    for n in fmt.notes:
        log.info("drafter (%s format): %s", fmt.fmt, n)
    warns += parsed
    for w in warns:
        log.warning("drafter: %s", w)
    cfg = dspark_vocab(codebook_vocab(cfg, sd), sd)
    check_weights(cfg, sd, str(where))
    return DrafterSource(
        kind,
        name,
        step if isinstance(step, int) else None,
        str(where),
        sha256_later(digest_src),
        cfg,
        sd,
        warns,
        origin=origin,
    )


# --- phase 2: fit to the target (its config and tokenizer) -----------------------------------------


def init_config(
    target: Any,
    num_layers: int,
    num_taps: int | None,
    mask_token_id: int,
    block_size: int,
    target_layer_ids: list[int] | None = None,
) -> DrafterConfig:
    """A drafter shaped like the target's layers (Qwen3-style), default rope with the target's θ;
    taps: `target_layer_ids`, else `num_taps` spread by the public rule, else the public rule
    itself (one tap per draft layer)."""
    c = target.config
    heads = int(c.num_attention_heads)
    rope = getattr(c, "rope_parameters", None) or {}
    L = int(c.num_hidden_layers)
    return DrafterConfig(
        hidden_size=int(c.hidden_size),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(c, "num_key_value_heads", heads) or heads),
        head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
        intermediate_size=int(c.intermediate_size),
        num_target_layers=L,
        target_layer_ids=list(target_layer_ids)
        if target_layer_ids
        else build_target_layer_ids(L, num_taps or num_layers),
        mask_token_id=mask_token_id,
        block_size=block_size,
        rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(rope.get("rope_theta", getattr(c, "rope_theta", 1e4) or 1e4)),
        },
        max_position_embeddings=int(getattr(c, "max_position_embeddings", 32768) or 32768),
    )


def init_shape(cfg: DrafterConfig, init: dict[str, Any], vocab: int) -> DrafterConfig:
    """drafter=init's layer kinds and architecture: `window` makes every layer sliding_attention (`is_causal` as a
    config's), `arch=dflash2` adds DFlash2's parts, sizes checked as a config's (named as the drafter.* keys)."""
    if init.get("window") is not None:
        cfg = dataclasses.replace(
            cfg, layer_types=["sliding_attention"] * cfg.num_hidden_layers, sliding_window=int(init["window"])
        )
    if init.get("is_causal") is not None:
        cfg = dataclasses.replace(cfg, causal=bool(init["is_causal"]))
    if init.get("arch", "dflash") == "dflash2":
        keys = {k: init[k] for k in INIT_DFLASH2 if init.get(k) is not None}
        try:
            d2 = parse_dflash2(keys, cfg.hidden_size, cfg.block_size, vocab)
        except CheckpointError as e:
            raise CheckpointError(
                str(e)
                .replace("config field dflash_config.", "drafter.")
                .replace("dflash_config.", "drafter.")
                .replace("fix config.json", "fix the override")
            ) from None
        cfg = dataclasses.replace(cfg, arch="dflash2", dflash2=d2)
    return cfg


def resolve_mask_token(token: str, tokenizer: Any) -> int:
    """`dflash_config.mask_token` -> its id in the target's tokenizer (one token of its vocabulary)."""
    tid = tokenizer.get_vocab().get(token)
    if tid is None:
        pieces = tokenizer.tokenize(token) if hasattr(tokenizer, "tokenize") else []
        raise CheckpointError(
            f"mask_token {token!r} is not a single token of the target's tokenizer (it splits into {pieces[:6]}): this "
            f"drafter "
            "was made for a tokenizer that has it. Use the target it was trained for, or set drafter.mask_token_id"
        )
    return int(tid)


def check_against_target(cfg: DrafterConfig, target: Any) -> list[str]:
    """Raise CheckpointError on what cannot work; return warnings for what is suspicious."""
    errs = []
    if (cfg.target_hidden_size or cfg.hidden_size) != target.hidden_size:
        errs.append(
            f"hidden size {cfg.target_hidden_size or cfg.hidden_size} != the target's {target.hidden_size}: this "
            f"drafter "
            "was trained for another target"
        )
    if cfg.vocab_size is not None and (cfg.own_embed or cfg.own_lm_head) and cfg.vocab_size != target.vocab_size:
        errs.append(
            f"the drafter's own embedding / LM head cover vocab_size {cfg.vocab_size} != the target's "
            f"{target.vocab_size}"
        )
    bad = [L for L in cfg.target_layer_ids or [] if not 0 <= L < target.num_layers]
    if bad:
        errs.append(f"taps {bad} are outside the target's decoder layers 0..{target.num_layers - 1}")
    if cfg.mask_token_id is None or not 0 <= cfg.mask_token_id < target.vocab_size:
        errs.append(
            f"mask_token_id {cfg.mask_token_id} is not a row of the target's embedding (vocab {target.vocab_size})"
        )
    if cfg.proposals < 1:
        errs.append(f"block_size {cfg.block_size} must be at least 2")
    if cfg.dflash2 is not None:
        errs += check_dflash2_vocab(cfg.dflash2, target.vocab_size)
    if cfg.dspark is not None:
        errs += check_dspark_vocab(cfg.dspark, target.vocab_size)
    if errs:
        raise CheckpointError("drafter does not fit the target: " + "; ".join(errs))
    warns = []
    if target.num_layers - 1 in cfg.target_layer_ids:
        warns.append(
            f"taps {cfg.target_layer_ids} include the target's final layer {target.num_layers - 1}: its state at a "
            f"position "
            "encodes the next token, a training shortcut inference never offers (docs/family.md §4 bug 2); expect poor "
            "real "
            "acceptance"
        )
    if cfg.num_target_layers != target.num_layers:
        warns.append(
            f"checkpoint was made for a {cfg.num_target_layers}-layer target, this one has {target.num_layers}"
        )
    return warns


def fit_drafter(src: DrafterSource, target: Any, max_len: int | None = None) -> DrafterSource:
    """Phase 2: resolve what depends on the target, then `check_against_target`; with `max_len`
    (the longest prompt + completion) also the rope's position limit (rope.rotary_parameters)."""
    if src.kind == "init":
        i, o = src.init, src.init.get("overrides", {})
        mask = o.get("mask_token_id", i.get("mask_token_id"))
        if mask is None:
            raise CheckpointError(
                "drafter=init needs a mask token id: set drafter.mask_token_id or target.mask_token_id"
            )
        cfg = init_shape(
            init_config(
                target,
                int(i.get("num_layers", 1)),
                i.get("num_taps"),
                int(mask),
                int(o.get("block_size") or 16),
                o.get("target_layer_ids"),
            ),
            i,
            int(target.vocab_size),
        )
    else:
        cfg, where = dataclasses.replace(src.config), src.path
        if cfg.mask_token_id is None and cfg.mask_token is not None:
            try:
                cfg.mask_token_id = resolve_mask_token(cfg.mask_token, target.tokenizer)
            except CheckpointError as e:
                raise CheckpointError(f"{where}: {e}") from None
        if cfg.mask_token_id is None:
            raise CheckpointError(
                f"{where}: drafter config lacks mask_token_id (dflash_config.mask_token_id or "
                f"dflash_config.mask_token); "
                "the checkpoint should store it, or set the override drafter.mask_token_id=..."
            )
        if cfg.target_layer_ids is None:
            try:
                cfg.target_layer_ids = build_target_layer_ids(target.num_layers, cfg.num_hidden_layers)
            except ValueError as e:
                raise CheckpointError(f"{where}: {e} (drafter.target_layer_ids=[...])") from None
        if cfg.num_target_layers is None:
            cfg.num_target_layers = target.num_layers
        if (
            cfg.dflash2 is not None and cfg.dflash2.vocab_size is None
        ):  # neither config nor checkpoint says: the target's
            cfg.dflash2 = dataclasses.replace(cfg.dflash2, vocab_size=target.vocab_size)
        if cfg.dspark is not None and cfg.dspark.vocab_size is None:
            cfg.dspark = dataclasses.replace(cfg.dspark, vocab_size=target.vocab_size)
    limit = rotary_parameters(cfg)[2]
    if max_len is not None and limit is not None and max_len + cfg.block_size - 1 > limit:
        raise CheckpointError(
            f"{src.path or src.name}: sequences of up to {max_len} tokens (+ a block of {cfg.block_size}) pass this "
            f"drafter's "
            f"{cfg.rope_parameters['rope_type']} rope limit of {limit} positions, where transformers recomputes the "
            f"frequencies "
            "from the loop's history and SGLang differs: not implemented. Use shorter prompts or lower "
            "prompts.max_new_tokens"
        )
    return dataclasses.replace(src, config=cfg, warnings=src.warnings + check_against_target(cfg, target))


# --- phase 3: the module ---------------------------------------------------------------------------


def build_drafter(
    src: DrafterSource, sliding_window: str = "apply", device: Any = "cpu", dtype: torch.dtype = torch.float32
) -> LoadedDrafter:
    """The fitted drafter as a module, on `device` in `dtype`. It is built on the meta device, so no
    random initialisation is spent on weights a file provides: the checkpoint's tensors are assigned,
    converted once to `dtype` on `device`. Only `drafter=init` draws weights (`init_weights`, seeded,
    on the CPU in float32 so a seed gives the same drafter on every machine)."""
    with torch.device("meta"):
        model = DFlashDrafter(src.config, sliding_window)
    if src.state_dict is None:
        model.to_empty(device="cpu").init_weights(
            int(src.init.get("seed", 0)), identity=False
        )  # DFlash2's parts random too
        model.to(device=device, dtype=dtype).keep_float32_()
    else:
        sd = {
            k: (v.to(device=device, dtype=FLOAT32_HEADS.get(k[:16], dtype)) if v.is_floating_point() else v.to(device))
            for k in model.state_dict()
            for v in [src.state_dict[k]]
        }  # d2t stays integer; DSpark's confidence head float32 (SGLang's)
        model.load_state_dict(sd, strict=True, assign=True)
    return LoadedDrafter(model, src.name, src.step, src.path, src.digest, src.warnings, src.origin)
