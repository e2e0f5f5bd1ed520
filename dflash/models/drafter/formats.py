"""Drafter formats besides the public HF one, recognised and translated into it (docs/formats.md).

`translate(raw, sd)` runs before `parse_config` (dflash/models/drafter/config.py, the one place a
config is validated): it turns a config.json and its tensors into the canonical HF-format config and
tensor names, reading every field that changes the computation as vLLM reads it, or refusing it by name.

- vLLM's `qwen3_dflash` keys (they sit in an HF-format config.json): `eagle_config` merged under
  `dflash_config`; taps from `eagle_aux_hidden_state_layer_ids` or `dflash_config.layer_ids`, which
  count as vLLM's aux ids (the residual stream *entering* decoder layer i, i.e. the output of layer
  i - 1: DFlash tap = id - 1; DFlash's own `target_layer_ids` are outputs, vLLM adds 1 to them);
  `is_causal` / `dflash_config.causal` -> `dflash_config.causal` (every layer; false with sliding layers:
  non-causal in the block, the window still limiting the context, as SGLang reads public DFlash2 configs);
  `use_swa` + `swa_window_size` -> `layer_types` + `sliding_window`; `use_aux_hidden_state: false` and attention
  sinks refused. `target_hidden_size`, `draft_vocab_size`, `logit_scale` pass to the parser as they are.
- speculators (`speculators_model_type` dflash / dflash2): `transformer_layer_config` (written as a
  diff against transformers' Qwen3Config defaults, so missing keys take those defaults) becomes the
  top level; `aux_hidden_state_layer_ids` (vLLM's aux ids: taps = id - 1, as vLLM's speculators
  adapter maps them), `block_size`, `mask_token_id`, `draft_vocab_size`, `target_hidden_size` as
  above; dflash2's convolution and selector keys go to `dflash_config` under
  `architectures: ["DFlash2DraftModel"]` for the parser to judge; `sliding_window_non_causal` (true by
  default for dflash2) -> `dflash_config.causal: false` where there are sliding layers. Refused: a Domino
  projector, `shift_label`, a proposal count other than B - 1 (dflash, dflash2).
- speculators `dspark`: as dflash, plus the Markov and confidence keys (top level, speculators' defaults where
  left out) and the slot convention: `sample_from_anchor`, else `speculative_tokens` (= block_size: the anchor
  convention, = block_size - 1: DFlash's), else refused; the block's B rows give SGLang's gamma B or B - 1.
- Tensors (vLLM's weight mapper): `midlayer.` -> `layers.0.`, `encoder.fc.` -> `fc.`,
  `encoder.output_norm_enc.` -> `hidden_norm.`, `draft_id_to_target_id` -> `d2t`; `t2d` dropped (vLLM
  skips it). `own_tensors` then reads `embed_tokens.weight`, `lm_head.weight` and `d2t` as vLLM does
  (present = the drafter's own), shapes checked; `share_equal` drops an own tensor equal to the
  target's, as vLLM's proposer does (the same computation either way), and says which was used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.models.drafter.config import REQUIRED, DrafterConfig
from dflash.util.errors import CheckpointError

FORMATS = ("hf", "speculators")
RENAMES = (
    ("midlayer.", "layers.0."),
    ("encoder.output_norm_enc.", "hidden_norm."),
    ("encoder.fc.", "fc."),
    ("draft_id_to_target_id", "d2t"),
)
DROPPED = ("t2d",)  # vLLM's loader skips it (the target-to-draft map serves training only)
SPEC_TYPES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "DSparkDraftModel"}
SPEC_DSPARK = {  # speculators' DSpark fields (top level) and their defaults when a config leaves them out
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
}
SPEC_TRAINING = {  # speculators keys that only shape training (or a Domino projector, refused on its own)
    "pure_draft_prefix_len",
    "emb_dim",
    "gru_hidden_dim",
    "lambda_base_start",
    "lambda_base_decay_ratio",
    "auf",
    "speculators_version",
    "has_no_defaults_at_init",
}
DFLASH2_KEYS = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
    "attention_mode",
)


@dataclass(frozen=True)
class Translated:
    fmt: str  # FORMATS
    config: dict[str, Any]  # the canonical HF-format config.json
    state_dict: dict[str, torch.Tensor]  # public HF tensor names
    notes: tuple[str, ...]  # what was read how (logged)


def _refuse(key: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"config key {key}={value!r}: {why}")


def _taps_from_aux(key: str, ids: Any) -> list[int]:
    """vLLM's aux ids (the stream entering layer i) -> DFlash taps (outputs of layer i - 1)."""
    if (
        not isinstance(ids, (list, tuple))
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise _refuse(key, ids, "should be a non-empty list of integers; fix config.json")
    if min(ids) < 1:
        raise _refuse(
            key,
            ids,
            "aux id 0 is the embedding output, which no DFlash tap (a decoder layer's output) "
            "gives; not implemented. Use a drafter trained on decoder layer outputs",
        )
    return [i - 1 for i in ids]


def _vllm_keys(raw: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """An HF-format config with vLLM's qwen3_dflash keys -> the canonical keys (vLLM's precedence)."""
    if not isinstance(raw.get("dflash_config") or {}, dict):
        return dict(raw)  # the parser refuses it, naming the key
    d, dc = dict(raw), dict(raw.get("dflash_config") or {})
    eagle = d.pop("eagle_config", None)
    if eagle is not None:
        if not isinstance(eagle, dict):
            raise _refuse("eagle_config", eagle, "should be a mapping; fix config.json")
        dc = {**eagle, **dc}  # vLLM: eagle_config updated by dflash_config
        notes.append("eagle_config merged under dflash_config (dflash_config wins), as vLLM reads them")
    for where, src in (("dflash_config.", dc), ("", d)):
        if src.get("use_aux_hidden_state") is False:
            raise _refuse(
                f"{where}use_aux_hidden_state",
                False,
                "the drafter reads the target's last hidden state instead "
                "of fc over taps; not implemented. Use a DFlash drafter with taps",
            )
        src.pop("use_aux_hidden_state", None)
    if d.get("add_swa_attention_sink_bias"):
        raise _refuse(
            "add_swa_attention_sink_bias",
            d["add_swa_attention_sink_bias"],
            "attention sinks are not implemented; evaluating without them would measure a different model",
        )
    d.pop("add_swa_attention_sink_bias", None)
    aux, layer_ids = d.pop("eagle_aux_hidden_state_layer_ids", None), dc.pop("layer_ids", None)
    if aux:
        taps = _taps_from_aux("eagle_aux_hidden_state_layer_ids", aux)
        for k, v in (
            ("dflash_config.target_layer_ids", dc.get("target_layer_ids")),
            ("target_layer_ids", d.get("target_layer_ids")),
        ):
            if v is not None and list(v) != taps:
                notes.append(
                    f"{k}={v} ignored: vLLM taps eagle_aux_hidden_state_layer_ids={list(aux)} first (taps {taps})"
                )
        dc["target_layer_ids"], _ = taps, d.pop("target_layer_ids", None)
    elif layer_ids and dc.get("target_layer_ids") is None and d.get("target_layer_ids") is None:
        dc["target_layer_ids"] = _taps_from_aux("dflash_config.layer_ids", layer_ids)
        notes.append(f"dflash_config.layer_ids={list(layer_ids)} are vLLM aux ids: taps {dc['target_layer_ids']}")
    is_causal = d.pop("is_causal", None)
    if is_causal is not None:
        if not isinstance(is_causal, bool):
            raise _refuse("is_causal", is_causal, "should be true or false; fix config.json")
        if dc.get("causal") not in (None, is_causal):
            notes.append(f"dflash_config.causal={dc['causal']} ignored: vLLM reads is_causal={is_causal} first")
        dc["causal"] = is_causal
    use_swa, window = dc.pop("use_swa", False), dc.pop("swa_window_size", None)
    if not isinstance(use_swa, bool):
        raise _refuse("dflash_config.use_swa", use_swa, "should be true or false; fix config.json")
    n = d.get("num_hidden_layers")
    types = d.get("layer_types") or (["full_attention"] * n if isinstance(n, int) else None)
    if use_swa and types is not None and "sliding_attention" not in types:
        d["layer_types"] = types = ["sliding_attention"] * len(types)
        notes.append("dflash_config.use_swa: every layer a sliding_attention layer, as vLLM reads it")
        if not dc.get("causal"):
            dc["causal"] = False  # vLLM's use_swa layers are causal only with dflash_config.causal
            notes.append(
                "dflash_config.use_swa without causal: true: the sliding layers are non-causal (see is_causal below)"
            )
    if window is not None and types is not None and "sliding_attention" in types:
        d["sliding_window"], d["use_sliding_window"] = window, True  # vLLM: swa_window_size before sliding_window
        notes.append(f"dflash_config.swa_window_size={window}: the sliding window, as vLLM reads it")
    if dc.get("causal") is False and types is not None and "sliding_attention" in types:
        notes.append(
            "causal=false with sliding_attention layers: every layer non-causal inside the block, the window still "
            "limiting the context keys (SGLang's and SpecForge's reading of public DFlash2 configs)"
        )
    if dc or "dflash_config" in raw:
        d["dflash_config"] = dc
    return d


def _speculators(raw: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """A speculators config.json -> the canonical HF-format config (then vLLM's keys apply as usual)."""
    from transformers import Qwen3Config

    kind = raw["speculators_model_type"]
    if kind not in SPEC_TYPES:
        raise _refuse(
            "speculators_model_type", kind, f"only {sorted(SPEC_TYPES)} are DFlash drafters this evaluator reads"
        )
    tlc = raw.get("transformer_layer_config")
    if not isinstance(tlc, dict):
        raise _refuse(
            "transformer_layer_config", tlc, "should be the draft layers' Qwen3 config (a mapping); fix config.json"
        )
    rest = {k: v for k, v in raw.items() if k != "transformer_layer_config"}
    anchor = rest.pop("sample_from_anchor", None) if kind == "dspark" else None
    for key, bad, why in (
        ("projector_type", lambda v: v not in (None, "dflash"), "the Domino correction head"),
        ("sample_from_anchor", bool, "drafting the anchor slot too (DSpark's block)"),
        ("shift_label", bool, "predictions shifted by one position (Domino's)"),
    ):
        v = rest.pop(key, None)
        if bad(v):
            raise _refuse(
                key, v, f"switches on {why}, which this evaluator does not implement; use a drafter without it"
            )
    non_causal = rest.pop("sliding_window_non_causal", kind == "dflash2")  # speculators' default
    if not isinstance(non_causal, bool):
        raise _refuse("sliding_window_non_causal", non_causal, "should be true or false; fix config.json")
    cfg: dict[str, Any] = {**{k: v for k, v in tlc.items() if k not in ("architectures", "_name_or_path")}}
    defaults = Qwen3Config()
    for k in (*REQUIRED, "num_key_value_heads", "vocab_size"):
        if cfg.get(k) is None:
            cfg[k] = getattr(defaults, k)  # to_diff_dict left out transformers' default
    cfg["architectures"] = [SPEC_TYPES[kind]]
    dc = {k: rest.pop(k) for k in DFLASH2_KEYS if k in rest}
    if non_causal and "sliding_attention" in (tlc.get("layer_types") or []):
        dc["causal"] = False  # sliding layers non-causal; full layers are so already
    block, mask = rest.pop("block_size", 8), rest.pop("mask_token_id", None)  # speculators' default block: 8
    dc.update({"block_size": block, "mask_token_id": mask})
    spec = rest.pop("speculators_config", None) or {}
    tokens = next(iter(spec.get("proposal_methods") or []), {}).get("speculative_tokens")
    if kind == "dspark":  # the block's B rows: B proposals (sample_from_anchor) or B - 1 (row 0 dropped)
        anchor = _spec_convention(anchor, tokens, block, notes)
        dc["block_size"] = block if anchor else block - 1  # SGLang's gamma
        cfg.update({k: rest.pop(k, v) for k, v in SPEC_DSPARK.items()}, sample_from_anchor=anchor)
    elif tokens is not None and isinstance(block, int) and tokens != block - 1:
        raise _refuse(
            "speculators_config.proposal_methods[0].speculative_tokens",
            tokens,
            f"vLLM proposes that many tokens "
            f"per step, not block_size - 1 = {block - 1} as this evaluator does; not implemented",
        )
    aux = rest.pop("aux_hidden_state_layer_ids", None)
    if aux is None:
        raise _refuse("aux_hidden_state_layer_ids", None, "vLLM requires it (the taps); the checkpoint should store it")
    dc["target_layer_ids"] = _taps_from_aux("aux_hidden_state_layer_ids", aux)
    cfg["dflash_config"] = dc
    for k in ("draft_vocab_size", "target_hidden_size"):
        if rest.get(k) is not None:
            cfg[k] = rest.pop(k)
        rest.pop(k, None)
    verifier = (spec.get("verifier") or {}).get("name_or_path")
    notes.append(
        f"speculators {kind} format: taps = aux_hidden_state_layer_ids - 1 = {dc['target_layer_ids']}"
        + (f"; trained for the verifier {verifier}" if verifier else "")
    )
    for k in ("speculators_model_type", "architectures", "model_type", *SPEC_TRAINING):
        rest.pop(k, None)
    return {**rest, **cfg}  # the rest (dtype, transformers_version, ...) classified by the parser


def _spec_convention(anchor: Any, tokens: Any, block: Any, notes: list[str]) -> bool:
    """A speculators DSpark export's slot convention: its `sample_from_anchor`, else what its proposal count says
    (speculative_tokens = block_size: the anchor convention; block_size - 1: DFlash's, as exports written before
    speculators had the field were trained), else refused."""
    if anchor is not None:
        if not isinstance(anchor, bool):
            raise _refuse("sample_from_anchor", anchor, "should be true or false; fix config.json")
        notes.append(f"speculators dspark: slot convention from sample_from_anchor={anchor}")
        return anchor
    where = "speculators_config.proposal_methods[0].speculative_tokens"
    if isinstance(block, int) and tokens in (block, block - 1):
        notes.append(
            f"speculators dspark without sample_from_anchor: {where}={tokens} with block_size={block} reads as "
            f"sample_from_anchor={tokens == block}"
        )
        return tokens == block
    raise _refuse(
        where,
        tokens,
        f"a speculators DSpark export without sample_from_anchor says its slot convention by its proposal count "
        f"(block_size {block}: the anchor convention, block_size - 1: DFlash's); this one says neither. Set "
        "sample_from_anchor to the convention it was trained in",
    )


def translate(raw: dict[str, Any], sd: dict[str, torch.Tensor], folder: Path | None = None) -> Translated:
    """config.json + tensors of any known format -> the canonical HF format (CheckpointError naming the key)."""
    if not isinstance(raw, dict):
        return Translated("hf", raw, sd, ())
    notes: list[str] = []
    fmt = "speculators" if "speculators_model_type" in raw else "hf"
    cfg = _vllm_keys(_speculators(raw, notes) if fmt == "speculators" else raw, notes)
    if folder is not None and (folder / "mask_embedding.pt").is_file():
        raise CheckpointError(
            f"{folder / 'mask_embedding.pt'}: a separately trained mask embedding (vLLM substitutes it for "
            "the mask token's row) is not implemented; evaluate the drafter without that file only if it was trained so"
        )
    out = {}
    for k, v in sd.items():
        for a, b in RENAMES:  # substrings, as vLLM's WeightsMapper
            k = k.replace(a, b)
        out[k] = v
    t2d, d2t = out.get("t2d"), out.get("d2t")
    if t2d is not None and d2t is not None and t2d.dim() == d2t.dim() == 1 and not d2t.is_floating_point():
        mapped = torch.arange(d2t.shape[0]) + d2t.long()  # vLLM's offsets; speculators' t2d marks the same ids
        if not torch.equal(mapped.sort().values, t2d.bool().nonzero()[:, 0]):
            raise CheckpointError(
                "tensor d2t read as vLLM reads it (target id = i + d2t[i]) does not give the ids tensor t2d "
                "marks: the map is stored in another convention (absolute ids?); not implemented"
            )
    for k in DROPPED:
        if out.pop(k, None) is not None:
            notes.append(f"tensor {k} not read (vLLM skips it)")
    if sorted(out) != sorted(sd):
        notes.append("tensor names mapped as vLLM maps them (midlayer., encoder., draft_id_to_target_id)")
    return Translated(fmt, cfg, out, tuple(notes))


def own_tensors(cfg: DrafterConfig, sd: dict[str, torch.Tensor]) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """vLLM's has_own_embed_tokens / has_own_lm_head / d2t: a tensor present is the drafter's own; checked here."""
    embed, head, d2t = sd.get("embed_tokens.weight"), sd.get("lm_head.weight"), sd.get("d2t")
    vocab = cfg.extra.get("vocab_size", embed.shape[0] if embed is not None else None)
    draft = cfg.draft_vocab_size if cfg.draft_vocab_size is not None else vocab
    if (embed is not None or head is not None or d2t is not None or cfg.draft_vocab_size is not None) and vocab is None:
        raise CheckpointError(
            "config lacks vocab_size (the target's vocabulary), which the drafter's own embedding, LM head "
            "or draft vocabulary is read against; add it to config.json"
        )
    if draft is not None and vocab is not None and draft > vocab:
        raise CheckpointError(f"draft_vocab_size={draft} exceeds vocab_size={vocab}; fix config.json")
    reduced = draft is not None and draft != vocab
    if reduced and cfg.dflash2 is not None:
        raise CheckpointError(
            f"draft_vocab_size={draft} < vocab_size={vocab} in a DFlash2DraftModel: its candidate selector's "
            "codebooks are indexed by target token ids over the full vocabulary, and no engine defines the walk "
            "over a reduced draft vocabulary; not implemented. Use a full-vocabulary DFlash2 drafter"
        )
    if reduced and d2t is None:
        raise CheckpointError(
            f"draft_vocab_size={draft} < vocab_size={vocab} needs the draft-to-target id map tensor d2t "
            f"[{draft}] (vLLM's draft_id_to_target_id); the checkpoint lacks it"
        )
    if reduced and head is None:
        raise CheckpointError(
            f"draft_vocab_size={draft} < vocab_size={vocab} needs the drafter's own lm_head.weight [{draft}, "
            "hidden]; the checkpoint lacks it"
        )
    if d2t is not None:
        if d2t.is_floating_point() or d2t.dim() != 1 or d2t.shape[0] != draft:
            raise CheckpointError(
                f"tensor d2t {d2t.dtype} {tuple(d2t.shape)} should be integer offsets [{draft}] (draft_vocab_size)"
            )
        ids = torch.arange(draft) + d2t.long()
        if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != draft:
            raise CheckpointError(
                f"tensor d2t maps draft ids to target ids outside 0..{vocab - 1} or to one id twice: "
                "it is not a draft-to-target map (i -> i + d2t[i])"
            )
        if not reduced:
            if bool(d2t.any()):
                raise CheckpointError(
                    "tensor d2t maps a full-size draft vocabulary (draft_vocab_size = vocab_size) to other "
                    "ids; vLLM has no map then. Set draft_vocab_size, or drop d2t"
                )
            sd = {k: v for k, v in sd.items() if k != "d2t"}  # the identity map: nothing to apply
    if (cfg.target_hidden_size or cfg.hidden_size) != cfg.hidden_size and (embed is None or head is None):
        raise CheckpointError(
            f"target_hidden_size={cfg.target_hidden_size} != hidden_size={cfg.hidden_size}: the target's "
            "embedding and LM head do not fit the drafter, which then needs its own embed_tokens.weight and "
            "lm_head.weight; the checkpoint lacks them"
        )
    cfg = dataclasses.replace(
        cfg,
        own_embed=embed is not None,
        own_lm_head=head is not None,
        vocab_map=reduced,
        vocab_size=vocab,
        draft_vocab_size=draft if reduced else None,
    )
    return cfg, sd


def share_equal(drafter: Any, target: Any) -> list[str]:
    """vLLM's proposer: an own embedding / LM head equal to the target's is dropped for the target's (the same
    computation); -> what each side uses, for the log."""
    out = []
    for name, theirs in (
        ("embed_tokens", target.model.get_input_embeddings()),
        ("lm_head", target.model.get_output_embeddings()),
    ):
        mine = getattr(drafter, name)
        if mine is None:
            out.append(f"{name}: the target's")
            continue
        w = theirs.weight
        same = getattr(theirs, "bias", None) is None and mine.weight.shape == w.shape
        if same and torch.equal(mine.weight, w.to(mine.weight.device, mine.weight.dtype)):
            setattr(drafter, name, None)
            setattr(drafter.cfg, "own_embed" if name == "embed_tokens" else "own_lm_head", False)  # what is evaluated
            out.append(f"{name}: the target's (the drafter's own equals it, as vLLM shares it then)")
        else:
            out.append(f"{name}: the drafter's own (differs from the target's)")
    return out
