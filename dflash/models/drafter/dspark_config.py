"""DSpark's config keys (docs/dspark.md), read as SGLang 0.5.23 reads them, or refused by name.

`parse_config` (dflash/models/drafter/config.py, the one parser) calls `parse_dspark` when `architectures` is one of
DSPARK_ARCHITECTURES (`Qwen3DSparkModel`, `DSparkDraftModel`, `LingDSparkModel`: one dense drafter under three
names); REFUSED_ARCHITECTURES names the DSpark backbones that are not implemented. Every key below is checked here
with a message naming it (a `CheckpointError`, exit 2).

Where a key is looked up, first found wins (SGLang's parser; `nested` = `dflash_config` updated by `dspark_config`):
- `markov_rank`, `markov_head_type`: top-level `dspark_<key>`, then `nested`, then the top level. SGLang *builds*
  the heads from the top level only, so a config whose Markov keys sit only in `dflash_config` (SpecForge's export)
  is read here with a warning that SGLang 0.5.23 refuses to build it until they are lifted to the top level.
  Values found in several places must agree (else SGLang's parser and builder would read two drafters).
- `enable_confidence_head`, `confidence_head_with_markov`: the top level, then `nested` (same warning). The
  confidence head is read when enabled (default true, as SGLang's ragged modes and speculators default), its tensors
  then required; `confidence_head_with_markov` defaults to true (SGLang: markov_rank > 0).
- gamma (proposals per step): `dspark_block_size`, then `dflash_config.block_size`, then `block_size`; required.
- mask id: `dspark_noise_token_id`, then `nested.mask_token_id`, then `mask_token_id` (no `mask_token` string).
- taps: `dspark_target_layer_ids`, then DFlash's (`dflash_config`, then the top level).
- `sample_from_anchor`: the top level only, a JSON bool, default true: the slot convention. True: the block is
  gamma rows `[anchor, mask, ...]`, row j proposes the token after the anchor's j-th successor (gamma proposals).
  False: gamma + 1 rows, row 0 dropped (DFlash's layout). `dflash_config.sample_from_anchor` is not read by SGLang:
  warned about, the top level (or its default) wins.
- `dflash_config.conv_kernel_size` / `conv_group_size`: DFlash2's block convolutions, which SGLang builds for DSpark
  too, indexing a row's slot as n mod the model's block size (`dflash_config.block_size`, else `block_size`, else 16)
  over the flattened batch: accepted where that is right for a request (rows <= the model's block size, kernel <=
  rows; a warning where rows < it, as a batch's later requests then misalign), refused otherwise.
- `dflash_config.projector_type`: "dspark" (SpecForge's marker) is accepted, "domino" refused by name; SpecForge's
  `attention_mode` gqa / mha accepted (mla refused); `confidence_head_alpha`, `num_anchors` are training-only.
- `markov_rank` 0 (DeepSpec's DFlash drafters under a DSpark name) is refused, as SGLang refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash.util.errors import CheckpointError

DSPARK_ARCHITECTURES = ("Qwen3DSparkModel", "DSparkDraftModel", "LingDSparkModel")
MARKOV_TYPES = ("vanilla", "gated", "rnn")
REFUSED_ARCHITECTURES = {  # config.json's architectures[0] -> what it is (not implemented)
    "DeepseekV4ForCausalLMDSpark": "DeepSeek-V4's DSpark head (MLA + MoE stages, its own Markov head class)",
    "DeepseekV4ForCausalLM": "a DeepSeek-V4 model (with dspark_* keys SGLang serves its bundled DSpark head)",
    "DSparkV4DraftModel": "not a name SGLang 0.5.23 registers (DeepSeek-V4's DSpark is DeepseekV4ForCausalLMDSpark)",
    "DSparkMiniMaxDraftModel": "a MiniMax-backbone DSpark drafter",
    "Lfm2DSparkDraftModel": "an LFM2 DSpark drafter (interleaved-rotary checkpoints)",
    "Glm5DSparkForCausalLM": "an MLA (GLM-5) DSpark export",
    "Gemma4DSparkModel": "DeepSpec's Gemma-4 DSpark backbone (no SGLang 0.5.23 class)",
    "DSparkSpeculator": "a speculators DSpark class name outside a speculators config (speculators_model_type)",
}
PREFIXED = {  # SGLang's top-level dspark_* keys -> what they stand for
    "dspark_block_size": "block_size",
    "dspark_markov_rank": "markov_rank",
    "dspark_markov_head_type": "markov_head_type",
    "dspark_noise_token_id": "mask_token_id",
    "dspark_target_layer_ids": "target_layer_ids",
}
HEAD_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
TOP_KEYS = (*HEAD_KEYS, "sample_from_anchor", *PREFIXED, "dspark_config")  # read at the top level
NESTED_KEYS = (*HEAD_KEYS, "projector_type", "attention_mode", "conv_kernel_size", "conv_group_size")
TRAINING_ONLY = ("confidence_head_alpha", "num_anchors")  # change nothing computed at inference


@dataclass(frozen=True)
class DSparkConfig:
    """What DSpark adds to a DFlash drafter: the slot convention, the Markov head, the confidence head."""

    gamma: int  # proposals per verify step (SGLang's DSpark block size)
    markov_rank: int
    markov_head_type: str  # MARKOV_TYPES
    confidence: bool  # the confidence head is read (its tensors required)
    confidence_with_markov: bool  # its input is [hidden ; markov_w1[prev]] (else the hidden alone)
    sample_from_anchor: bool = True  # the slot convention (module docstring)
    conv_kernel_size: int | None = None  # DFlash2's block convolutions (None: none)
    conv_group_size: int | None = None
    vocab_size: int | None = None  # markov_w1's rows (the target's vocabulary); None until read from the tensors
    architecture: str = "DSparkDraftModel"  # the name it was read under, written back
    attention_mode: str | None = None  # SpecForge's gqa / mha, written back
    model_block: int | None = None  # SGLang's model block size (its convolutions' index), where it differs from gamma

    @property
    def rows(self) -> int:
        """Rows of the drafter's block: gamma with sample_from_anchor, else gamma + 1 (row 0 dropped)."""
        return self.gamma + (0 if self.sample_from_anchor else 1)

    def to_top_level(self) -> dict[str, Any]:
        """The keys as SGLang 0.5.23 builds them: every one at the top level, the convention explicit (gamma as
        dspark_block_size where the model's block size differs: block_size is then the model's)."""
        split = self.model_block is not None and self.model_block != self.gamma
        return {
            **({"dspark_block_size": self.gamma, "block_size": self.model_block} if split else {}),
            **({} if split else {"block_size": self.gamma}),
            "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head_type,
            "enable_confidence_head": self.confidence,
            "confidence_head_with_markov": self.confidence_with_markov,
            "sample_from_anchor": self.sample_from_anchor,
        }


