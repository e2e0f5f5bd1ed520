"""Drafters as the field writes them (issue 12): folders written by transformers' own `Qwen3Config`
(`save_pretrained`) plus safetensors written here, loaded by the evaluator, against transformers.

- every rope form (rope_parameters default / linear / dynamic / yarn / longrope / llama3, legacy
  rope_theta + rope_scaling): the same cos/sin as transformers' `Qwen3RotaryEmbedding`, and the
  same drafter output as `reference_forward`, a straightforward forward written here from
  transformers' Qwen3 components over [context keys + block keys];
- q/k/v/o biases loaded and used; a window of 4 on a 20-token context (SGLang's convention),
  `sliding_window="ignore"` = full attention; batched anchors = single anchors with windows;
- dflash_config precedence and its warning, mask_token resolution, default taps.
Refusals have their own file (tests/e2e/test_refusals.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import MASK_ID
from shortcuts import load_drafter

from dflash.models.drafter.checkpoint import fit_drafter, read_drafter
from dflash.util.errors import CheckpointError

H, HEADS, KV, D, FFN, LAYERS, B, TAPS = 64, 4, 2, 16, 96, 2, 4, [1, 2, 3]


def weights(seed: int = 0, bias: bool = False, taps: int = len(TAPS)) -> dict[str, torch.Tensor]:
    """Random weights under the public names (docs/family.md §5); large enough that everything shows."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    norm = lambda n: 1 + 0.1 * torch.randn(n, generator=g)  # noqa: E731
    sd = {"fc.weight": rnd(H, taps * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        shapes = {"q": (HEADS * D, H), "k": (KV * D, H), "v": (KV * D, H), "o": (H, HEADS * D)}
        for n, s in shapes.items():
            sd[f"{p}self_attn.{n}_proj.weight"] = rnd(*s)
            if bias:
                sd[f"{p}self_attn.{n}_proj.bias"] = rnd(s[0])
        sd.update(
            {
                f"{p}self_attn.q_norm.weight": norm(D),
                f"{p}self_attn.k_norm.weight": norm(D),
                f"{p}mlp.gate_proj.weight": rnd(FFN, H),
                f"{p}mlp.up_proj.weight": rnd(FFN, H),
                f"{p}mlp.down_proj.weight": rnd(H, FFN),
                f"{p}input_layernorm.weight": norm(H),
                f"{p}post_attention_layernorm.weight": norm(H),
            }
        )
    return sd


def write_drafter(
    folder: Path,
    qwen3: dict | None = None,
    top: dict | None = None,
    dflash: dict | None = None,
    drop: tuple[str, ...] = (),
    sd: dict | None = None,
    bias: bool = False,
) -> Path:
    """`Qwen3Config(...).save_pretrained(folder)` + DFlash's keys (`top`, `dflash`), `drop`ped keys, safetensors."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    kw = dict(
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=D,
        intermediate_size=FFN,
        max_position_embeddings=512,
        vocab_size=256,
        attention_bias=bias,
    )
    Qwen3Config(**{**kw, **(qwen3 or {})}).save_pretrained(folder)
    d = json.loads((folder / "config.json").read_text())
    d.update(
        {
            "architectures": ["DFlashDraftModel"],
            "block_size": B,
            "num_target_layers": 6,
            "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": TAPS, **(dflash or {})},
            **(top or {}),
        }
    )
    for k in drop:
        d.pop(k, None) if "." not in k else d[k.split(".")[0]].pop(k.split(".")[1], None)
    (folder / "config.json").write_text(json.dumps(d))
    save_file(weights(bias=bias) if sd is None else sd, str(folder / "model.safetensors"))
    return folder


def reference_forward(
    folder: Path, taps: torch.Tensor, emb: torch.Tensor, p: int, window: bool = True, causal: bool = True
) -> torch.Tensor:
    """One block at anchor p, from transformers' Qwen3 components: taps [p, n*H] (context t < p),
    emb [B, H] -> final-normed hidden [B, H]. Keys: the fused context through each layer's
    k_proj/k_norm/v_proj at positions 0..p-1, then the block at p..p+B-1; full-attention layers
    see every key, sliding ones (window w) keys at positions k <= q with q - k < w (without `causal`:
    every k with q - k < w, later block slots too). DFlash2's convolution tensors are not read."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3DecoderLayer,
        Qwen3RMSNorm,
        Qwen3RotaryEmbedding,
        apply_rotary_pos_emb,
        repeat_kv,
    )

    cfg = Qwen3Config.from_pretrained(folder)
    sd = load_file(str(folder / "model.safetensors"))
    fc = torch.nn.Linear(taps.shape[-1], H, bias=False)
    fc.weight.data = sd["fc.weight"]
    hidden_norm, norm = Qwen3RMSNorm(H, cfg.rms_norm_eps), Qwen3RMSNorm(H, cfg.rms_norm_eps)
    hidden_norm.weight.data, norm.weight.data = sd["hidden_norm.weight"], sd["norm.weight"]
    ctx = hidden_norm(fc(taps))  # [p, H]
    pos = torch.arange(p + B)  # context positions, then the block's
    cos, sin = Qwen3RotaryEmbedding(cfg)(emb[None], pos[None])  # [1, p+B, D], attention scaling included
    qpos, kpos = pos[p:, None], pos[None, :]
    x = emb
    for i in range(cfg.num_hidden_layers):
        layer = Qwen3DecoderLayer(cfg, i)
        layer.load_state_dict(
            {k[len(f"layers.{i}.") :]: v for k, v in sd.items() if k.startswith(f"layers.{i}.") and "_conv." not in k}
        )
        a, h = layer.self_attn, layer.input_layernorm(x)
        kv_in = torch.cat([ctx, h])  # [p+B, H]
        q = a.q_norm(a.q_proj(h).view(B, -1, D)).transpose(0, 1)[None]  # [1, nh, B, D]
        k = a.k_norm(a.k_proj(kv_in).view(p + B, -1, D)).transpose(0, 1)[None]
        v = a.v_proj(kv_in).view(p + B, -1, D).transpose(0, 1)[None]
        q, _ = apply_rotary_pos_emb(q, q, cos[:, p:], sin[:, p:])
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        k, v = repeat_kv(k, a.num_key_value_groups), repeat_kv(v, a.num_key_value_groups)
        scores = q @ k.transpose(-1, -2) * a.scaling  # [1, nh, B, p+B]
        if window and cfg.layer_types[i] == "sliding_attention":
            visible = ((kpos <= qpos) | (not causal)) & (qpos - kpos < cfg.sliding_window)
            scores = scores.masked_fill(~visible, float("-inf"))
        o = (scores.softmax(-1) @ v)[0].transpose(0, 1).reshape(B, -1)
        x = x + a.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return norm(x)


def inputs(p: int = 20, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(p, len(TAPS) * H, generator=g), torch.randn(B, H, generator=g)


def ours(model, taps, emb, p):
    with torch.no_grad():
        return model(taps[None], emb[None, None], torch.tensor([[p]]))[0, 0]


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": YARN,
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 256,
        "short_factor": [1.0 + 0.1 * i for i in range(D // 2)],
        "long_factor": [2.0 + 0.5 * i for i in range(D // 2)],
    },
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}
FORMS = {
    **{f"rope_parameters {k}": ({"rope_parameters": v}, {}, ()) for k, v in ROPES.items()},
    "legacy rope_theta + rope_scaling yarn": (
        {},
        {
            "rope_theta": 50000.0,
            "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256},
        },
        ("rope_parameters",),
    ),
    "legacy rope_theta only": ({}, {"rope_theta": 100000.0}, ("rope_parameters",)),
    "yarn + biases + a sliding layer": (
        {
            "rope_parameters": YARN,
            "layer_types": ["sliding_attention", "full_attention"],
            "use_sliding_window": True,
            "sliding_window": 4,
        },
        {},
        (),
    ),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_config_forms_match_transformers(qwen3_target, tmp_path, form):
    qwen3, top, drop = FORMS[form]
    bias = "biases" in form
    folder = write_drafter(tmp_path / "d", qwen3, top, drop=drop, bias=bias)
    model = load_drafter(qwen3_target, "hf", "x", path=str(folder)).model
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    pos = torch.arange(0, 250, 7)[None]  # past yarn's and llama3's original length, within longrope's limit
    want = Qwen3RotaryEmbedding(Qwen3Config.from_pretrained(folder))(torch.zeros(1), pos)
    got = model.rotary(pos, torch.float32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if form.startswith("rope_parameters yarn") or "biases" in form:
        assert model.rotary.scaling == pytest.approx(
            0.1 * torch.log(torch.tensor(4.0)).item() + 1
        )  # yarn's attention factor
    taps, emb = inputs()
    torch.testing.assert_close(
        ours(model, taps, emb, 20), reference_forward(folder, taps, emb, 20), atol=2e-5, rtol=1e-5
    )


def test_rope_forms_differ(qwen3_target, tmp_path):
    """The forms are not all the same computation (so matching transformers above means something)."""
    outs = {}
    taps, emb = inputs()
    for name in ("default", "linear", "yarn", "llama3"):
        model = load_drafter(
            qwen3_target, "hf", "x", path=str(write_drafter(tmp_path / name, {"rope_parameters": ROPES[name]}))
        ).model
        outs[name] = ours(model, taps, emb, 20)
    names = list(outs)
    assert all((outs[a] - outs[b]).abs().max() > 1e-3 for i, a in enumerate(names) for b in names[i + 1 :])


def test_biases_are_loaded_and_used(qwen3_target, tmp_path):
    sd = weights(bias=True)
    model = load_drafter(qwen3_target, "hf", "x", path=str(write_drafter(tmp_path / "a", sd=sd, bias=True))).model
    assert torch.equal(model.layers[1].self_attn.v_proj.bias, sd["layers.1.self_attn.v_proj.bias"])
    taps, emb = inputs()
    base = ours(model, taps, emb, 20)
    for name in ("q", "k", "v", "o"):
        changed = dict(sd)
        changed[f"layers.0.self_attn.{name}_proj.bias"] = sd[f"layers.0.self_attn.{name}_proj.bias"] + 0.5
        other = load_drafter(
            qwen3_target, "hf", "x", path=str(write_drafter(tmp_path / name, sd=changed, bias=True))
        ).model
        assert (ours(other, taps, emb, 20) - base).abs().max() > 1e-3, f"{name}_proj.bias changes nothing"


SLIDING = {"layer_types": ["sliding_attention", "sliding_attention"], "use_sliding_window": True, "sliding_window": 4}


def test_window_of_4_on_a_20_token_context(qwen3_target, tmp_path):
    folder = write_drafter(tmp_path / "w", SLIDING)
    full = write_drafter(tmp_path / "f")  # same weights, full attention
    model = load_drafter(qwen3_target, "hf", "w", path=str(folder)).model
    assert model.windows == [4, 4]
    taps, emb = inputs(p=20)
    out = ours(model, taps, emb, 20)
    torch.testing.assert_close(out, reference_forward(folder, taps, emb, 20), atol=2e-5, rtol=1e-5)
    # what a query sees (the mask itself: tests/unit/test_drafter.py): slot i at position 20 + i sees context
    # 17 + i .. 19 and slots 0..i; through both layers, nothing before position 17 reaches any slot
    early = taps.clone()
    early[:17] += 5.0
    assert torch.equal(ours(model, early, emb, 20), out)
    late = taps.clone()
    late[17] += 1.0  # inside slot 0's window (20 - 17 < 4)
    assert (ours(model, late, emb, 20) - out).abs().max() > 1e-4
    later_slot = emb.clone()
    later_slot[3] += 1.0  # causal inside the block: slots 0..2 do not see slot 3
    diff = (ours(model, taps, later_slot, 20) - out).abs().amax(-1)
    assert diff[:3].max() < 1e-6 and diff[3] > 1e-4
    # ignore: the sliding layers are full attention, exactly as a full-attention config
    ignored = load_drafter(qwen3_target, "hf", "w", path=str(folder), sliding_window="ignore").model
    assert ignored.windows == [None, None]
    want = ours(load_drafter(qwen3_target, "hf", "f", path=str(full)).model, taps, emb, 20)
    assert torch.equal(ours(ignored, taps, emb, 20), want)
    assert (out - want).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_batched_anchors_equal_single_anchors_with_a_window(qwen3_target, tmp_path, backend):
    model = load_drafter(
        qwen3_target,
        "hf",
        "w",
        path=str(write_drafter(tmp_path / "w", {**SLIDING, "layer_types": ["sliding_attention", "full_attention"]})),
    ).model
    g = torch.Generator().manual_seed(3)
    T, anchors = 24, [[2, 7, 8, 19, 23]]
    taps, emb = torch.randn(1, T, len(TAPS) * H, generator=g), torch.randn(1, len(anchors[0]), B, H, generator=g)
    with torch.no_grad():
        batched = model(taps, emb, torch.tensor(anchors), backend=backend)
        for n, p in enumerate(anchors[0]):
            single = model(taps[:, :p], emb[:, n : n + 1], torch.tensor([[p]]), backend=backend)
            torch.testing.assert_close(batched[0, n], single[0, 0], atol=1e-5, rtol=1e-4)


def test_dynamic_rope_warns_that_the_serving_engines_compute_another_base(tmp_path):
    """transformers: the unscaled base within max_position_embeddings; SGLang / vLLM: a base scaled for
    max_position_embeddings * factor at every position. The run says which one it evaluates."""
    src = read_drafter("hf", "x", path=str(write_drafter(tmp_path / "d", {"rope_parameters": ROPES["dynamic"]})))
    (w,) = src.warnings
    served = 10000.0 * (2.0 * 2.0 - 2.0 + 1) ** (D / (D - 2))  # factor 2
    assert "evaluated as transformers computes it" in w and f"fixed base {served:.6g}" in w
    for name in (
        "default",
        "linear",
        "yarn",
        "longrope",
        "llama3",
    ):  # where transformers and the engines agree: no warning
        other = read_drafter("hf", "x", path=str(write_drafter(tmp_path / name, {"rope_parameters": ROPES[name]})))
        assert other.warnings == [], name


@pytest.mark.parametrize(
    "extra, hf", [({"attention_factor": 0.8}, "0.8"), ({"mscale": 1.0, "mscale_all_dim": 0.5}, "1.06482")]
)
def test_yarn_attention_keys_the_engines_ignore_are_named(tmp_path, extra, hf):
    """transformers' yarn honours attention_factor / mscale; SGLang's and vLLM's read neither (0.1 ln 4 + 1)."""
    src = read_drafter("hf", "x", path=str(write_drafter(tmp_path / "d", {"rope_parameters": {**YARN, **extra}})))
    (w,) = src.warnings
    assert f"attention scaling {hf} as transformers computes it" in w and f"apply {0.1 * math.log(4.0) + 1:.6g}" in w


# --- DFlash's own fields ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, top, inner",
    [
        ("block_size", 16, 8),
        ("mask_token_id", 7, MASK_ID),
        ("target_layer_ids", [0, 1, 2], TAPS),
        ("num_target_layers", 36, 6),
    ],
)
def test_dflash_config_wins_with_a_warning(tmp_path, field, top, inner):
    src = read_drafter("hf", "x", path=str(write_drafter(tmp_path / "d", top={field: top}, dflash={field: inner})))
    assert getattr(src.config, field) == inner
    (w,) = src.warnings
    assert (
        f"{field}={top!r}" in w and f"dflash_config.{field}={inner!r}" in w and f"using dflash_config's {inner!r}" in w
    )
    same = read_drafter("hf", "x", path=str(write_drafter(tmp_path / "s", top={field: inner}, dflash={field: inner})))
    assert same.warnings == [] and getattr(same.config, field) == inner


def test_top_level_fields_are_read_when_dflash_config_lacks_them(tmp_path):
    folder = write_drafter(
        tmp_path / "d", top={"mask_token_id": 9, "target_layer_ids": TAPS}, dflash={}, drop=("dflash_config",)
    )
    src = read_drafter("hf", "x", path=str(folder))
    assert (src.config.mask_token_id, src.config.target_layer_ids, src.warnings) == (9, TAPS, [])


def test_mask_token_resolves_through_the_target_tokenizer(qwen3_target, tmp_path):
    folder = write_drafter(tmp_path / "d", dflash={"mask_token": "t249"}, drop=("dflash_config.mask_token_id",))
    src = read_drafter("hf", "x", path=str(folder))
    assert src.config.mask_token_id is None and src.config.mask_token == "t249"
    assert fit_drafter(src, qwen3_target).config.mask_token_id == 249
    bad = read_drafter(
        "hf",
        "x",
        path=str(
            write_drafter(tmp_path / "b", dflash={"mask_token": "<|MASK|>"}, drop=("dflash_config.mask_token_id",))
        ),
    )
    with pytest.raises(
        CheckpointError, match=r"mask_token '<\|MASK\|>' is not a single token of the target's tokenizer"
    ):
        fit_drafter(bad, qwen3_target)


def test_default_taps_are_the_public_rule_for_the_target(qwen3_target, tmp_path):
    """No target_layer_ids: one tap per draft layer over the target's layers (6 layers, 2 draft layers: [1, 3])."""
    folder = write_drafter(tmp_path / "d", drop=("dflash_config.target_layer_ids",), sd=weights(taps=LAYERS))
    src = read_drafter("hf", "x", path=str(folder))
    assert src.config.target_layer_ids is None
    got = load_drafter(qwen3_target, "hf", "x", path=str(folder)).model.cfg
    assert got.target_layer_ids == [1, 3] and got.num_taps == LAYERS


def test_effective_config_records_what_was_evaluated(qwen3_target, tmp_path):
    from dflash.models.drafter.config import effective_config

    folder = write_drafter(tmp_path / "d", {"rope_parameters": YARN, **SLIDING}, bias=True)
    cfg = load_drafter(qwen3_target, "hf", "x", path=str(folder)).model.cfg
    e = effective_config(cfg)
    assert {
        k: e[k] for k in ("block_size", "target_layer_ids", "mask_token_id", "num_layers", "head_dim", "attention_bias")
    } == {
        "block_size": B,
        "target_layer_ids": TAPS,
        "mask_token_id": MASK_ID,
        "num_layers": LAYERS,
        "head_dim": D,
        "attention_bias": True,
    }
    assert (e["rope_type"], e["rope_theta"], e["rope_factor"], e["rope_original_max_position_embeddings"]) == (
        "yarn",
        10000.0,
        4.0,
        128,
    )
    assert e["rope_attention_scaling"] == pytest.approx(1.1386, abs=1e-4)
    assert (e["sliding_layers"], e["sliding_window"], e["sliding_window_applied"]) == ([0, 1], 4, True)
    assert effective_config(cfg, apply_window=False)["sliding_window_applied"] is False
    assert all(isinstance(v, (int, float, str, bool, list, type(None))) for v in e.values())
