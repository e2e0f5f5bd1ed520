"""The trainer (dflash/train/) and its data, on tiny random targets.

Each of the three bugs of DFLASH.md §4 has a test of its mechanism; flex vs dense loss runs where
CUDA exists (skipped on CPU). `test_trainer_equals_the_step_written_out` holds the trainer's
weights, bit for bit, to the training step written out straight on the full forward's
hidden_states (the route the trainer took before its taps came from tapped_forward).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dflash import train as T
from dflash.checkpoint import init_config
from dflash.drafter import DFlashDrafter
from dflash.errors import ConfigError
from dflash.target import Target, forward
from dflash.train.arch import base_layer_ids, drafter_config, init_drafter
from dflash.train.batch import Batcher, sample_anchors, step_batch
from dflash.train.config import BugsConfig, check
from dflash.train.data import Sequence
from dflash.train.labels import block_labels, final_tap_is_normed, greedy_labels_from_hidden, label_flip_stats, noised, response_last_hidden
from dflash.train.loss import dflash_loss
from dflash.train.step import StepSettings, lr_at, make_optimizer, variant_inputs
from dflash.train.taps import needed_layers, target_states
from dflash.train.variants import parse_variant, resolve_variants, variant_layer_ids

VOCAB, H, LAYERS = 96, 32, 4


def tiny_target(seed: int = 0, device: str = "cpu", head_dim: int = 8) -> Target:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    c = LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=2, pad_token_id=2)
    m = LlamaForCausalLM(c).eval().requires_grad_(False).to(device)
    m.generation_config.eos_token_id = 2
    return Target(model=m, tokenizer=None, identity=f"tiny-{seed}", source="tiny", max_context=256)


def greedy_seqs(target: Target, n: int = 6, prompt_len: int = 5, new: int = 40, seed: int = 0) -> list[Sequence]:
    """Prompts of random tokens, responses the target's own greedy tokens (EOS never stops it)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (1, prompt_len + i % 3), generator=g)
        for _ in range(new):
            nxt = forward(target, ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        out.append(Sequence(ids=ids[0].tolist(), prompt_len=prompt_len + i % 3))
    return out


def tiny_cfg(tmp_path: Path, **over):
    base = OmegaConf.structured(T.TrainConfig)
    cfg = OmegaConf.merge(base, {
        "target": {"name": "tiny", "kind": "hf", "path": "-", "max_context": 256, "default_taps": None, "mask_token_id": 5,
                   "template": {"use_chat_template": False, "enable_thinking": False, "system_prompt": None}},
        "device": {"name": "cpu", "dtype": "float32", "threads": None, "device_map": None},
        "tracking": {"enabled": False, "uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": None, "artifact_location": None},
        "drafter": {"num_layers": 1, "num_taps": 2, "intermediate_size": 48, "block_size": 4},
        "optim": {"steps": 4, "batch_size": 3, "blocks_per_seq": 4, "max_seq_len": 64, "warmup_steps": 1, "lr": 3e-3, "attention": "sdpa"},
        "out_dir": str(tmp_path / "runs"), "export_dir": str(tmp_path / "ckpt"), "save_every": 2, "log_every": 1, "metrics_every": 2,
    })
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
    assert lab[0, 1].tolist() == [109, 110, 111, 112] and valid[0, 1].tolist() == [False, True, True, False]  # 12 is past T


def test_loss_is_position_weighted_and_normalised():
    B, V = 4, 7
    logits = torch.randn(1, 2, B, V)
    labels = torch.randint(0, V, (1, 2, B))
    valid = torch.tensor([[[False, True, True, True], [False, True, False, False]]])
    ce = torch.nn.functional.cross_entropy(logits.view(-1, V), labels.view(-1), reduction="none").view(1, 2, B)
    w = torch.exp(-(torch.arange(B) - 1) / 7.0)
    want = sum(ce[0, n, k] * w[k] for n in range(2) for k in range(1, B) if valid[0, n, k]) / sum(w[k] for n in range(2) for k in range(1, B) if valid[0, n, k])
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
    bug = variant_inputs(target, states, batch, model, BugsConfig(noisy_labels=True), s, torch.Generator().manual_seed(0))
    assert torch.equal(bug.taps, fixed.taps) and (bug.labels != bug.clean)[bug.slot_valid].any()
    out = T.train(tiny_cfg(tmp_path, optim={"noise_std": 0.5, "steps": 1}), target=target, seqs=seqs)
    assert out["fixed"]["acc"] == out["fixed"]["acc_clean"]  # labels == greedy tokens


def test_bad_config_values_name_their_field(tmp_path):
    with pytest.raises(ConfigError, match="optim.attention"):
        check(tiny_cfg(tmp_path, optim={"attention": "flash"}))
    with pytest.raises(ConfigError, match="drafter.block_size"):
        check(tiny_cfg(tmp_path, drafter={"block_size": 1}))
    with pytest.raises(ConfigError, match="unknown variant"):
        resolve_variants(tiny_cfg(tmp_path, variants=["fixed", "noisy_label"]))
    assert parse_variant("noisy_labels+final_layer").bugs == BugsConfig(noisy_labels=True, final_layer=True)
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
        loss = dflash_loss(tgt.lm_head(d(taps, emb, anchors, backend=backend, see_anchor=see_anchor)), labels, valid, 7.0)
        loss.backward()
        losses[backend], grads[backend] = loss.item(), d.fc.weight.grad.clone()
    # flex's Triton kernels may multiply fp32 in TF32: agreement to ~1e-3, not bit for bit
    assert losses["flex"] == pytest.approx(losses["sdpa"], rel=2e-3, abs=1e-4)
    assert torch.allclose(grads["flex"], grads["sdpa"], rtol=2e-2, atol=1e-4)


# --- the loop: checkpoints, resume, export, lockstep variants --------------------------------


def test_train_lockstep_checkpoints_resume_and_export(target, seqs, tmp_path):
    from dflash.checkpoint import load_drafter

    cfg = tiny_cfg(tmp_path, variants=["fixed", "noisy_labels", "final_layer", "loss_dilution"], optim={"noise_std": 0.3, "steps": 4}, export_steps=[2])
    out = T.train(cfg, target=target, seqs=seqs)
    assert set(out) == {"fixed", "noisy_labels", "final_layer", "loss_dilution"}
    assert out["noisy_labels"]["acc"] != out["noisy_labels"]["acc_clean"] or out["noisy_labels"]["label_flip_rate"] > 0
    for v in out:
        run = tmp_path / "runs" / v
        assert (run / "step_2" / "checkpoint.pt").is_file() and (run / "step_4" / "checkpoint.pt").is_file()
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert {"loss", "lr", "tokens_per_s"} <= set(rows[0]) and any("acc_1" in r for r in rows)
        assert all(r["wall_s_per_step"] > 0 for r in rows if "acc_1" in r)
        for step in (2, 4):  # exported weights-only folders load as kind=training
            ld = load_drafter(target, "training", v, run_dir=str(tmp_path / "ckpt" / v), step=step)
            assert ld.step == step
    cfg_fl = json.loads((tmp_path / "ckpt" / "final_layer" / "step_4" / "config.json").read_text())
    assert cfg_fl["dflash_config"]["target_layer_ids"][-1] == LAYERS - 1
    # full checkpoints load too (evaluator path), and training resumes where it stopped
    ld = load_drafter(target, "training", "fixed", run_dir=str(tmp_path / "runs" / "fixed"), step=4)
    straight = T.train(tiny_cfg(tmp_path / "b", optim={"steps": 6}), target=target, seqs=seqs)
    T.train(tiny_cfg(tmp_path / "c", optim={"steps": 6}, stop_after=3), target=target, seqs=seqs)
    resumed = T.train(tiny_cfg(tmp_path / "c", optim={"steps": 6}), target=target, seqs=seqs)
    a = torch.load(tmp_path / "b" / "runs" / "fixed" / "step_6" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "c" / "runs" / "fixed" / "step_6" / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a), "resume reproduces the uninterrupted run"
    assert ld.model.cfg.block_size == 4 and straight["fixed"]["step"] == resumed["fixed"]["step"] == 6


def reference_weights(cfg, target, seqs, steps: int) -> dict[str, dict[str, torch.Tensor]]:
    """The trainer's steps written out straight, on the full forward's hidden_states: weights per variant."""
    o, B, seed = cfg.optim, cfg.drafter.block_size, cfg.seed
    batcher = Batcher(seqs, o.batch_size, o.max_seq_len, 2, seed)
    runs = {}
    for v in resolve_variants(cfg):
        model = init_drafter(drafter_config(cfg, target, variant_layer_ids(base_layer_ids(cfg, LAYERS), LAYERS, v.bugs)), target, seed, torch.device("cpu"))
        runs[v.name] = (model, make_optimizer(model, o, torch.device("cpu")), v.bugs)
    for step in range(steps):
        ids, seq_lens, prompt_lens = batcher.get(step)
        anchors, block_valid = sample_anchors(prompt_lens, seq_lens, o.blocks_per_seq, torch.Generator().manual_seed(seed * 7919 + step))
        attn = (torch.arange(ids.shape[1])[None] < seq_lens[:, None]).long()
        with torch.no_grad():
            out = forward(target, ids, attention_mask=attn, hidden_states=True)
        hidden = out.hidden_states
        assert torch.allclose(target.lm_head(hidden[-1]), out.logits, atol=1e-5)  # hidden_states[-1] is through the final norm
        for model, opt, bugs in runs.values():
            gen = torch.Generator().manual_seed(seed * 104729 + step)
            taps = noised(torch.cat([hidden[L + 1] for L in model.cfg.target_layer_ids], -1), o.noise_std, gen)
            clean, valid = block_labels(ids, seq_lens, anchors, block_valid, B)
            labels = clean
            if bugs.noisy_labels:
                noisy = greedy_labels_from_hidden(target, noised(hidden[-1], o.noise_std, gen), anchors, B, normed=True)
                labels = torch.where(torch.arange(B) == 0, clean, noisy)
            block = torch.full_like(clean, model.cfg.mask_token_id)
            block[..., 0] = clean[..., 0]
            logits = target.lm_head(model(taps, target.embed(block), anchors, see_anchor=bugs.final_layer))
            loss = dflash_loss(logits, labels, valid, o.gamma, dilution_bug=bugs.loss_dilution)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, o.steps, o.warmup_steps, o.lr, o.min_lr_ratio)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
            opt.step()
    return {name: model.state_dict() for name, (model, _, _) in runs.items()}


