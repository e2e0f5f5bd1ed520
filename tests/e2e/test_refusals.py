"""What the evaluator does not implement is refused (issue 12 part 6, issue 13 parts 2, 5, 8):
each a CheckpointError naming the key or tensor, raised by phase 1 (`read_drafter`: no target at
all), and end to end: `evaluate.py` exits 2 before the target's weights are read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_fidelity import weights, write_drafter

from dflash.models.drafter.checkpoint import fit_drafter, read_drafter
from dflash.models.drafter.files import save_hf_folder
from dflash.util.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[2]

CONFIG_REFUSALS = {  # name: (write_drafter kwargs, words the message must hold)
    "projector_type": ({"top": {"projector_type": "mlp"}}, "projector_type='mlp'"),
    "conv_kernel_size": ({"dflash": {"conv_kernel_size": 4}}, "dflash_config.conv_kernel_size=4"),
    "selector_rank": ({"dflash": {"selector_rank": 8}}, "dflash_config.selector_rank=8"),
    "output_multiplier": ({"top": {"output_multiplier": 2.0}}, "output_multiplier=2.0"),
    "final_logit_softcapping": ({"top": {"final_logit_softcapping": 30.0}}, "final_logit_softcapping=30.0"),
    "attention_sink_bias": ({"top": {"attention_sink_bias": True}}, "attention_sink_bias=True"),
    "attention_value_scale": ({"top": {"attention_value_scale": 0.5}}, "attention_value_scale=0.5"),
    "has_embed_tokens": ({"top": {"has_embed_tokens": True}}, "has_embed_tokens=True"),
    "quantization_config": ({"top": {"quantization_config": {"quant_method": "fp8"}}}, "quantization_config="),
    "input_embedding_scale": ({"dflash": {"input_embedding_scale": 2.0}}, "input_embedding_scale=2.0"),
    "non-causal window inside the block": (
        {
            "top": {"is_causal": False},
            "qwen3": {
                "layer_types": ["sliding_attention", "full_attention"],
                "sliding_window": 3,
                "use_sliding_window": True,
            },
        },
        "causal=false with sliding_window=3 < block_size",
    ),
    "mlp_bias": ({"top": {"mlp_bias": True}}, "mlp_bias=True"),
    "hidden_act": ({"qwen3": {"hidden_act": "gelu"}}, "hidden_act='gelu'"),
    "partial_rotary_factor": ({"top": {"partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5"),
    "rope type": (
        {"qwen3": {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}},
        "proportional",
    ),
    "window without use_sliding_window": (
        {"qwen3": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}},
        "use_sliding_window: true",
    ),
    "unknown key": ({"top": {"frobnicate": 3}}, "unknown config key frobnicate=3"),
    "model_type": ({"top": {"model_type": "llama"}}, "model_type='llama'"),
    "architectures": ({"top": {"architectures": ["Eagle3DraftModel"]}}, "Eagle3DraftModel"),
    "string for an int": ({"top": {"hidden_size": "64"}}, "hidden_size='64' should be an integer"),
    "taps not a list": (
        {"dflash": {"target_layer_ids": "1,2,3"}},
        "dflash_config.target_layer_ids='1,2,3' should be a non-empty list",
    ),
    "float block size": ({"dflash": {"block_size": 16.5}}, "dflash_config.block_size=16.5 should be an integer"),
    "bool for an int": ({"dflash": {"mask_token_id": True}}, "dflash_config.mask_token_id=True should be an integer"),
    "rope not a mapping": ({"top": {"rope_parameters": "yarn"}}, "rope_parameters='yarn' should be a mapping"),
}


@pytest.mark.parametrize("case", list(CONFIG_REFUSALS))
def test_config_refusal_names_the_key(tmp_path, case):
    kw, words = CONFIG_REFUSALS[case]
    folder = write_drafter(tmp_path / "d", **kw)
    with pytest.raises(CheckpointError) as e:
        read_drafter("hf", "x", path=str(folder))  # phase 1: no target anywhere
    assert words in str(e.value) and str(folder) in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "kw",
    [
        {
            "top": {
                "output_multiplier": 1.0,
                "final_logit_softcapping": None,
                "has_embed_tokens": False,
                "is_causal": False,
                "rope_is_neox_style": True,
                "frobnicate": None,
                "extra_flag": False,
                "partial_rotary_factor": 1.0,
            }
        },
        {"dflash": {"conv_kernel_size": None, "input_embedding_scale": 1}},
    ],
)
def test_off_values_pass(tmp_path, kw):
    assert read_drafter("hf", "x", path=str(write_drafter(tmp_path / "d", **kw))).config.block_size == 4


def _tensors(tmp_path, change) -> str:
    sd = weights()
    change(sd)
    with pytest.raises(CheckpointError) as e:
        read_drafter("hf", "x", path=str(write_drafter(tmp_path / "d", sd=sd)))
    return str(e.value)


def test_tensors_not_consumed_are_refused_and_listed(tmp_path):
    msg = _tensors(
        tmp_path, lambda sd: sd.update({"verifier_norm.weight": torch.zeros(64), "mask_hidden": torch.zeros(64)})
    )
    assert "not consumed" in msg and "'verifier_norm.weight'" in msg and "'mask_hidden'" in msg


def test_bias_tensors_without_attention_bias(tmp_path):
    msg = _tensors(tmp_path, lambda sd: sd.update({"layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    assert "'layers.0.self_attn.q_proj.bias'" in msg and "attention_bias: true" in msg


def test_missing_tensors_are_refused_and_listed(tmp_path):
    msg = _tensors(tmp_path, lambda sd: [sd.pop(k) for k in ("layers.1.mlp.up_proj.weight", "norm.weight")])
    assert "missing ['layers.1.mlp.up_proj.weight', 'norm.weight']" in msg


def test_rotary_caches_are_ignored(tmp_path):
    sd = weights()
    sd["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(
        8
    )  # transformers' old persistent buffer: recomputed from the config
    assert read_drafter("hf", "x", path=str(write_drafter(tmp_path / "d", sd=sd))).config is not None


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_name_the_tensor(tmp_path, bad):
    msg = _tensors(tmp_path, lambda sd: sd["layers.1.self_attn.k_proj.weight"].view(-1)[5].fill_(bad))
    assert "non-finite" in msg and "layers.1.self_attn.k_proj.weight" in msg


def test_folder_with_both_formats(tmp_path, qwen3_target, make_drafter):
    folder = write_drafter(tmp_path / "d")
    torch.save({"model": {}}, folder / "checkpoint.pt")
    with pytest.raises(
        CheckpointError, match=r"both a torch pickle \(checkpoint.pt\) and safetensors \(model.safetensors\).*Keep one"
    ):
        read_drafter("hf", "x", path=str(folder))
    run = tmp_path / "run" / "step_3"  # a training step folder, likewise
    save_hf_folder(make_drafter(qwen3_target), run)
    torch.save({"model": {}}, run / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="both a torch pickle"):
        read_drafter("training", "x", run_dir=str(tmp_path / "run"))


def test_legacy_non_zip_pickle_says_how_to_convert(tmp_path, qwen3_target, make_drafter):
    d = make_drafter(qwen3_target)
    path = tmp_path / "run" / "step_1" / "checkpoint.pt"
    path.parent.mkdir(parents=True)
    torch.save({"model": d.state_dict(), "config": d.cfg.to_hf()}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="legacy \\(non-zip\\) torch checkpoint.*torch.save\\(torch.load") as e:
        read_drafter("training", "x", run_dir=str(tmp_path / "run"))
    assert str(path) in str(e.value)


def test_pickle_with_code_is_still_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path = tmp_path / "run" / "step_1" / "checkpoint.pt"
    path.parent.mkdir(parents=True)
    torch.save({"model": {"x": torch.zeros(1)}, "payload": Evil()}, path)
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        read_drafter("training", "x", run_dir=str(tmp_path / "run"))


def test_fit_refuses_a_drafter_of_another_target_before_its_weights(qwen3_target, tmp_path):
    """Phase 2 needs only the target's config and tokenizer (a TargetInfo does)."""
    from dflash.models.target.model import inspect_target

    info = inspect_target("hf", str(qwen3_target.info.weights if qwen3_target.info else qwen3_target.source))
    src = read_drafter("hf", "x", path=str(write_drafter(tmp_path / "d", dflash={"target_layer_ids": [1, 2, 9]})))
    with pytest.raises(CheckpointError, match=r"taps \[9\] are outside the target's decoder layers 0..5"):
        fit_drafter(src, info)


