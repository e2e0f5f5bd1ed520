"""The trainer's pieces (dflash/train/) on tiny random targets: anchors, labels, loss, schedule,
noise, config checks, and each of the three bugs of docs/family.md §4 by its mechanism; flex vs dense
loss where CUDA exists (skipped on CPU). The fixtures here (tiny_target, greedy_seqs, tiny_cfg)
serve test_train_loop.py and test_train_data.py too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dflash import train as T
from dflash.config.train import BugsConfig, check
from dflash.models.drafter.checkpoint import init_config
from dflash.models.drafter.model import DFlashDrafter
from dflash.models.target.forward import forward
from dflash.models.target.model import Target
from dflash.train.batch import Batcher, sample_anchors, step_batch
from dflash.train.data import TrainSeq
from dflash.train.labels import block_labels, final_tap_is_normed, greedy_labels_from_hidden, noised
from dflash.train.loss import dflash_loss
from dflash.train.step import StepSettings, lr_at, variant_inputs
from dflash.train.taps import needed_layers, target_states
from dflash.train.variants import parse_variant, resolve_variants, variant_layer_ids
from dflash.util.errors import ConfigError

VOCAB, H, LAYERS = 96, 32, 4


def tiny_target(seed: int = 0, device: str = "cpu", head_dim: int = 8) -> Target:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    c = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=2,
    )
    m = LlamaForCausalLM(c).eval().requires_grad_(False).to(device)
    m.generation_config.eos_token_id = 2
    return Target(model=m, tokenizer=None, identity=f"tiny-{seed}", source="tiny", max_context=256)


def greedy_seqs(target: Target, n: int = 6, prompt_len: int = 5, new: int = 40, seed: int = 0) -> list[TrainSeq]:
    """Prompts of random tokens, responses the target's own greedy tokens (EOS never stops it)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (1, prompt_len + i % 3), generator=g)
        for _ in range(new):
            nxt = forward(target, ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        out.append(TrainSeq(ids=ids[0].tolist(), prompt_len=prompt_len + i % 3))
    return out


def tiny_cfg(tmp_path: Path, **over):
    base = OmegaConf.structured(T.TrainConfig)
    cfg = OmegaConf.merge(
        base,
        {
            "target": {
                "name": "tiny",
                "kind": "hf",
                "path": "-",
                "max_context": 256,
                "default_taps": None,
                "mask_token_id": 5,
                "template": {"use_chat_template": False, "enable_thinking": False, "system_prompt": None},
            },
            "device": {"name": "cpu", "dtype": "float32", "threads": None, "device_map": None},
            "tracking": {
                "enabled": False,
                "uri": f"sqlite:///{tmp_path}/mlflow.db",
                "experiment": None,
                "artifact_location": None,
            },
            "drafter": {"num_layers": 1, "num_taps": 2, "intermediate_size": 48, "block_size": 4},
            "optim": {
                "steps": 4,
                "batch_size": 3,
                "blocks_per_seq": 4,
                "max_seq_len": 64,
                "warmup_steps": 1,
                "lr": 3e-3,
                "attention": "sdpa",
            },
            "out_dir": str(tmp_path / "runs"),
            "export_dir": str(tmp_path / "ckpt"),
            "save_every": 2,
            "log_every": 1,
            "metrics_every": 2,
        },
    )
    return OmegaConf.merge(cfg, over)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def seqs(target):
    return greedy_seqs(target)


# --- §4 pieces --------------------------------------------------------------------------------


def test_anchors_inside_responses():
    g = torch.Generator().manual_seed(0)
    P, L = torch.tensor([5, 10, 3]), torch.tensor([30, 13, 4])
    a, v = sample_anchors(P, L, 8, g)
    for s in range(3):
        got = a[s][v[s]].tolist()
        assert got == sorted(set(got)), "anchors are distinct and sorted"
        assert all(int(P[s]) <= p <= int(L[s]) - 2 for p in got), "anchors lie in P .. T-2"
    assert v[0].all() and v[1].sum() == 2 and v[2].sum() == 0  # 13-2-10+1 = 2 positions; none in a 1-token response


def test_labels_are_tokens_at_anchor_plus_k():
    ids = torch.arange(100, 120)[None]  # one sequence, T = 12 real tokens, padded to 20
    lab, valid = block_labels(ids, torch.tensor([12]), torch.tensor([[4, 9]]), torch.tensor([[True, True]]), 4)
    assert lab[0, 0].tolist() == [104, 105, 106, 107] and valid[0, 0].tolist() == [False, True, True, True]
    assert lab[0, 1].tolist() == [109, 110, 111, 112] and valid[0, 1].tolist() == [
        False,
        True,
        True,
        False,
    ]  # 12 is past T


def test_loss_is_position_weighted_and_normalised():
    B, V = 4, 7
    logits = torch.randn(1, 2, B, V)
    labels = torch.randint(0, V, (1, 2, B))
    valid = torch.tensor([[[False, True, True, True], [False, True, False, False]]])
    ce = torch.nn.functional.cross_entropy(logits.view(-1, V), labels.view(-1), reduction="none").view(1, 2, B)
    w = torch.exp(-(torch.arange(B) - 1) / 7.0)
    want = sum(ce[0, n, k] * w[k] for n in range(2) for k in range(1, B) if valid[0, n, k]) / sum(
        w[k] for n in range(2) for k in range(1, B) if valid[0, n, k]
    )
    assert torch.allclose(dflash_loss(logits, labels, valid, 7.0), want)
    assert torch.allclose(dflash_loss(logits, labels, valid, 7.0, dilution_bug=True), ce.mean())


def test_lr_schedule():
    assert lr_at(0, 100, 10, 1.0, 0.1) == pytest.approx(0.1)
    assert lr_at(9, 100, 10, 1.0, 0.1) == pytest.approx(1.0)
    assert lr_at(99, 100, 10, 1.0, 0.1) == pytest.approx(0.1, abs=1e-3)
    assert lr_at(55, 100, 10, 1.0, 0.1) == pytest.approx(0.55, abs=1e-6)


def test_noise_touches_fc_inputs_only(target, seqs, tmp_path):
    """With augmentation noise and no bug, labels stay the greedy tokens and the taps are noised;
    bug 1 alone changes the labels."""
    batch = step_batch(Batcher(seqs, 3, 64, 2, 0), 0, 0, 4)
    layers = [1, 2]
    states = target_states(target, batch.ids, batch.seq_lens, needed_layers([layers], LAYERS, final=True))
    model = DFlashDrafter(init_config(target, 1, 2, 5, 4, layers))
    s = StepSettings("sdpa", None, 7.0, 1.0, 1.0, final_tap_is_normed(target))
    fixed = variant_inputs(target, states, batch, model, BugsConfig(), s, torch.Generator().manual_seed(0))
    assert torch.equal(fixed.labels, fixed.clean) and fixed.slot_valid.any()
    assert not torch.equal(fixed.taps, states.select(layers)), "the fc inputs are noised"
    bug = variant_inputs(
        target, states, batch, model, BugsConfig(noisy_labels=True), s, torch.Generator().manual_seed(0)
    )
    assert torch.equal(bug.taps, fixed.taps) and (bug.labels != bug.clean)[bug.slot_valid].any()
    out = T.train(tiny_cfg(tmp_path, optim={"noise_std": 0.5, "steps": 1}), target=target, seqs=seqs)
    assert out["fixed"]["acc"] == out["fixed"]["acc_clean"]  # labels == greedy tokens


def test_bad_config_values_name_their_field(tmp_path):
    with pytest.raises(ConfigError, match="optim.attention"):
        check(tiny_cfg(tmp_path, optim={"attention": "flash"}))
    with pytest.raises(ConfigError, match="drafter.block_size"):
        check(tiny_cfg(tmp_path, drafter={"block_size": 1}))
    with pytest.raises(ConfigError, match="data.prompt_offset"):
        check(tiny_cfg(tmp_path, data={"prompt_offset": -1}))
    with pytest.raises(ConfigError, match="unknown variant"):
        resolve_variants(tiny_cfg(tmp_path, variants=["fixed", "noisy_label"]))
    assert parse_variant("noisy_labels+final_layer").bugs == BugsConfig(noisy_labels=True, final_layer=True)
    v = parse_variant("fixed-dflash2-l2-t5-i1024")  # shape suffixes: drafter.* of that variant only
    assert v.bugs == BugsConfig() and v.arch == {
        "arch": "dflash2",
        "num_layers": 2,
        "num_taps": 5,
        "intermediate_size": 1024,
    }
    assert parse_variant("loss_dilution-l3").bugs == BugsConfig(loss_dilution=True)
    with pytest.raises(ConfigError, match="unknown suffix -x2"):
        parse_variant("fixed-x2")
    assert [v.name for v in resolve_variants(tiny_cfg(tmp_path, bugs={"loss_dilution": True}))] == ["loss_dilution"]


# --- the three bugs ---------------------------------------------------------------------------


def test_bug1_noisy_labels_differ_from_greedy_tokens(target, seqs):
    """Labels from noised hidden states are not the target's greedy tokens; from clean ones, they are."""
    B = 4
    ids = torch.tensor([seqs[0].ids])
    L = ids.shape[1]
    hidden = forward(target, ids, hidden_states=True).hidden_states
    anchors = torch.tensor([[seqs[0].prompt_len, seqs[0].prompt_len + 7, L - 5]])
    clean, valid = block_labels(ids, torch.tensor([L]), anchors, torch.ones_like(anchors, dtype=torch.bool), B)
    normed = final_tap_is_normed(target)
    same = greedy_labels_from_hidden(target, hidden[-1], anchors, B, normed)
    assert torch.equal(same[valid], clean[valid]), "noise-free logits give back the greedy tokens"
    g = torch.Generator().manual_seed(0)
    noisy = greedy_labels_from_hidden(target, noised(hidden[-1], 1.0, g), anchors, B, normed)
    assert (noisy[valid] != clean[valid]).float().mean() > 0.2, "the bug's labels differ from the greedy tokens"


def test_bug2_block_sees_its_anchors_final_layer_feature(target, seqs):
    base = [1, 2]
    ids_fixed = variant_layer_ids(base, LAYERS, BugsConfig())
    ids_bug = variant_layer_ids(base, LAYERS, BugsConfig(final_layer=True))
    assert LAYERS - 1 not in ids_fixed and ids_bug[-1] == LAYERS - 1
    s = seqs[0]
    ids = torch.tensor([s.ids])
    hidden = forward(target, ids, hidden_states=True).hidden_states
    p = s.prompt_len + 3
    # the final layer's feature at p encodes token p+1: the shortcut
    assert target.lm_head(hidden[LAYERS][0, p]).argmax() == ids[0, p + 1]
    cfg = init_config(target, 1, 2, 5, 4, ids_bug)
    d = DFlashDrafter(cfg).init_weights(0)
    taps = torch.cat([hidden[L + 1] for L in ids_bug], -1)
    poked = taps.clone()
    poked[0, p] += 5.0  # change only the anchor position's feature
    blk = torch.full((1, 1, 4), 5)
    blk[..., 0] = ids[0, p]
    emb = target.embed(blk)
    a = torch.tensor([[p]])
    with torch.no_grad():
        leak = (d(taps, emb, a, see_anchor=True) - d(poked, emb, a, see_anchor=True)).abs().max()
        fixed = (d(taps, emb, a, see_anchor=False) - d(poked, emb, a, see_anchor=False)).abs().max()
    assert leak > 1e-3, "with the bug a block sees its anchor's (final-layer) feature"
    assert fixed == 0, "without it, the anchor position's feature is invisible to its block"


def test_bug3_gradient_on_slots_1_to_B_minus_1_shrinks():
    torch.manual_seed(0)
    S, N, B, V = 2, 3, 4, 11
    logits = torch.randn(S, N, B, V, requires_grad=True)
    labels = torch.randint(0, V, (S, N, B))
    valid = torch.ones(S, N, B, dtype=torch.bool)
    valid[..., 0] = False
    valid[1, 2] = False  # a padded block
    valid[0, 1, 3] = False  # past the end
    grads = {}
    for bug in (False, True):
        logits.grad = None
        dflash_loss(logits, labels, valid, 7.0, dilution_bug=bug).backward()
        g = logits.grad.norm(dim=-1)  # [S, N, B]
        grads[bug] = (g[valid].sum(), g.sum())
    fixed_useful, fixed_total = grads[False]
    bug_useful, bug_total = grads[True]
    assert torch.isclose(fixed_useful, fixed_total), "correct loss: all gradient on valid slots 1..B-1"
    assert bug_useful < 0.8 * fixed_useful, "bug 3: less gradient reaches the slots that decide τ"
    assert bug_useful / bug_total < 0.9, "bug 3: gradient spent on the anchor slot and padding"


# --- flex vs dense (CUDA only) ----------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention needs CUDA")
@pytest.mark.parametrize("see_anchor", [False, True])
def test_flex_and_dense_masks_give_the_same_loss(see_anchor):
    tgt = tiny_target(device="cuda", head_dim=16)  # flex_attention's kernels need head_dim >= 16
    torch.manual_seed(0)
    S, L, N, B = 2, 128, 8, 16
    ids = torch.randint(3, VOCAB, (S, L), device="cuda")
    hidden = forward(tgt, ids, hidden_states=True).hidden_states
    cfg = init_config(tgt, 1, 2, 5, B, [1, 2])
    d = DFlashDrafter(cfg).init_weights(0).cuda()
    taps = torch.cat([hidden[2], hidden[3]], -1)
    g = torch.Generator().manual_seed(0)
    anchors, bv = sample_anchors(torch.tensor([10, 20]), torch.tensor([L, L - 30]), N, g)
    anchors, bv = anchors.cuda(), bv.cuda()
    labels, valid = block_labels(ids, torch.tensor([L, L - 30], device="cuda"), anchors, bv, B)
    blk = torch.full_like(labels, 5)
    blk[..., 0] = labels[..., 0]
    emb = tgt.embed(blk)
    losses, grads = {}, {}
    for backend in ("sdpa", "flex"):
        d.zero_grad()
        loss = dflash_loss(
            tgt.lm_head(d(taps, emb, anchors, backend=backend, see_anchor=see_anchor)), labels, valid, 7.0
        )
        loss.backward()
        losses[backend], grads[backend] = loss.item(), d.fc.weight.grad.clone()
    # flex's Triton kernels may multiply fp32 in TF32: agreement to ~1e-3, not bit for bit
    assert losses["flex"] == pytest.approx(losses["sdpa"], rel=2e-3, abs=1e-4)
    assert torch.allclose(grads["flex"], grads["sdpa"], rtol=2e-2, atol=1e-4)