def test_trainer_equals_the_step_written_out(target, seqs, tmp_path):
    """Three lockstep steps of the four variants (noise on: bug 1's labels draw from it) give the
    same weights, bit for bit, as the step written out on the full forward; one tapped pass serves
    all four (the union of their taps, the final layer included for bug 1)."""
    cfg = tiny_cfg(tmp_path, variants=["fixed", "noisy_labels", "final_layer", "loss_dilution"], optim={"noise_std": 0.3, "steps": 3})
    assert needed_layers([[1, 2], [1, 3]], LAYERS, final=False) == [1, 2, 3] and needed_layers([[0, 1]], LAYERS, final=True) == [0, 1, 3]
    T.train(cfg, target=target, seqs=seqs)
    want = reference_weights(cfg, target, seqs, 3)
    for name, sd in want.items():
        got = torch.load(tmp_path / "runs" / name / "step_3" / "checkpoint.pt", weights_only=True)["model"]
        assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd), name
        start = init_drafter(drafter_config(cfg, target, [1, 2]), target, cfg.seed, torch.device("cpu")).state_dict()
        assert not torch.equal(got["layers.0.mlp.up_proj.weight"], start["layers.0.mlp.up_proj.weight"]), "the steps moved the weights"


def test_mlflow_one_run_per_variant(target, seqs, tmp_path):
    mlflow = pytest.importorskip("mlflow")
    cfg = tiny_cfg(tmp_path, variants=["fixed", "loss_dilution"], tracking={"enabled": True}, optim={"steps": 2})
    T.train(cfg, target=target, seqs=seqs)
    mlflow.set_tracking_uri(cfg.tracking.uri)
    runs = mlflow.search_runs(experiment_names=["dflash-train/tiny"])
    assert sorted(runs["tags.dflash.variant"]) == ["fixed", "loss_dilution"]
    assert "metrics.acc_1" in runs and "metrics.tokens_per_s" in runs
    rid = T.import_metrics(tmp_path / "runs" / "fixed", uri=cfg.tracking.uri, experiment="imported", target_name="tiny")
    assert mlflow.get_run(rid).data.metrics["loss"] > 0


