"""The other drafter formats (issue 27 part 4, docs/formats.md): vLLM's qwen3_dflash keys and the
speculators format give the same proposals as the same weights in the HF format; the fields that
change the computation (causal blocks, the drafter's own embedding / LM head, a reduced draft
vocabulary, logit_scale) change it as vLLM computes it; every refused field names its key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import MASK_ID
from shortcuts import draft_every_anchor, evaluate_sequence, load_drafter
from test_fidelity import LAYERS, TAPS, B, H, weights, write_drafter
from test_refusals import _evaluate, broken_target  # noqa: F401 (a fixture)

from dflash.models.drafter.checkpoint import read_drafter
from dflash.models.drafter.formats import share_equal, translate
from dflash.models.drafter.model import visibility_mask
from dflash.models.target.forward import tapped_forward
from dflash.online.speculative import speculative_generate
from dflash.util.errors import CheckpointError

SEQ = [5, 9, 17, 33, 60, 61, 62, 100, 101, 7, 8, 9, 10, 120, 121, 122, 3, 4, 200, 201]
FIRST = 6


def hf_config(tmp_path: Path, **kw) -> dict:
    """The HF-format config.json the test drafters share (written by transformers' Qwen3Config)."""
    return json.loads((write_drafter(tmp_path / "base", **kw) / "config.json").read_text())


def folder(path: Path, config: dict, sd: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    return path


def proposals(target, path: Path, seq: list[int] = SEQ, scores: bool = False):
    d = load_drafter(target, "hf", "x", path=str(path)).model
    taps = tapped_forward(target, torch.tensor([seq]), d.cfg.target_layer_ids)[0]
    out = draft_every_anchor(d, target, torch.tensor(seq), taps, FIRST, scores=scores)
    return out if scores else out[0]


def big(seed: int = 3) -> dict[str, torch.Tensor]:  # large weights: proposals vary with the context
    return {k: v * 4 if v.dim() == 2 else v for k, v in weights(seed).items()}


def speculators_config(tmp_path: Path, kind: str = "dflash", **kw) -> dict:
    tlc = {
        k: v
        for k, v in hf_config(tmp_path).items()
        if k not in ("dflash_config", "architectures", "block_size", "num_target_layers")
    }
    return {
        "speculators_model_type": kind,
        "architectures": ["DFlashSpeculator"],
        "transformer_layer_config": tlc,
        "draft_vocab_size": 256,
        "block_size": B,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [t + 1 for t in TAPS],
        "mask_token_id": MASK_ID,
        "sliding_window_non_causal": False,
        "projector_type": "dflash",
        "pure_draft_prefix_len": 1,
        "emb_dim": 256,
        "gru_hidden_dim": 1024,
        "auf": False,
        "shift_label": False,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": B - 1}],
            "verifier": {"name_or_path": "tiny/qwen3", "architectures": ["Qwen3ForCausalLM"]},
        },
        "speculators_version": "0.4.0",
        "dtype": "float32",
        **kw,
    }


# --- accepted formats: the same computation as the HF format ------------------------------------


def test_vllm_keys_give_the_hf_drafter(qwen3_target, tmp_path):
    """Aux ids (the stream entering layer i: tap i - 1), eagle_config, vLLM's tensor names."""
    sd = big()
    ref = proposals(qwen3_target, folder(tmp_path / "hf", hf_config(tmp_path), sd))
    cfg = hf_config(tmp_path)
    del cfg["dflash_config"]["target_layer_ids"]
    cfg.update(
        {"eagle_aux_hidden_state_layer_ids": [t + 1 for t in TAPS], "eagle_config": {"use_aux_hidden_state": True}}
    )
    renamed = {
        k.replace("layers.0.", "midlayer.")
        .replace("fc.", "encoder.fc.")
        .replace("hidden_norm.", "encoder.output_norm_enc."): v
        for k, v in sd.items()
    }
    assert torch.equal(proposals(qwen3_target, folder(tmp_path / "vllm", cfg, renamed)), ref)
    cfg = hf_config(tmp_path, dflash={"target_layer_ids": None, "layer_ids": [t + 1 for t in TAPS]})
    assert torch.equal(proposals(qwen3_target, folder(tmp_path / "ids", cfg, sd)), ref)
    assert len({tuple(p) for p in ref.tolist()}) > 1


def test_use_swa_is_the_sliding_window(qwen3_target, tmp_path):
    sliding = {"layer_types": ["sliding_attention"] * LAYERS, "sliding_window": 4, "use_sliding_window": True}
    ref = proposals(qwen3_target, folder(tmp_path / "hf", hf_config(tmp_path, qwen3=sliding), big()))
    cfg = hf_config(tmp_path, dflash={"use_swa": True, "swa_window_size": 4, "causal": True})
    assert torch.equal(proposals(qwen3_target, folder(tmp_path / "swa", cfg, big())), ref)
    assert not torch.equal(proposals(qwen3_target, folder(tmp_path / "full", hf_config(tmp_path), big())), ref)


def test_speculators_format_gives_the_hf_drafter(qwen3_target, tmp_path):
    sd = big()
    ref = proposals(qwen3_target, folder(tmp_path / "hf", hf_config(tmp_path), sd))
    spec = folder(tmp_path / "spec", speculators_config(tmp_path), {**sd, "t2d": torch.ones(256, dtype=torch.bool)})
    src = read_drafter("hf", "x", path=str(spec))
    assert src.config.target_layer_ids == TAPS and src.config.block_size == B and not src.config.vocab_map
    assert torch.equal(proposals(qwen3_target, spec), ref)


def test_speculators_transformer_layer_config_diff_takes_transformers_defaults(tmp_path):
    raw = speculators_config(tmp_path)
    del raw["transformer_layer_config"]["vocab_size"], raw["transformer_layer_config"]["intermediate_size"]
    cfg = translate(raw, {}).config
    assert cfg["intermediate_size"] == 22016 and cfg["vocab_size"] == 151936  # transformers' Qwen3Config defaults


def test_speculators_dflash2_goes_to_the_dflash2_parser(tmp_path):
    raw = speculators_config(
        tmp_path, "dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4
    )
    t = translate(raw, {})
    assert t.fmt == "speculators" and t.config["architectures"] == ["DFlash2DraftModel"]
    assert {
        k: t.config["dflash_config"][k]
        for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    } == {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}


# --- the fields that change the computation -------------------------------------------------------


def test_causal_blocks(qwen3_target, tmp_path):
    m = visibility_mask(torch.tensor([[3]]), 3, 4, causal=True)[0]  # [4 slots, 3 ctx + 4 slots]
    assert m[:, :3].all() and torch.equal(m[:, 3:], torch.ones(4, 4, dtype=torch.bool).tril())
    assert visibility_mask(torch.tensor([[3]]), 3, 4)[0].all()  # DFlash: bidirectional
    ref = proposals(qwen3_target, folder(tmp_path / "hf", hf_config(tmp_path), big()))
    causal = proposals(qwen3_target, folder(tmp_path / "c", hf_config(tmp_path, top={"is_causal": True}), big()))
    assert not torch.equal(causal, ref)
    d = load_drafter(qwen3_target, "hf", "x", path=str(tmp_path / "c")).model
    taps = tapped_forward(qwen3_target, torch.tensor([SEQ]), d.cfg.target_layer_ids)[0][None, :8]
    emb = qwen3_target.embed(torch.tensor([[[4, MASK_ID, MASK_ID, MASK_ID]]]))
    h, h2 = (d(taps, e, torch.tensor([[8]])) for e in (emb, emb.clone().index_fill_(2, torch.tensor([3]), 1.0)))
    assert torch.allclose(h[..., :3, :], h2[..., :3, :]) and not torch.allclose(
        h[..., 3, :], h2[..., 3, :]
    )  # slot 3 unseen by 0..2


def test_non_causal_sliding_mask():
    """is_causal: false with sliding layers (public DFlash2 configs), as SGLang and SpecForge read it: the block
    seen both ways (the window bounding it on the left only), the context windowed from the query's own position."""
    p, T, B, w = 6, 8, 4, 3
    m = visibility_mask(torch.tensor([[p]]), T, B, window=w, causal=False)[0]  # [B slots, T context + B slots]
    assert m[0].int().tolist() == [0, 0, 0, 0, 1, 1, 0, 0] + [
        1,
        1,
        1,
        1,
    ]  # slot 0 (position 6): context 4, 5; every slot
    assert m[3].int().tolist() == [0] * 8 + [
        0,
        1,
        1,
        1,
    ]  # slot 3 (position 9): no context left in the window; slots 1..3
    for i in range(B):
        assert m[i, :T].nonzero()[:, 0].tolist() == [t for t in range(T) if p + i - w < t < p]
        assert m[i, T:].nonzero()[:, 0].tolist() == [j for j in range(B) if i - j < w]
    causal = visibility_mask(torch.tensor([[p]]), T, B, window=w)[0]  # a sliding layer's default: causal
    assert torch.equal(
        causal, m & torch.cat([torch.ones(B, T, dtype=torch.bool), torch.ones(B, B, dtype=torch.bool).tril()], 1)
    )
    wide = visibility_mask(torch.tensor([[p]]), T, B, window=2048, causal=False)[
        0
    ]  # public window: all of the block, all t < p
    assert wide[:, T:].all() and wide[:, :p].all() and not wide[:, p:T].any()


def test_own_embedding_and_lm_head(qwen3_target, tmp_path):
    """Equal to the target's: the same drafter (and shared, as vLLM); a permuted head: permuted proposals;
    another embedding: other proposals, the online loop equal to the replay."""
    sd = big()
    E = qwen3_target.model.get_input_embeddings().weight.detach().clone()
    W = qwen3_target.model.get_output_embeddings().weight.detach().clone()
    ref = proposals(qwen3_target, folder(tmp_path / "hf", hf_config(tmp_path), sd))
    same = folder(tmp_path / "same", hf_config(tmp_path), {**sd, "embed_tokens.weight": E, "lm_head.weight": W})
    assert torch.equal(proposals(qwen3_target, same), ref)
    d = load_drafter(qwen3_target, "hf", "x", path=str(same)).model
    assert (
        d.embed_tokens is not None
        and share_equal(d, qwen3_target)
        == [
            "embed_tokens: the target's (the drafter's own equals it, as vLLM shares it then)",
            "lm_head: the target's (the drafter's own equals it, as vLLM shares it then)",
        ]
        and d.embed_tokens is None
    )
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(0))
    head = folder(tmp_path / "head", hf_config(tmp_path), {**sd, "lm_head.weight": W[perm]})
    assert torch.equal(perm[proposals(qwen3_target, head)], ref)  # row j of the own head is the target's row perm[j]
    other = folder(tmp_path / "emb", hf_config(tmp_path), {**sd, "embed_tokens.weight": E.flip(0) * 3})
    got = proposals(qwen3_target, other)
    assert not torch.equal(got, ref)
    d = load_drafter(qwen3_target, "hf", "x", path=str(other)).model
    assert share_equal(d, qwen3_target)[0] == "embed_tokens: the drafter's own (differs from the target's)"
    online = speculative_generate(qwen3_target, d, SEQ[:FIRST], 14)
    taps = tapped_forward(qwen3_target, torch.tensor([SEQ[:FIRST] + online.tokens]), d.cfg.target_layer_ids)[0]
    _, blocks = evaluate_sequence(d, qwen3_target, SEQ[:FIRST], online.tokens, taps)
    assert [b.proposal for b in blocks] == [b.proposal for b in online.blocks]


