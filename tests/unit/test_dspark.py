"""DSpark read as SGLang 0.5.23 reads it (issue 41 part 1): a folder written in each slot convention is read as
written (SGLang's layout, SpecForge's export with its warning, the speculators format by sample_from_anchor or by
its proposal count); every bad key or tensor is refused naming it (CheckpointError: exit 2, end to end below);
the backbones and variants not implemented are refused by name; a written DSpark config reads back the same."""

from __future__ import annotations

import json

import pytest
import torch
from test_fidelity import B, H, weights, write_drafter
from test_formats import folder, speculators_config

from dflash.models.drafter.checkpoint import read_drafter
from dflash.models.drafter.config import parse_config
from dflash.util.errors import CheckpointError

RANK, VOCAB = 8, 256


def head_sd(kind: str = "vanilla", conf: bool = True, with_markov: bool = True, seed: int = 0) -> dict:
    """Markov (and confidence) head tensors under SGLang's names, for hidden H, rank RANK, vocabulary VOCAB."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    sd = {"markov_head.markov_w1.weight": rnd(VOCAB, RANK), "markov_head.markov_w2.weight": rnd(VOCAB, RANK)}
    if kind == "gated":
        sd |= {"markov_head.gate_proj.weight": rnd(RANK, H + RANK), "markov_head.gate_proj.bias": rnd(RANK)}
    if kind == "rnn":
        sd |= {
            "markov_head.joint_proj.weight": rnd(3 * RANK, 2 * RANK + H),
            "markov_head.joint_proj.bias": rnd(3 * RANK),
        }
    if conf:
        sd |= {
            "confidence_head.proj.weight": rnd(1, H + (RANK if with_markov else 0)),
            "confidence_head.proj.bias": rnd(1),
        }
    return sd


def write_dspark(path, top: dict | None = None, dflash: dict | None = None, sd: dict | None = None, kind="vanilla"):
    """A DSpark folder in SGLang's layout (every DSpark key at the top level): the test drafter's backbone, block 4."""
    keys = {
        "architectures": ["Qwen3DSparkModel"],
        "markov_rank": RANK,
        "markov_head_type": kind,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "sample_from_anchor": True,
    }
    return write_drafter(
        path, top={**keys, **(top or {})}, dflash=dflash, sd={**weights(), **head_sd(kind)} if sd is None else sd
    )


def read(path):
    return read_drafter("hf", "x", path=str(path))


@pytest.mark.parametrize(
    "anchor, rows, proposals", [(True, B, B), (False, B + 1, B), (None, B, B)]
)  # None: the key absent, read as true
def test_each_convention_is_read_as_written(tmp_path, anchor, rows, proposals):
    top = {"sample_from_anchor": anchor} if anchor is not None else {}
    path = write_dspark(tmp_path / "d", top=top)
    if anchor is None:
        raw = json.loads((path / "config.json").read_text())
        raw.pop("sample_from_anchor")
        (path / "config.json").write_text(json.dumps(raw))
    cfg = read(path).config
    assert cfg.arch == "dspark" and cfg.dspark.gamma == B and cfg.dspark.sample_from_anchor is (anchor is not False)
    assert (cfg.block_size, cfg.proposals, cfg.width, cfg.offset) == (
        rows,
        proposals,
        proposals + 1,
        int(not (anchor is not False)),
    )
    again, warns = parse_config(cfg.to_hf())  # written SGLang-buildable: every key at the top level
    assert again.dspark == cfg.dspark and again.block_size == rows and not warns


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("arch", ["Qwen3DSparkModel", "DSparkDraftModel", "LingDSparkModel"])
def test_three_names_one_drafter_three_heads(tmp_path, kind, arch):
    cfg = read(write_dspark(tmp_path / "d", top={"architectures": [arch]}, kind=kind)).config
    assert cfg.dspark.markov_head_type == kind and cfg.dspark.architecture == arch and cfg.dspark.vocab_size == VOCAB


def test_specforge_export_is_read_with_the_lift_warning(tmp_path):
    """SpecForge's `export --to hf`: DSparkDraftModel, the head keys only in dflash_config (SGLang builds from the
    top level only, so it refuses it) and projector_type "dspark"."""
    nested = {
        "markov_rank": RANK,
        "markov_head_type": "GATED",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "confidence_head_alpha": 1.0,
        "projector_type": "dspark",
        "attention_mode": "gqa",
    }
    path = write_drafter(
        tmp_path / "d", top={"architectures": ["DSparkDraftModel"]}, dflash=nested, sd={**weights(), **head_sd("gated")}
    )
    src = read(path)
    assert src.config.dspark.markov_head_type == "gated" and src.config.dspark.sample_from_anchor
    (w,) = [w for w in src.warnings if "not at the top level" in w]
    assert "dflash_config.markov_rank=8" in w and "SGLang 0.5.23" in w and "lifted to the top level" in w


def test_prefixed_keys_and_their_precedence(tmp_path):
    """SGLang's dspark_* keys win: gamma from dspark_block_size, the mask from dspark_noise_token_id."""
    path = write_dspark(tmp_path / "d", top={"dspark_block_size": 3, "dspark_noise_token_id": 7})
    cfg = read(path).config
    assert (cfg.dspark.gamma, cfg.block_size, cfg.mask_token_id) == (3, 3, 7)