# --- data ---------------------------------------------------------------------------------------


def test_no_training_prompt_overlaps_an_evaluation_prompt():
    from dflash.train.prompts import build_prompts, evaluation_prompts, overlaps, prompt_text, OverlapFilter

    evals = evaluation_prompts()
    assert {"builtin", "humaneval"} <= set(evals) and len(evals["humaneval"]) == 164
    flat = [p for ps in evals.values() for p in ps]
    train = build_prompts(8192, 0)
    assert len(train) > 7000
    filt = OverlapFilter(flat)
    bad = [prompt_text(p) for p in train if filt.hits(prompt_text(p))]
    assert not bad, bad[:3]
    texts = {prompt_text(p) for p in flat}
    assert not texts & {prompt_text(p) for p in train}
    # the check itself catches what it should
    e = prompt_text(evals["builtin"][0])
    assert overlaps(e, "Intro. " + e) and overlaps(e, e.upper())
    assert overlaps("A baker makes 14 trays of muffins with 9 muffins on each tray and more", e)
    assert not overlaps("Write a Python function that adds two numbers.", e)


def test_training_prompts_deterministic_and_mixed():
    from dflash.train.prompts import build_prompts, prompt_text

    a, b = build_prompts(500, 3), build_prompts(500, 3)
    assert [prompt_text(p) for p in a] == [prompt_text(p) for p in b]
    texts = [prompt_text(p) for p in a]
    assert any("step" in t.lower() and any(c.isdigit() for c in t) for t in texts)  # arithmetic
    assert any("`" in t for t in texts)  # coding