def _bad(name: str, v: Any, want: str) -> CheckpointError:
    return CheckpointError(f"config field {name}={v!r} should be {want} (DSpark); fix config.json")


def _int(name: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _bad(name, v, f"an integer >= {lo}")
    return v


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _bad(
            name,
            v,
            'true or false (a JSON bool: SGLang reads the value\'s truthiness, so a string such as "false" '
            "would serve as true)",
        )
    return v


def refuse_architecture(arch: str) -> CheckpointError | None:
    """A DSpark backbone this evaluator does not implement -> the error naming it (None: not one of them)."""
    if arch not in REFUSED_ARCHITECTURES:
        return None
    return CheckpointError(
        f"architectures=[{arch!r}]: {REFUSED_ARCHITECTURES[arch]}; not implemented here (the dense DSpark drafters "
        f"{list(DSPARK_ARCHITECTURES)} are). Evaluate a dense Qwen3-layer DSpark drafter"
    )


def refuse_variant(raw: dict[str, Any]) -> None:
    """DSpark variants under a dense DSpark name that are not implemented, refused by name before any other key."""
    if raw.get("has_embed_tokens"):
        raise CheckpointError(
            "has_embed_tokens=True on a DSpark drafter: Nemotron-3.5 DSpark (its own embedding, a quantized Markov "
            "head) is not implemented"
        )


def _found(sources: list[tuple[str, Any]], lower: bool = False) -> list[tuple[str, Any]]:
    """(where, value) of the sources that hold the key, first wins; their values must agree."""
    hits = [(w, (v.lower() if lower and isinstance(v, str) else v)) for w, v in sources if v is not None]
    if len({repr(v) for _, v in hits}) > 1:
        raise CheckpointError(
            "DSpark config conflict: "
            + ", ".join(f"{w}={v!r}" for w, v in hits)
            + ": SGLang's parser reads the first of these and its model builder the top-level one, so the server "
            "would build another drafter than it configures; keep one value"
        )
    return hits


def parse_dspark(
    raw: dict[str, Any],
    dflash: dict[str, Any],
    arch: str,
    hidden_size: int,
    warnings: list[str],
) -> tuple[DSparkConfig, dict[str, Any]]:
    """A DSpark config.json (`raw`, its `dflash_config` as `dflash`) -> (DSparkConfig, the DFlash fields it sets:
    block_size = rows, mask_token_id, target_layer_ids where DSpark's keys give them), or a CheckpointError naming the
    key. Appends what SGLang would read differently to `warnings`."""
    dsc = raw.get("dspark_config") or {}
    if not isinstance(dsc, dict):
        raise _bad("dspark_config", dsc, "a mapping")
    for k in dsc:
        if k not in ("markov_rank", "markov_head_type", "mask_token_id", *TRAINING_ONLY):
            raise CheckpointError(
                f"config key dspark_config.{k}={dsc[k]!r}: SGLang 0.5.23 reads only markov_rank, markov_head_type and "
                "mask_token_id from dspark_config; move it where SGLang reads it (docs/dspark.md)"
            )
    nested = {**dflash, **dsc}
    where_nested = lambda k: "dspark_config." + k if k in dsc else "dflash_config." + k  # noqa: E731

    def head_key(key: str, prefixed: str | None, lower: bool = False) -> Any:
        srcs = [(prefixed, raw.get(prefixed))] if prefixed else []
        srcs += [(where_nested(key), nested.get(key)), (key, raw.get(key))]
        hits = _found(srcs, lower)
        if hits and raw.get(key) is None:
            lift.append(f"{hits[0][0]}={hits[0][1]!r}")
        return hits[0][1] if hits else None

    lift: list[str] = []
    rank = head_key("markov_rank", "dspark_markov_rank")
    kind = head_key("markov_head_type", "dspark_markov_head_type", lower=True)
    conf = head_key("enable_confidence_head", None)
    with_markov = head_key("confidence_head_with_markov", None)
    if rank is None or _int("markov_rank", rank, 0) == 0:
        raise CheckpointError(
            f"architectures=[{arch!r}] with markov_rank={rank!r}: a DSpark drafter needs its Markov head "
            '(markov_rank > 0), as SGLang requires ("DSpark draft requires markov_rank > 0"); DeepSpec\'s DFlash '
            "drafters carry a DSpark name with markov_rank 0 and are not served as DSpark"
        )
    if kind is None:
        raise CheckpointError(
            'DSpark config lacks markov_head_type (SGLang: "DSpark requires markov_head_type when markov_rank > 0"); '
            f"set it to one of {list(MARKOV_TYPES)}"
        )
    if kind not in MARKOV_TYPES:
        raise _bad("markov_head_type", kind, f"one of {list(MARKOV_TYPES)}")
    conf = True if conf is None else _bool("enable_confidence_head", conf)
    with_markov = True if with_markov is None else _bool("confidence_head_with_markov", with_markov)
    if lift:
        warnings.append(
            f"DSpark head keys {', '.join(lift)} are not at the top level: read here, but SGLang 0.5.23 builds the "
            'Markov and confidence heads from top-level keys only and will not build this drafter ("DSpark requires '
            "markov_rank > 0\", or a head of another type) until they are lifted to the top level (SpecForge's "
            "scripts/gates/normalize_dflash_export.py does it)"
        )

    anchor = raw.get("sample_from_anchor")
    anchor = True if anchor is None else _bool("sample_from_anchor", anchor)
    if dflash.get("sample_from_anchor") is not None and dflash["sample_from_anchor"] != anchor:
        warnings.append(
            f"dflash_config.sample_from_anchor={dflash['sample_from_anchor']!r} is not read by SGLang 0.5.23 (only the "
            f"top-level key is): read as sample_from_anchor={anchor}, as it serves it; set the top-level key if the "
            "drafter was trained the other way"
        )

    gamma_src = _first(
        [
            ("dspark_block_size", raw.get("dspark_block_size")),
            ("dflash_config.block_size", dflash.get("block_size")),
            ("block_size", raw.get("block_size")),
        ]
    )
    if gamma_src is None:
        raise CheckpointError(
            "DSpark config has no block size (dspark_block_size, dflash_config.block_size or block_size): SGLang would "
            "draft 7 tokens but size its model's block as 16; set block_size to the gamma it was trained with"
        )
    gamma = _int(gamma_src[0], gamma_src[1], 1)
    model_block = dflash.get("block_size", raw.get("block_size"))  # SGLang's model / convolution block size
    if model_block is None:
        model_block = 16
    out: dict[str, Any] = {}
    mask = _first(
        [
            ("dspark_noise_token_id", raw.get("dspark_noise_token_id")),
            (where_nested("mask_token_id"), nested.get("mask_token_id")),
            ("mask_token_id", raw.get("mask_token_id")),
        ]
    )
    if mask is not None:
        out["mask_token_id"] = _int(mask[0], mask[1], 0)
    elif dflash.get("mask_token") is not None:
        raise CheckpointError(
            f"DSpark config gives dflash_config.mask_token={dflash['mask_token']!r} but no mask_token_id: SGLang's "
            'DSpark requires mask_token_id ("DSpark requires mask_token_id to be set"); set it'
        )
    taps = raw.get("dspark_target_layer_ids")
    if taps is not None:
        if not isinstance(taps, list) or not taps:
            raise _bad("dspark_target_layer_ids", taps, "a non-empty list of integers")
        taps = [_int(f"dspark_target_layer_ids[{i}]", t, 0) for i, t in enumerate(taps)]
        other = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
        if other is not None and list(other) != taps:
            raise CheckpointError(
                f"dspark_target_layer_ids={taps} and target_layer_ids={list(other)} differ: SGLang captures the first "
                "and sizes the drafter's fc from the second; keep one list"
            )
        out["target_layer_ids"] = taps

    T, gs = (None if dflash.get(k) in (None, 0) else _int(f"dflash_config.{k}", dflash[k], 1) for k in CONV)
    if (T is None) != (gs is None):
        raise CheckpointError(
            f"dflash_config.conv_kernel_size={dflash.get('conv_kernel_size')!r} and conv_group_size="
            f"{dflash.get('conv_group_size')!r}: the block convolutions need both (or neither), as SGLang requires"
        )
    rows = gamma + (0 if anchor else 1)
    if T is not None:
        why = (
            f"the block's {rows} rows (gamma {gamma} from {gamma_src[0]}, sample_from_anchor={anchor}) exceed the "
            f"model's block size {model_block} (dflash_config.block_size, else block_size), so SGLang's convolution "
            "index restarts inside the block"
            if rows > model_block
            else f"conv_kernel_size {T} exceeds the block's {rows} rows"
            if T > rows
            else f"conv_group_size {gs} does not divide hidden_size {hidden_size}"
            if hidden_size % gs
            else None
        )
        if why:
            raise CheckpointError(f"dflash_config.conv_kernel_size={T} with DSpark: {why}; not implemented")
        if rows < model_block:
            warnings.append(
                f"DSpark block convolutions over {rows} rows per request while the model's block size is "
                f"{model_block}: a lone request's slots are aligned (what is evaluated here), but SGLang's "
                "convolution index runs over the flattened batch, so in a batch of requests the later ones are "
                f"misaligned; set dflash_config.block_size to {rows}"
            )
    projector = dflash.get("projector_type")
    if projector == "domino":
        raise CheckpointError(
            "dflash_config.projector_type='domino': the Domino projector (prefix GRU + embedding projection) is not "
            "implemented; evaluate a drafter with fc + hidden_norm"
        )
    if projector not in (None, "dspark"):
        raise _bad("dflash_config.projector_type", projector, '"dspark" (SpecForge\'s marker) or absent')
    mode = dflash.get("attention_mode")
    if mode is not None and mode not in ("gqa", "mha"):
        raise _bad("dflash_config.attention_mode", mode, "gqa or mha (the attention implemented here)")
    out["block_size"] = rows
    vocab = raw.get("vocab_size")
    cfg = DSparkConfig(
        gamma,
        rank,
        kind,
        conf,
        with_markov,
        anchor,
        T,
        gs,
        None if vocab is None else _int("vocab_size", vocab, 1),
        arch,
        mode,
        None if T is None else model_block,
    )
    return cfg, out


CONV = ("conv_kernel_size", "conv_group_size")


def _first(sources: list[tuple[str, Any]]) -> tuple[str, Any] | None:
    return next(((w, v) for w, v in sources if v is not None), None)


def check_dspark_vocab(ds: DSparkConfig, target_vocab: int) -> list[str]:
    """What cannot work against a target with `target_vocab` LM-head rows (error strings; empty: fits)."""
    if ds.vocab_size is not None and ds.vocab_size != target_vocab:
        return [
            f"vocab_size {ds.vocab_size} (markov_head.markov_w1's rows) != the target's {target_vocab}: the Markov "
            "head indexes it with the target's token ids"
        ]
    return []