@pytest.mark.parametrize(
    "spec, anchor, rows, proposals",
    [
        ({"sample_from_anchor": True}, True, B, B),
        ({"sample_from_anchor": False}, False, B, B - 1),
        ({"speculative_tokens": B}, True, B, B),  # no sample_from_anchor: the proposal count says
        ({"speculative_tokens": B - 1}, False, B, B - 1),  # the exports written before the field existed
    ],
)
def test_speculators_dspark_convention(tmp_path, spec, anchor, rows, proposals):
    raw = speculators_config(tmp_path, "dspark", markov_rank=RANK)
    raw.pop("sample_from_anchor")
    if "sample_from_anchor" in spec:
        raw["sample_from_anchor"] = spec["sample_from_anchor"]
    else:
        raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = spec["speculative_tokens"]
    cfg = read(folder(tmp_path / "d", raw, {**weights(), **head_sd()})).config
    assert cfg.dspark.sample_from_anchor is anchor and (cfg.block_size, cfg.proposals) == (rows, proposals)
    assert cfg.dspark.markov_head_type == "vanilla" and cfg.dspark.confidence  # speculators' defaults


def test_speculators_dspark_without_a_convention_is_refused(tmp_path):
    raw = speculators_config(tmp_path, "dspark", markov_rank=RANK)
    raw.pop("sample_from_anchor")
    raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = B + 3
    with pytest.raises(CheckpointError, match=r"speculative_tokens=7.*Set sample_from_anchor"):
        read(folder(tmp_path / "d", raw, {**weights(), **head_sd()}))


def test_own_embedding_and_lm_head_are_dropped_as_sglang_drops_them(tmp_path):
    """DeepSpec saves frozen copies of the target's embedding and LM head; SGLang's DSpark never reads them."""
    sd = {
        **weights(),
        **head_sd(),
        "embed_tokens.weight": torch.zeros(VOCAB, H),
        "lm_head.weight": torch.zeros(VOCAB, H),
    }
    src = read(write_dspark(tmp_path / "d", sd=sd))
    assert not src.config.own_embed and not src.config.own_lm_head and "lm_head.weight" not in src.state_dict