def test_sequences_regenerated_and_cached(target, tmp_path):
    from dflash.train.data import build_sequences
    from dflash.prompts import Prompt

    class Tok:
        chat_template = None
        pad_token_id = 2
        eos_token_id = 2

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [3 + (ord(c) % (VOCAB - 3)) for c in text]}

    target.tokenizer = Tok()
    try:
        ps = [Prompt(id=str(i), subset="t", messages=(("user", f"task {i} abc"),)) for i in range(5)]
        tmpl = {"use_chat_template": False}
        s1 = build_sequences(target, ps, tmpl, 12, 64, 2, tmp_path, shard_size=2, min_response_tokens=1)
        shards = sorted((tmp_path / "train_data").rglob("shard_*.pt"))
        assert len(shards) == 3 and not list((tmp_path / "train_data").rglob("*.tmp"))
        s2 = build_sequences(target, ps, tmpl, 12, 64, 2, tmp_path, shard_size=2, min_response_tokens=1)
        assert [s.ids for s in s1] == [s.ids for s in s2]
        for s in s1:  # the response is the target's greedy continuation
            ids = torch.tensor([s.ids[: s.prompt_len]])
            assert forward(target, ids).logits[0, -1].argmax().item() == s.ids[s.prompt_len]
        import copy
        import dataclasses

        bf16 = dataclasses.replace(target, model=copy.deepcopy(target.model).to(torch.bfloat16))
        build_sequences(bf16, ps, tmpl, 12, 64, 2, tmp_path, shard_size=2, min_response_tokens=1)
        assert len(list((tmp_path / "train_data").iterdir())) == 2  # another dtype: other labels, another key
    finally:
        target.tokenizer = None


def test_label_flip_stats_measure_what_bug1_does_to_the_labels(target, seqs):
    """No noise flips nothing; more noise flips more; a position flips its majority only if >= half its draws flip."""
    h = response_last_hidden(target, seqs)
    assert h.shape == (sum(len(s.ids) - s.prompt_len for s in seqs), H)
    normed = final_tap_is_normed(target)
    stats = [label_flip_stats(target, h, std, normed, draws=16, gen=torch.Generator().manual_seed(0)) for std in (0.0, 0.3, 1.0)]
    assert stats[0].flip_rate == 0 and stats[0].majority_flip_rate == 0
    assert 0 < stats[1].flip_rate < stats[2].flip_rate and stats[1].majority_flip_rate <= stats[2].majority_flip_rate
    assert all(s.majority_flip_rate <= 2 * s.flip_rate + 1e-9 for s in stats)