def test_reduced_draft_vocabulary_maps_ids(qwen3_target, tmp_path):
    W = qwen3_target.model.get_output_embeddings().weight.detach()
    ids = (
        torch.randperm(256, generator=torch.Generator().manual_seed(1))[:64].sort().values
    )  # the draft vocabulary's target ids
    sd = {**big(), "lm_head.weight": W[ids], "d2t": ids - torch.arange(64)}  # vLLM's d2t: offsets, target = i + d2t[i]
    got = proposals(qwen3_target, folder(tmp_path / "r", hf_config(tmp_path, top={"draft_vocab_size": 64}), sd))
    full = proposals(qwen3_target, folder(tmp_path / "hf", hf_config(tmp_path), big()))
    assert torch.isin(got, ids).all() and not torch.equal(got, full)
    t2d = torch.zeros(256, dtype=torch.bool).index_fill_(0, ids, True)
    same = proposals(
        qwen3_target, folder(tmp_path / "t", hf_config(tmp_path, top={"draft_vocab_size": 64}), {**sd, "t2d": t2d})
    )
    assert torch.equal(same, got)  # t2d agrees with the offsets: read, then dropped as vLLM drops it
    with pytest.raises(
        CheckpointError, match="tensor d2t read as vLLM reads it"
    ):  # absolute ids are not vLLM's offsets
        read_drafter(
            "hf",
            "x",
            path=str(
                folder(
                    tmp_path / "abs", hf_config(tmp_path, top={"draft_vocab_size": 64}), {**sd, "d2t": ids, "t2d": t2d}
                )
            ),
        )
    d = load_drafter(qwen3_target, "hf", "x", path=str(tmp_path / "r")).model
    h = torch.randn(5, H)
    assert torch.equal(d.logits(qwen3_target.lm_head, h).argmax(-1), ids[(h @ W[ids].T).argmax(-1)])


