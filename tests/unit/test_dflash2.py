"""DFlash2 drafters (issue 27; docs/family.md §8): config and tensors read or refused by name, the model's
convolutions and selector, identity DFlash2 == DFlash, z-lab's public tensor names and shapes (scaled down).

Helpers here (`dflash2_keys`, `dflash2_weights`, `write_dflash2`, `make_dflash2`) serve the other DFlash2
tests (replay, online loop, trainer)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import MASK_ID, VOCAB
from test_fidelity import FFN, HEADS, KV, LAYERS, TAPS, D, H, inputs, ours, reference_forward, weights, write_drafter
from test_refusals import _evaluate, broken_target  # noqa: F401 (fixture)

from dflash.models.drafter.checkpoint import build_drafter, fit_drafter, read_drafter
from dflash.models.drafter.config import parse_config
from dflash.models.drafter.dflash2 import BlockConv, propose
from dflash.models.drafter.dflash2_config import DFlash2Config
from dflash.models.drafter.model import DFlashDrafter
from dflash.util.errors import CheckpointError

T, GS, RANK, TOPK = 2, 16, 8, 4


def dflash2_keys(**kw) -> dict:
    return {"conv_kernel_size": T, "conv_group_size": GS, "selector_rank": RANK, "selector_top_k": TOPK, **kw}


def dflash2_weights(
    sd: dict,
    layers: int = LAYERS,
    hidden: int = H,
    vocab: int = VOCAB,
    T: int = T,
    gs: int = GS,
    rank: int = RANK,
    seed: int = 1,
    scale: float = 0.5,
    identity: bool = False,
) -> dict:
    """sd + DFlash2's tensors under the public names: far from identity (random base kernel, projection and
    codebooks), or `identity` (identity base, zero projection, zero successor codebook: DFlash's proposal)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g) * scale  # noqa: E731
    out = dict(sd)
    for i in range(layers):
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.zeros(2, T, hidden)
            base[:, 0] = 1.0
            out[f"layers.{i}.{conv}.base_kernel"] = base if identity else base + rnd(2, T, hidden)
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = (
                torch.zeros(2 * T * (hidden // gs), hidden)
                if identity
                else rnd(2 * T * (hidden // gs), hidden) / hidden**0.5
            )
    out["candidate_selector.hidden_projection.weight"] = rnd(rank, hidden)
    out["candidate_selector.predecessor_codebook"] = rnd(vocab, rank)
    out["candidate_selector.successor_codebook"] = torch.zeros(vocab, rank) if identity else rnd(vocab, rank) * 4
    return out


def write_dflash2(
    folder: Path, dflash: dict | None = None, top: dict | None = None, sd: dict | None = None, **kw
) -> Path:
    return write_drafter(
        folder,
        top={"architectures": ["DFlash2DraftModel"], **(top or {})},
        dflash=dflash2_keys(**(dflash or {})),
        sd=dflash2_weights(weights()) if sd is None else sd,
        **kw,
    )


def make_dflash2(
    make_drafter, target, identity: bool = False, seed: int = 0, T: int = T, gs: int = GS, **kw
) -> DFlashDrafter:
    """A DFlash2 drafter with the target's shapes; far from identity unless `identity`."""
    base = make_drafter(target, seed=seed, **kw)
    cfg = dataclasses.replace(
        base.cfg, arch="dflash2", dflash2=DFlash2Config(RANK, TOPK, T, gs, vocab_size=target.vocab_size)
    )
    d = DFlashDrafter(cfg).eval()
    sd = dflash2_weights(
        base.state_dict(), len(base.layers), cfg.hidden_size, target.vocab_size, T, gs, seed=seed + 1, identity=identity
    )
    d.load_state_dict(sd)
    return d


# --- config -----------------------------------------------------------------------------------------


def test_dflash2_config_reads_and_writes_back(tmp_path):
    src = read_drafter(
        "hf",
        "x",
        path=str(
            write_dflash2(
                tmp_path / "d",
                dflash={
                    "output_multiplier": 0.5,
                    "final_logit_softcapping": 20.0,
                    "attention_mode": "gqa",
                    "block_size": 4,
                },
            )
        ),
    )
    c = src.config
    assert c.arch == "dflash2" and c.dflash2 == DFlash2Config(RANK, TOPK, T, GS, 0.5, 20.0, VOCAB, "gqa")
    hf = c.to_hf()
    assert hf["architectures"] == ["DFlash2DraftModel"] and hf["dflash_config"]["selector_top_k"] == TOPK
    back, _ = parse_config(hf)
    assert back.dflash2 == c.dflash2 and back.block_size == c.block_size


def test_block_size_read_as_sglang_reads_it(tmp_path):
    """dflash_config.block_size first, the top level after (SGLang); the convolutions' range follows it."""
    sd = dflash2_weights(weights(), T=6)
    src = read_drafter(
        "hf", "x", path=str(write_dflash2(tmp_path / "d", dflash={"block_size": 8, "conv_kernel_size": 6}, sd=sd))
    )
    assert src.config.block_size == 8 and src.config.dflash2.conv_kernel_size == 6


def test_dflash2_without_convolutions_is_served_as_sglang_serves_it(tmp_path):
    sd = {k: v for k, v in dflash2_weights(weights()).items() if "conv" not in k}
    src = read_drafter(
        "hf", "x", path=str(write_dflash2(tmp_path / "d", dflash={"conv_kernel_size": 0, "conv_group_size": 0}, sd=sd))
    )
    assert not src.config.dflash2.has_conv


DFLASH2_REFUSALS = {  # dflash_config override -> words the message must hold
    "conv_kernel_size 0 < 1 with a group": (
        {"conv_kernel_size": 5},
        "dflash_config.conv_kernel_size=5 should be an integer in 1..block_size (4)",
    ),
    "conv_kernel_size alone": ({"conv_group_size": None}, "conv_kernel_size=2 and conv_group_size=None"),
    "conv_group_size not dividing": (
        {"conv_group_size": 24},
        "dflash_config.conv_group_size=24 should be a positive divisor of hidden_size (64)",
    ),
    "conv_group_size float": ({"conv_group_size": 16.0}, "dflash_config.conv_group_size=16.0 should be an integer"),
    "selector_rank 0": ({"selector_rank": 0}, "dflash_config.selector_rank=0 should be an integer >= 1"),
    "selector_rank missing": ({"selector_rank": None}, "needs dflash_config.selector_rank"),
    "selector_top_k 0": ({"selector_top_k": 0}, "dflash_config.selector_top_k=0 should be an integer in 1..256"),
    "selector_top_k > vocab": (
        {"selector_top_k": 257},
        "dflash_config.selector_top_k=257 should be an integer in 1..256",
    ),
    "softcap < 0": (
        {"final_logit_softcapping": -3.0},
        "dflash_config.final_logit_softcapping=-3.0 should be a number > 0",
    ),
    "softcap inf": (
        {"final_logit_softcapping": float("inf")},
        "dflash_config.final_logit_softcapping=inf should be a finite number",
    ),
    "output_multiplier 0": (
        {"output_multiplier": 0},
        "dflash_config.output_multiplier=0 should be a finite number > 0",
    ),
    "output_multiplier nan": (
        {"output_multiplier": float("nan")},
        "dflash_config.output_multiplier=nan should be a finite number",
    ),
    "attention_mode mla": ({"attention_mode": "mla"}, "attention_mode='mla'"),
    "attention_mode other": (
        {"attention_mode": "linear"},
        "dflash_config.attention_mode='linear' should be one of ['gqa', 'mha']",
    ),
    "unknown DFlash2 key": ({"markov_rank": 4}, "unknown config key dflash_config.markov_rank=4"),
}


@pytest.mark.parametrize("case", list(DFLASH2_REFUSALS))
def test_bad_dflash2_value_names_the_key(tmp_path, case):
    dflash, words = DFLASH2_REFUSALS[case]
    folder = write_dflash2(tmp_path / "d", dflash=dflash)
    with pytest.raises(CheckpointError) as e:
        read_drafter("hf", "x", path=str(folder))
    assert words in str(e.value) and str(folder) in str(e.value), str(e.value)


def test_dflash2_keys_stay_refused_for_a_dflash_drafter(tmp_path):
    with pytest.raises(
        CheckpointError, match=r"dflash_config.selector_rank=8 switches on DFlash2's candidate selector"
    ):
        read_drafter("hf", "x", path=str(write_drafter(tmp_path / "d", dflash={"selector_rank": 8})))
    with pytest.raises(CheckpointError, match=r"architectures=\['Eagle3DraftModel'\]"):
        read_drafter("hf", "x", path=str(write_drafter(tmp_path / "e", top={"architectures": ["Eagle3DraftModel"]})))


def test_vocab_checked_against_the_target(tmp_path, qwen3_target):
    """Without vocab_size the codebooks' rows are the vocabulary; it must be the target's (its token ids index them)."""
    sd = dflash2_weights(weights(), vocab=300)
    src = read_drafter("hf", "x", path=str(write_dflash2(tmp_path / "d", sd=sd, qwen3={"vocab_size": 300})))
    with pytest.raises(CheckpointError, match=r"vocab_size 300 \(the selector codebooks' rows\) != the target's 256"):
        fit_drafter(src, qwen3_target)
    src = read_drafter("hf", "x", path=str(write_dflash2(tmp_path / "e", drop=("vocab_size",))))
    assert src.config.dflash2.vocab_size == VOCAB  # from the codebooks


# --- tensors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda sd: sd.pop("layers.1.mlp_conv.base_kernel"), "missing ['layers.1.mlp_conv.base_kernel']"),
        (
            lambda sd: sd.pop("candidate_selector.successor_codebook"),
            "missing ['candidate_selector.successor_codebook']",
        ),
        (
            lambda sd: sd.update({"layers.0.attention_conv.kernel_projection.weight": torch.zeros(8, H)}),
            "layers.0.attention_conv.kernel_projection.weight: checkpoint (8, 64) vs model (16, 64)",
        ),
        (
            lambda sd: sd.update({"layers.0.attention_conv.base_kernel": torch.zeros(2, 3, H)}),
            "layers.0.attention_conv.base_kernel: checkpoint (2, 3, 64) vs model (2, 2, 64)",
        ),
        (
            lambda sd: sd.update({"candidate_selector.hidden_projection.weight": torch.zeros(4, H)}),
            "candidate_selector.hidden_projection.weight: checkpoint (4, 64) vs model (8, 64)",
        ),
        (lambda sd: sd.update({"candidate_selector.bias": torch.zeros(4)}), "not consumed by that drafter"),
        (
            lambda sd: sd["candidate_selector.predecessor_codebook"].__setitem__((0, 0), float("nan")),
            "non-finite weights",
        ),
    ],
)
def test_bad_dflash2_tensor_names_it(tmp_path, change, words):
    sd = dflash2_weights(weights())
    change(sd)
    with pytest.raises(CheckpointError) as e:
        read_drafter("hf", "x", path=str(write_dflash2(tmp_path / "d", sd=sd)))
    assert words in str(e.value), str(e.value)


def test_zlab_header_names_and_shapes_load(tmp_path, qwen3_target):
    """z-lab/dflash's tests/fixtures/dflash2-safetensors-header.json (a public DFlash2 drafter: 5 layers,
    hidden 6656, T 2, group 16, rank 256, vocab 202048), scaled down to hidden 64, 2 layers, vocab 256:
    the same names, shapes by the same formulas ([2, T, H], [2·T·H/16, H], [rank, H], [vocab, rank])."""
    header = {
        "candidate_selector.hidden_projection.weight": (RANK, H),
        "candidate_selector.predecessor_codebook": (VOCAB, RANK),
        "candidate_selector.successor_codebook": (VOCAB, RANK),
        "fc.weight": (H, 3 * H),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
    }
    for i in range(LAYERS):
        for conv in ("attention_conv", "mlp_conv"):
            header[f"layers.{i}.{conv}.base_kernel"] = (2, T, H)
            header[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * T * H // GS, H)
        header.update(
            {
                f"layers.{i}.self_attn.{n}_proj.weight": s
                for n, s in (("q", (64, H)), ("k", (32, H)), ("v", (32, H)), ("o", (H, 64)))
            }
        )
        header.update(
            {
                f"layers.{i}.self_attn.q_norm.weight": (16,),
                f"layers.{i}.self_attn.k_norm.weight": (16,),
                f"layers.{i}.mlp.gate_proj.weight": (96, H),
                f"layers.{i}.mlp.up_proj.weight": (96, H),
                f"layers.{i}.mlp.down_proj.weight": (H, 96),
                f"layers.{i}.input_layernorm.weight": (H,),
                f"layers.{i}.post_attention_layernorm.weight": (H,),
            }
        )
    sd = {k: torch.rand(s) for k, s in header.items()}
    zlab = {
        "final_logit_softcapping": 20.0,
        "output_multiplier": 0.19611613513818404,
        "block_size": 4,
    }  # z-lab's fixture values
    src = read_drafter("hf", "x", path=str(write_dflash2(tmp_path / "d", dflash=zlab, sd=sd)))
    d = build_drafter(fit_drafter(src, qwen3_target)).model
    assert set(d.state_dict()) == set(header) and all(tuple(d.state_dict()[k].shape) == s for k, s in header.items())


# --- the model --------------------------------------------------------------------------------------


def test_block_convolution_is_causal_within_each_block():
    """A change at slot j of one block moves only slots j..j+T-1 of that block (T = 3 here), no other block."""
    torch.manual_seed(0)
    conv = BlockConv(32, 3, 8)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(2, 3 * 4, 32)  # S=2 sequences, N=3 blocks of B=4
    y = conv.prepare(x, 4)[0]
    x2 = x.clone()
    x2[1, 4 + 1] += 1.0  # sequence 1, block 1, slot 1
    moved = (conv.prepare(x2, 4)[0] - y).abs().sum(-1) > 0  # [S, Q]
    assert (
        moved[1].nonzero()[:, 0].tolist() == [5, 6, 7] and not moved[0].any()
    )  # slots 1..3 of block 1 (slot 0 of block 2 untouched)


def test_identity_dflash2_equals_the_same_weights_read_as_dflash(tmp_path, qwen3_target):
    """Identity base kernel, zero projection and zero successor codebook: the same hidden states and the
    same proposals as the DFlash drafter of the other weights (and far from identity, different ones)."""
    sd = weights()
    dflash = build_drafter(
        fit_drafter(read_drafter("hf", "x", path=str(write_drafter(tmp_path / "a", sd=sd))), qwen3_target)
    ).model
    two = build_drafter(
        fit_drafter(
            read_drafter("hf", "x", path=str(write_dflash2(tmp_path / "b", sd=dflash2_weights(sd, identity=True)))),
            qwen3_target,
        )
    ).model
    far = build_drafter(
        fit_drafter(
            read_drafter("hf", "x", path=str(write_dflash2(tmp_path / "c", sd=dflash2_weights(sd)))), qwen3_target
        )
    ).model
    g = torch.Generator().manual_seed(0)
    taps, anchors = torch.randn(1, 20, 3 * H, generator=g), torch.tensor([[5, 9, 14]])
    block = torch.full((1, 3, 4), MASK_ID)
    block[..., 0] = torch.tensor([7, 8, 9])
    emb = qwen3_target.embed(block)
    hs = [m(taps, emb, anchors)[0, :, 1:] for m in (dflash, two, far)]  # [N, B-1, H]
    assert torch.allclose(hs[0], hs[1], atol=1e-6) and not torch.allclose(hs[0], hs[2], atol=1e-3)
    p = [propose(m, qwen3_target.lm_head, h, block[0, :, 0]) for m, h in zip((dflash, two), hs)]
    assert torch.equal(p[0].tokens, p[1].tokens) and torch.equal(p[1].tokens, p[1].unary)


@pytest.mark.slow
def test_bad_dflash2_drafter_exits_2_naming_it(tmp_path, broken_target):  # noqa: F811
    """evaluate.py end to end: a bad DFlash2 value and a bad DFlash2 tensor exit 2 naming them, no traceback,
    before the target's (here unloadable) weights are read."""
    sd = dflash2_weights(weights())
    sd.pop("candidate_selector.successor_codebook")
    for folder, words in (
        (write_dflash2(tmp_path / "v", dflash={"conv_group_size": 24}), "dflash_config.conv_group_size=24"),
        (write_dflash2(tmp_path / "t", sd=sd), "candidate_selector.successor_codebook"),
    ):
        r = _evaluate(tmp_path, broken_target, folder)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


# --- other formats' fields on a DFlash2 drafter (docs/dflash2.md) -----------------------------------


def _d2(tmp_path: Path, name: str, target, sd: dict | None = None, **kw) -> DFlashDrafter:
    return build_drafter(
        fit_drafter(read_drafter("hf", "x", path=str(write_dflash2(tmp_path / name, sd=sd, **kw))), target)
    ).model


def test_own_lm_head_and_logit_scale_reach_the_unary_logits(tmp_path, qwen3_target):
    """The unary logits are the drafter's (`DFlashDrafter.logits`): an own LM head whose row j is the target's
    row perm[j] permutes the unary argmax; logit_scale 8 with output_multiplier 1/8 walks as neither does."""
    sd = dflash2_weights(weights())
    sd["candidate_selector.successor_codebook"] *= (
        0.01  # the walk's bilinear term comparable to the unary gaps: the scale matters
    )
    ref = _d2(tmp_path, "ref", qwen3_target, sd=sd)
    W = qwen3_target.model.get_output_embeddings().weight.detach()
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))
    own = _d2(tmp_path, "own", qwen3_target, sd={**sd, "lm_head.weight": W[perm]})
    scaled = _d2(tmp_path, "scaled", qwen3_target, sd=sd, dflash={"output_multiplier": 0.125}, top={"logit_scale": 8.0})
    half = _d2(tmp_path, "half", qwen3_target, sd=sd, dflash={"output_multiplier": 0.125})
    h, anchor = torch.randn(4, 3, H, generator=torch.Generator().manual_seed(1)), torch.tensor([7, 8, 9, 10])
    p_ref, p_own, p_scaled, p_half = (propose(m, qwen3_target.lm_head, h, anchor) for m in (ref, own, scaled, half))
    assert own.lm_head is not None and torch.equal(perm[p_own.unary], p_ref.unary)
    assert torch.equal(p_scaled.tokens, p_ref.tokens) and torch.equal(p_scaled.topk, p_ref.topk)
    assert not torch.equal(p_half.tokens, p_ref.tokens)  # the multiplier alone walks otherwise: logit_scale was applied
    assert not torch.equal(p_ref.tokens, p_ref.unary)  # and the walk is not the unary argmax


def test_a_reduced_draft_vocabulary_is_refused_for_dflash2(tmp_path):
    ids = torch.arange(0, VOCAB, 4)
    sd = {**dflash2_weights(weights()), "lm_head.weight": torch.randn(len(ids), H), "d2t": ids - torch.arange(len(ids))}
    with pytest.raises(CheckpointError, match=r"draft_vocab_size=64 < vocab_size=256 in a DFlash2DraftModel"):
        read_drafter("hf", "x", path=str(write_dflash2(tmp_path / "d", sd=sd, top={"draft_vocab_size": len(ids)})))


# --- a public DFlash2 config: is_causal false, every layer sliding_attention ----------------------


def zlab_shaped(folder: Path, sd: dict, window: int = 5, is_causal: bool = False) -> Path:
    """z-lab/dflash's tests/fixtures/dflash2-config.json key for key, scaled down (hidden 6656 -> 64, 5 -> 2
    layers, block 16 -> 4, window 2048 -> 5 so that it cuts the test's contexts, vocabulary 202048 -> 256)."""
    from safetensors.torch import save_file

    cfg = {
        "architectures": ["DFlash2DraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "is_causal": is_causal,
        "dflash_config": {
            "block_size": 4,
            "conv_group_size": GS,
            "conv_kernel_size": T,
            "final_logit_softcapping": 20.0,
            "mask_token_id": MASK_ID,
            "output_multiplier": 0.19611613513818404,
            "selector_rank": RANK,
            "selector_top_k": TOPK,
            "target_layer_ids": TAPS,
        },
        "dtype": "bfloat16",
        "eos_token_id": 2,
        "head_dim": D,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": FFN,
        "layer_types": ["sliding_attention"] * LAYERS,
        "max_position_embeddings": 512,
        "max_window_layers": LAYERS,
        "model_type": "qwen3",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV,
        "num_target_layers": 6,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "sliding_window": window,
        "tie_word_embeddings": False,
        "transformers_version": "5.15.0",
        "use_cache": False,
        "use_sliding_window": True,
        "vocab_size": VOCAB,
    }
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(folder / "model.safetensors"))
    return folder


def test_zlab_config_non_causal_sliding_layers(tmp_path, qwen3_target):
    """Read as SGLang reads it: every layer non-causal and windowed. With identity convolutions the block's states
    equal transformers' layers under that mask (test_fidelity.reference_forward, window cutting the context)."""
    from dflash.models.drafter.config import effective_config

    folder = zlab_shaped(tmp_path / "id", dflash2_weights(weights(), identity=True))
    src = fit_drafter(read_drafter("hf", "x", path=str(folder)), qwen3_target)
    d = build_drafter(src).model
    assert src.config.causal is False and d.causal == [False] * LAYERS and d.windows == [5] * LAYERS
    eff = effective_config(src.config)
    assert (
        eff["causal_layers"] == [] and eff["sliding_window_applied"] and eff["dflash2_final_logit_softcapping"] == 20.0
    )
    taps, emb = inputs(p=20)
    got = ours(d, taps, emb, 20)
    torch.testing.assert_close(got, reference_forward(folder, taps, emb, 20, causal=False), atol=2e-5, rtol=1e-5)
    assert not torch.allclose(got, reference_forward(folder, taps, emb, 20), atol=1e-3)  # the causal reading differs
    assert not torch.allclose(
        got, reference_forward(folder, taps, emb, 20, window=False, causal=False), atol=1e-3
    )  # the window cuts


def test_zlab_config_replay_equals_the_online_loop(tmp_path, qwen3_target):
    """Far from identity, on the tiny target: the replay's proposals are the online loop's, block for block, and
    differ from the same weights read causal or without the window."""
    from shortcuts import evaluate_sequence, load_drafter

    from dflash.models.target.forward import tapped_forward
    from dflash.online.speculative import speculative_generate

    seq, first = [5, 9, 17, 33, 60, 61, 62, 100, 101, 7, 8, 9, 10, 120, 121, 122, 3, 4, 200, 201], 6
    sd = dflash2_weights({k: v * 4 if v.dim() == 2 else v for k, v in weights(3).items()})
    path = zlab_shaped(tmp_path / "d", sd)
    d = load_drafter(qwen3_target, "hf", "x", path=str(path)).model
    online = speculative_generate(qwen3_target, d, seq[:first], 14)
    taps = tapped_forward(qwen3_target, torch.tensor([seq[:first] + online.tokens]), d.cfg.target_layer_ids)[0]
    _, blocks = evaluate_sequence(d, qwen3_target, seq[:first], online.tokens, taps)
    assert [b.proposal for b in blocks] == [b.proposal for b in online.blocks] and len(blocks) > 1
    full = seq[:first] + online.tokens
    taps = tapped_forward(qwen3_target, torch.tensor([full]), d.cfg.target_layer_ids)[0]
    walks = []
    for m in (
        d,
        load_drafter(qwen3_target, "hf", "x", path=str(zlab_shaped(tmp_path / "c", sd, is_causal=True))).model,
        load_drafter(qwen3_target, "hf", "x", path=str(path), sliding_window="ignore").model,
    ):
        walks.append(
            [b.proposal for b in evaluate_sequence(m, qwen3_target, seq[:first], online.tokens, taps, anchors="all")[1]]
        )
    assert walks[0] != walks[1] and walks[0] != walks[2]


# --- drafter=init arch=dflash2 (the 27B-shape bench's drafter) ------------------------------------


def _init_dflash2(target, seed: int = 1, **kw) -> DFlashDrafter:
    init = {
        "num_layers": 2,
        "seed": seed,
        "arch": "dflash2",
        "window": 2048,
        "is_causal": False,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 4,
        **kw,
    }
    src = read_drafter("init", "init", overrides={"mask_token_id": MASK_ID, "block_size": 8}, init=init)
    return build_drafter(fit_drafter(src, target)).model


def test_drafter_init_builds_a_random_dflash2(qwen3_target):
    """SpecForge's 27B example's kind (block 8, every layer sliding at 2048, non-causal) with random convolutions
    and selector, not identity: the walk departs from the unary argmax. Seeded: the same drafter twice."""
    d = _init_dflash2(qwen3_target)
    assert (
        d.cfg.arch == "dflash2" and d.cfg.block_size == 8 and d.windows == [2048, 2048] and d.causal == [False, False]
    )
    conv = d.layers[0].attention_conv
    identity = BlockConv(H, 2, 16).identity_()
    assert not torch.allclose(conv.base_kernel, identity.base_kernel) and conv.kernel_projection.weight.abs().sum() > 0
    assert d.candidate_selector.successor_codebook.abs().sum() > 0
    h, anchor = torch.randn(16, 7, H, generator=torch.Generator().manual_seed(0)), torch.arange(16)
    p = propose(d, qwen3_target.lm_head, h, anchor)
    assert not torch.equal(p.tokens, p.unary)
    assert all(
        torch.equal(a, b) for a, b in zip(d.state_dict().values(), _init_dflash2(qwen3_target).state_dict().values())
    )


def test_drafter_init_dflash2_sizes_named_as_overrides(qwen3_target):
    with pytest.raises(
        CheckpointError, match=r"drafter.conv_group_size=7 should be a positive divisor of hidden_size \(64\)"
    ):
        _init_dflash2(qwen3_target, conv_group_size=7)
    from dflash.config.compose import compose
    from dflash.util.errors import ConfigError

    with pytest.raises(ConfigError, match="drafter.arch shapes drafter=init only"):
        compose(["drafter=hf", "drafter.path=x", "drafter.arch=dflash2"])
    with pytest.raises(ConfigError, match="drafter.arch='dflash3'"):
        compose(["drafter=init", "drafter.arch=dflash3"])