CONFIG_REFUSALS = {  # name: (top, dflash_config, words the message must hold)
    "markov_rank 0": ({"markov_rank": 0}, None, "markov_rank=0"),
    "markov_rank string": ({"markov_rank": "8"}, None, "markov_rank='8'"),
    "head type": ({"markov_head_type": "lstm"}, None, "markov_head_type='lstm'"),
    "no head type": ({"markov_head_type": None}, None, "lacks markov_head_type"),
    "sample_from_anchor string": ({"sample_from_anchor": "false"}, None, "sample_from_anchor='false'"),
    "confidence string": ({"enable_confidence_head": "yes"}, None, "enable_confidence_head='yes'"),
    "conflict": ({"dspark_markov_rank": 16}, None, "dspark_markov_rank=16, markov_rank=8"),
    "nested conflict": (None, {"markov_head_type": "gated"}, "dflash_config.markov_head_type='gated'"),
    "no block size": ({"block_size": None}, None, "has no block size"),
    "prefixed taps differ": ({"dspark_target_layer_ids": [1, 2, 4]}, None, "dspark_target_layer_ids=[1, 2, 4]"),
    "domino": (None, {"projector_type": "domino"}, "projector_type='domino'"),
    "other projector": (None, {"projector_type": "mlp"}, "projector_type='mlp'"),
    "mla": (None, {"attention_mode": "mla"}, "attention_mode='mla'"),
    "selector": (None, {"selector_rank": 8}, "dflash_config.selector_rank=8"),
    "softcap": (None, {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    "conv without group": (None, {"conv_kernel_size": 2}, "conv_kernel_size=2 and conv_group_size=None"),
    "conv past the model block": (
        {"sample_from_anchor": False},
        {"conv_kernel_size": 2, "conv_group_size": 16, "block_size": B},
        "exceed the model's block size",
    ),
    "conv kernel past rows": (None, {"conv_kernel_size": 6, "conv_group_size": 16}, "conv_kernel_size 6 exceeds"),
    "mask token string": ({"mask_token_id": None}, {"mask_token_id": None, "mask_token": "<m>"}, "mask_token='<m>'"),
    "unknown dspark_config key": ({"dspark_config": {"block_size": 4}}, None, "dspark_config.block_size=4"),
    "nemotron": ({"has_embed_tokens": True}, None, "Nemotron-3.5"),
    "dspark key on dflash": ({"architectures": ["DFlashDraftModel"]}, None, "are DSpark's"),
    "sample_from_anchor true on dflash": (
        {
            "architectures": ["DFlashDraftModel"],
            "markov_rank": None,
            "markov_head_type": None,
            "enable_confidence_head": None,
            "confidence_head_with_markov": None,
        },
        None,
        "sample_from_anchor=True",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_REFUSALS))
def test_bad_key_is_refused_naming_it(tmp_path, case):
    top, dflash, words = CONFIG_REFUSALS[case]
    path = write_dspark(tmp_path / "d", top=top, dflash=dflash)
    with pytest.raises(CheckpointError) as e:
        read(path)
    assert words in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "arch",
    [
        "DeepseekV4ForCausalLMDSpark",
        "DeepseekV4ForCausalLM",
        "DSparkMiniMaxDraftModel",
        "Lfm2DSparkDraftModel",
        "Glm5DSparkForCausalLM",
        "Gemma4DSparkModel",
        "DSparkV4DraftModel",
    ],
)
def test_backbones_not_implemented_are_refused_by_name(tmp_path, arch):
    with pytest.raises(CheckpointError, match=f"architectures=\\['{arch}'\\]: .*not implemented"):
        read(write_dspark(tmp_path / "d", top={"architectures": [arch]}))


def _without(*names: str, kind: str = "vanilla", extra: dict | None = None) -> dict:
    sd = {**weights(), **head_sd(kind), **(extra or {})}
    return {k: v for k, v in sd.items() if k not in names}


TENSOR_REFUSALS = {  # name: (kind, state dict, words)
    "missing w2": ("vanilla", _without("markov_head.markov_w2.weight"), "missing ['markov_head.markov_w2.weight']"),
    "missing gate": ("gated", _without("markov_head.gate_proj.weight", kind="gated"), "'markov_head.gate_proj.weight'"),
    "missing confidence": ("vanilla", _without("confidence_head.proj.bias"), "set it to false"),
    "unused gate": (
        "vanilla",
        _without(extra={"markov_head.gate_proj.weight": torch.zeros(RANK, H + RANK)}),
        "not consumed by that drafter (refused: it would compute something else) ['markov_head.gate_proj.weight']",
    ),
    "legacy names": (
        "vanilla",
        {
            **_without("markov_head.markov_w1.weight"),
            "logit_head.markov_head.markov_w1.weight": torch.zeros(VOCAB, RANK),
        },
        "SpecForge's legacy names",
    ),
    "w1 shape": (
        "vanilla",
        {**_without(), "markov_head.markov_w2.weight": torch.zeros(VOCAB, RANK + 1)},
        "markov_head.markov_w2.weight: checkpoint (256, 9) vs model (256, 8)",
    ),
    "confidence without markov input": (
        "vanilla",
        {**_without(), "confidence_head.proj.weight": torch.zeros(1, H)},
        "confidence_head.proj.weight: checkpoint (1, 64) vs model (1, 72)",
    ),
    "nan": (
        "vanilla",
        {**_without(), "markov_head.markov_w1.weight": torch.full((VOCAB, RANK), float("nan"))},
        "non-finite",
    ),
}


@pytest.mark.parametrize("case", list(TENSOR_REFUSALS))
def test_bad_tensor_is_refused_naming_it(tmp_path, case):
    kind, sd, words = TENSOR_REFUSALS[case]
    with pytest.raises(CheckpointError) as e:
        read(write_dspark(tmp_path / "d", sd=sd, kind=kind))
    assert words in str(e.value), str(e.value)


def test_a_disabled_confidence_head_needs_no_tensors_and_refuses_them(tmp_path):
    sd = _without("confidence_head.proj.weight", "confidence_head.proj.bias")
    assert (
        read(write_dspark(tmp_path / "a", top={"enable_confidence_head": False}, sd=sd)).config.dspark.confidence
        is False
    )
    with pytest.raises(CheckpointError, match="enable_confidence_head is false: set it to true"):
        read(write_dspark(tmp_path / "b", top={"enable_confidence_head": False}))


def test_a_bad_dspark_folder_exits_2_naming_the_key(tmp_path):
    """End to end: `evaluate.py` exits 2 with the key named and no traceback, before any target weight loads."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    path = write_dspark(tmp_path / "d", top={"markov_head_type": "lstm"})
    cmd = [
        sys.executable,
        str(root / "evaluate.py"),
        "target=local",
        f"target.path={tmp_path / 'no-target'}",
        "drafter=hf",
        f"drafter.path={path}",
        "tracking.enabled=false",
        f"hydra.run.dir={tmp_path}/out",
    ]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "markov_head_type='lstm'" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