def test_logit_scale_scales_the_draft_logits(qwen3_target, tmp_path):
    props, nll, conf = proposals(qwen3_target, folder(tmp_path / "hf", hf_config(tmp_path), big()), scores=True)
    p2, nll2, conf2 = proposals(
        qwen3_target, folder(tmp_path / "s", hf_config(tmp_path, top={"logit_scale": 2.0}), big()), scores=True
    )
    assert torch.equal(props, p2) and (conf2 >= conf - 1e-6).all() and not torch.allclose(nll, nll2)


# --- refusals: each names its key (phase 1, no target) --------------------------------------------


def _sd_with(**extra):
    return {**weights(), **extra}


REFUSALS = {  # name: (config change, tensors, words)
    "use_aux_hidden_state": (
        lambda c: c["dflash_config"].update(use_aux_hidden_state=False),
        None,
        "dflash_config.use_aux_hidden_state=False",
    ),
    "sink bias": (lambda c: c.update(add_swa_attention_sink_bias=True), None, "add_swa_attention_sink_bias=True"),
    "dflash sink bias": (
        lambda c: c["dflash_config"].update(attention_sink_bias=True),
        None,
        "dflash_config.attention_sink_bias=True",
    ),
    "use_swa without causal, window < block": (
        lambda c: c["dflash_config"].update(use_swa=True, swa_window_size=3),
        None,
        "causal=false with sliding_window=3 < block_size",
    ),
    "causal false, window < block": (
        lambda c: c.update(
            layer_types=["sliding_attention"] * 2,
            sliding_window=3,
            use_sliding_window=True,
            dflash_config={**c["dflash_config"], "causal": False},
        ),
        None,
        "causal=false with sliding_window=3 < block_size",
    ),
    "aux id 0": (
        lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 2, 3]),
        None,
        "eagle_aux_hidden_state_layer_ids=[0, 2, 3]",
    ),
    "reduced vocab without d2t": (
        lambda c: c.update(draft_vocab_size=64),
        _sd_with(**{"lm_head.weight": torch.zeros(64, H)}),
        "tensor d2t",
    ),
    "reduced vocab without head": (
        lambda c: c.update(draft_vocab_size=64),
        _sd_with(d2t=torch.zeros(64, dtype=torch.long)),
        "lm_head.weight",
    ),
    "d2t shape": (
        lambda c: c.update(draft_vocab_size=64),
        _sd_with(**{"lm_head.weight": torch.zeros(64, H), "d2t": torch.zeros(63, dtype=torch.long)}),
        "tensor d2t torch.int64 (63,)",
    ),
    "d2t out of range": (
        lambda c: c.update(draft_vocab_size=64),
        _sd_with(**{"lm_head.weight": torch.zeros(64, H), "d2t": torch.full((64,), 250, dtype=torch.long)}),
        "tensor d2t maps",
    ),
    "d2t on a full vocab": (
        lambda c: None,
        _sd_with(d2t=torch.arange(256).roll(1) - torch.arange(256)),
        "tensor d2t maps a full-size",
    ),
    "target_hidden_size": (lambda c: c.update(target_hidden_size=32), None, "target_hidden_size=32"),
    "own head shape": (
        lambda c: None,
        _sd_with(**{"lm_head.weight": torch.zeros(100, H)}),
        "lm_head.weight: checkpoint (100, 64)",
    ),
}
SPEC_REFUSALS = {
    "projector_type": ({"projector_type": "domino"}, "projector_type='domino'"),
    "sample_from_anchor": ({"sample_from_anchor": True}, "sample_from_anchor=True"),
    "shift_label": ({"shift_label": True}, "shift_label=True"),
    "speculative_tokens": (
        {"speculators_config": {"proposal_methods": [{"speculative_tokens": 5}]}},
        "speculators_config.proposal_methods[0].speculative_tokens=5",
    ),
    "aux ids missing": ({"aux_hidden_state_layer_ids": None}, "aux_hidden_state_layer_ids=None"),
    "eagle3": ({"speculators_model_type": "eagle3"}, "speculators_model_type='eagle3'"),
    "unknown key": ({"frobnicate": 8}, "unknown config key frobnicate=8"),
    "a DSpark key on dflash": ({"markov_rank": 8}, "config keys ['markov_rank'] are DSpark's"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_vllm_field_refusal_names_the_key(tmp_path, case):
    change, sd, words = REFUSALS[case]
    cfg = hf_config(tmp_path)
    change(cfg)
    path = folder(tmp_path / "d", cfg, sd if sd is not None else weights())
    with pytest.raises(CheckpointError) as e:
        read_drafter("hf", "x", path=str(path))
    assert words in str(e.value) and str(path) in str(e.value), str(e.value)


@pytest.mark.parametrize("case", list(SPEC_REFUSALS))
def test_speculators_field_refusal_names_the_key(tmp_path, case):
    change, words = SPEC_REFUSALS[case]
    path = folder(tmp_path / "d", speculators_config(tmp_path, **change), weights())
    with pytest.raises(CheckpointError) as e:
        read_drafter("hf", "x", path=str(path))
    assert words in str(e.value), str(e.value)


def test_non_causal_sliding_speculators_and_mask_embedding_file(tmp_path):
    raw = speculators_config(tmp_path, sliding_window_non_causal=True)
    assert (
        read_drafter("hf", "x", path=str(folder(tmp_path / "full", raw, weights()))).config.causal is None
    )  # no sliding layers: nothing
    raw["transformer_layer_config"].update(
        layer_types=["sliding_attention"] * 2, sliding_window=4, use_sliding_window=True
    )
    assert (
        read_drafter("hf", "x", path=str(folder(tmp_path / "swa", raw, weights()))).config.causal is False
    )  # non-causal sliding layers
    raw["sliding_window_non_causal"] = False
    assert (
        read_drafter("hf", "x", path=str(folder(tmp_path / "c", raw, weights()))).config.causal is None
    )  # sliding: causal by type
    path = folder(tmp_path / "m", hf_config(tmp_path), weights())
    torch.save(torch.zeros(H), path / "mask_embedding.pt")
    with pytest.raises(CheckpointError, match="mask_embedding.pt"):
        read_drafter("hf", "x", path=str(path))


@pytest.mark.slow
def test_refused_format_fields_exit_2_without_a_traceback(tmp_path, broken_target):
    """End to end: evaluate.py exits 2 naming the key, before the target's (broken) weights are read."""
    cfg = hf_config(tmp_path)
    cfg["dflash_config"]["use_aux_hidden_state"] = False
    vllm = folder(tmp_path / "vllm", cfg, weights())
    spec = folder(tmp_path / "spec", speculators_config(tmp_path, projector_type="domino"), weights())
    for drafter, words in ((vllm, "dflash_config.use_aux_hidden_state=False"), (spec, "projector_type='domino'")):
        r = _evaluate(tmp_path, broken_target, drafter)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_a_narrower_drafter_with_its_own_heads(qwen3_target, tmp_path):
    """target_hidden_size (the taps' width) above the drafter's hidden size, with its own embedding and
    LM head: written by save_hf_folder, read back, the online loop lossless and equal to the replay."""
    from dflash.models.drafter.config import DrafterConfig
    from dflash.models.drafter.files import save_hf_folder
    from dflash.models.drafter.model import DFlashDrafter

    cfg = DrafterConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=48,
        num_target_layers=6,
        target_layer_ids=[1, 3],
        mask_token_id=MASK_ID,
        block_size=B,
        target_hidden_size=64,
        own_embed=True,
        own_lm_head=True,
        vocab_size=256,
    )
    save_hf_folder(DFlashDrafter(cfg).init_weights(0, std=0.3), tmp_path / "narrow", dtype=torch.float32)
    d = load_drafter(qwen3_target, "hf", "x", path=str(tmp_path / "narrow")).model
    assert (d.fc.in_features, d.embed_tokens.weight.shape, d.lm_head.weight.shape) == (128, (256, 32), (256, 32))
    online = speculative_generate(qwen3_target, d, SEQ[:FIRST], 14)
    taps = tapped_forward(qwen3_target, torch.tensor([SEQ[:FIRST] + online.tokens]), d.cfg.target_layer_ids)[0]
    _, blocks = evaluate_sequence(d, qwen3_target, SEQ[:FIRST], online.tokens, taps)
    assert [b.proposal for b in blocks] == [b.proposal for b in online.blocks] and len(
        {tuple(b.proposal) for b in blocks}
    ) > 1