# --- end to end: exit 2 before the target's weights are read --------------------------------------


@pytest.fixture(scope="module")
def broken_target(tmp_path_factory, qwen3_dir) -> Path:
    """The tiny Qwen3 target's config and tokenizer, with a weights file that cannot load."""
    import shutil

    folder = tmp_path_factory.mktemp("broken_target")
    for f in qwen3_dir.iterdir():
        shutil.copy(f, folder / f.name)
    (folder / "model.safetensors").write_bytes(b"\x00not safetensors\xff" * 64)
    return folder


def _evaluate(tmp: Path, target: Path, drafter: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DFLASH_CACHE_DIR": str(tmp / "cache"), "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        str(ROOT / "evaluate.py"),
        "target=local",
        f"target.path={target}",
        "drafter=hf",
        f"drafter.path={drafter}",
        "prompts.num_prompts=1",
        "prompts.max_new_tokens=8",
        "tracking.enabled=false",
        f"cache_dir={tmp / 'cache'}",
        f"hydra.run.dir={tmp}/out",
    ]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_refused_drafter_exits_2_before_the_target_weights_load(tmp_path, broken_target):
    refused = write_drafter(tmp_path / "refused", top={"projector_type": "mlp"})  # phase 1
    other = write_drafter(
        tmp_path / "other", dflash={"mask_token": "<|MASK|>"}, drop=("dflash_config.mask_token_id",)
    )  # phase 2
    good = write_drafter(tmp_path / "good")
    for drafter, words in ((refused, "projector_type='mlp'"), (other, "mask_token '<|MASK|>' is not a single token")):
        r = _evaluate(tmp_path, broken_target, drafter)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    # the control: with a drafter that passes, the same command reaches the broken weights and fails there
    r = _evaluate(tmp_path, broken_target, good)
    assert r.returncode != 0 and "projector_type" not in r.stderr and "safetensors" in (r.stderr + r.stdout).lower(), (
        r.stderr[-2000:]
    )


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
        {
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "original_max_position_embeddings": 32,
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
        },
    ],
)
def test_length_dependent_rope_past_its_limit(qwen3_target, tmp_path, rope):
    """dynamic / longrope past max_position_embeddings / original_max_position_embeddings (32 here):
    transformers' result depends on the loop's history there; refused, before the target loads when
    the lengths are known (fit_drafter's max_len), else at the forward."""
    folder = write_drafter(
        tmp_path / "d",
        {"rope_parameters": rope, "max_position_embeddings": 32 if rope["rope_type"] == "dynamic" else 64},
    )
    src = read_drafter("hf", "x", path=str(folder))
    fit_drafter(src, qwen3_target, max_len=20)  # 20 + a block of 4 stays within 32
    with pytest.raises(CheckpointError, match=f"{rope['rope_type']} rope limit of 32 positions"):
        fit_drafter(src, qwen3_target, max_len=30)
    from dflash.models.drafter.checkpoint import build_drafter

    model = build_drafter(fit_drafter(src, qwen3_target)).model
    with torch.no_grad():
        model(torch.zeros(1, 20, 3 * 64), torch.zeros(1, 1, 4, 64), torch.tensor([[20]]))
        with pytest.raises(CheckpointError, match="position 32 is past"):
            model(torch.zeros(1, 30, 3 * 64), torch.zeros(1, 1, 4, 64), torch.tensor([[29]]))
