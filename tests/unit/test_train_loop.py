"""The training loop on tiny random targets: the trainer against its step written out, lockstep
variants, checkpoints, resume, exports, MLflow.

`test_trainer_equals_the_step_written_out` holds the trainer's weights, bit for bit, to the training
step written out straight on the full forward's hidden_states (the route the trainer took before
its taps came from one tapped_forward call per step).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_train import LAYERS, seqs, target, tiny_cfg  # noqa: F401 (fixtures)

from dflash import train as T
from dflash.models.target.forward import forward
from dflash.train.arch import base_layer_ids, drafter_config, init_drafter
from dflash.train.batch import Batcher, sample_anchors
from dflash.train.labels import block_labels, greedy_labels_from_hidden, noised
from dflash.train.loss import dflash_loss
from dflash.train.step import lr_at, make_optimizer
from dflash.train.taps import needed_layers
from dflash.train.variants import resolve_variants, variant_layer_ids


def test_train_lockstep_checkpoints_resume_and_export(target, seqs, tmp_path):
    from shortcuts import load_drafter

    cfg = tiny_cfg(
        tmp_path,
        variants=["fixed", "noisy_labels", "final_layer", "loss_dilution"],
        optim={"noise_std": 0.3, "steps": 4},
        export_steps=[2],
    )
    out = T.train(cfg, target=target, seqs=seqs)
    assert set(out) == {"fixed", "noisy_labels", "final_layer", "loss_dilution"}
    assert out["noisy_labels"]["acc"] != out["noisy_labels"]["acc_clean"] or out["noisy_labels"]["label_flip_rate"] > 0
    for v in out:
        run = tmp_path / "runs" / v
        assert (run / "step_2" / "checkpoint.pt").is_file() and (run / "step_4" / "checkpoint.pt").is_file()
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert {"loss", "lr", "grad_norm", "tokens_per_s"} <= set(rows[0]) and any(
            "acc_1" in r for r in rows
        )  # clipping on: its norm
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


def test_warm_start_takes_an_exports_weights_and_refuses_another_shape(target, seqs, tmp_path):
    """init_from: a variant with no checkpoint starts from the latest export of the same variant (step 0 of a
    new schedule), or with init_variant of that variant for all; an export of another shape is refused with the field
    named."""
    from safetensors.torch import load_file

    from dflash.util.errors import ConfigError

    T.train(tiny_cfg(tmp_path / "a", optim={"steps": 2}, export_steps=[1]), target=target, seqs=seqs)
    init = str(tmp_path / "a" / "ckpt")
    T.train(tiny_cfg(tmp_path / "b", optim={"steps": 3}, init_from=init, stop_after=0), target=target, seqs=seqs)
    a = load_file(
        str(tmp_path / "a" / "ckpt" / "fixed" / "step_2" / "model.safetensors")
    )  # the latest export, not step 1
    b = load_file(str(tmp_path / "b" / "ckpt" / "fixed" / "step_0" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cold = load_file(str(tmp_path / "a" / "ckpt" / "fixed" / "step_1" / "model.safetensors"))
    assert any(not torch.equal(a[k], cold[k]) for k in a)  # the step taken mattered: a copy of step 1 would fail above
    refused = (
        r"init_from: .*fixed/step_2: weights do not fit the drafter .*; missing \['layers\.1\..*drafter\.\* settings"
    )
    with pytest.raises(ConfigError, match=refused):  # no seqs: refused before any data is made
        T.train(tiny_cfg(tmp_path / "c", optim={"steps": 2}, drafter={"num_layers": 2}, init_from=init), target=target)
    with pytest.raises(ConfigError, match="no export of variant loss_dilution"):
        T.train(
            tiny_cfg(tmp_path / "d", optim={"steps": 2}, variants=["loss_dilution"], init_from=init),
            target=target,
            seqs=seqs,
        )
    # init_variant: every variant starts from that one variant's export (a bug entering a run midway)
    T.train(
        tiny_cfg(
            tmp_path / "e",
            optim={"steps": 3},
            variants=["fixed", "loss_dilution"],
            init_from=init,
            init_variant="fixed",
            stop_after=0,
        ),
        target=target,
        seqs=seqs,
    )
    for v in ("fixed", "loss_dilution"):
        e = load_file(str(tmp_path / "e" / "ckpt" / v / "step_0" / "model.safetensors"))
        assert e.keys() == a.keys() and all(torch.equal(a[k], e[k]) for k in a)
    with pytest.raises(ConfigError, match="init_variant=fixed: .*set init_from="):
        T.train(tiny_cfg(tmp_path / "f", optim={"steps": 2}, init_variant="fixed"), target=target)


def test_shape_variants_share_one_lockstep_run(target, seqs, tmp_path):
    """fixed-l2 / fixed-t3 / fixed-dflash2 train beside fixed on the same data: each gets its own shape, taps
    and architecture, exported as the evaluator loads it; fixed is what it is when trained alone."""
    from shortcuts import load_drafter

    cfg = tiny_cfg(
        tmp_path,
        variants=["fixed", "fixed-l2", "fixed-t3", "fixed-dflash2"],
        optim={"steps": 2},
        drafter={"selector_rank": 4, "selector_top_k": 4, "conv_group_size": 8},
    )
    T.train(cfg, target=target, seqs=seqs)
    names = ("fixed", "fixed-l2", "fixed-t3", "fixed-dflash2")
    shapes = {v: json.loads((tmp_path / "ckpt" / v / "step_2" / "config.json").read_text()) for v in names}
    assert shapes["fixed"]["num_hidden_layers"] == 1 and shapes["fixed-l2"]["num_hidden_layers"] == 2
    assert (
        len(shapes["fixed"]["dflash_config"]["target_layer_ids"]) == 2
        and len(shapes["fixed-t3"]["dflash_config"]["target_layer_ids"]) == 3
    )
    assert shapes["fixed-dflash2"]["architectures"] == ["DFlash2DraftModel"] and shapes["fixed"]["architectures"] == [
        "DFlashDraftModel"
    ]
    for v in shapes:
        assert load_drafter(target, "training", v, run_dir=str(tmp_path / "ckpt" / v), step=2).step == 2
    alone = tiny_cfg(tmp_path / "alone", optim={"steps": 2})
    T.train(alone, target=target, seqs=seqs)
    a = torch.load(tmp_path / "runs" / "fixed" / "step_2" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "alone" / "runs" / "fixed" / "step_2" / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def reference_weights(cfg, target, seqs, steps: int) -> dict[str, dict[str, torch.Tensor]]:
    """The trainer's steps written out straight, on the full forward's hidden_states: weights per variant."""
    o, B, seed = cfg.optim, cfg.drafter.block_size, cfg.seed
    batcher = Batcher(seqs, o.batch_size, o.max_seq_len, 2, seed)
    runs = {}
    for v in resolve_variants(cfg):
        model = init_drafter(
            drafter_config(cfg, target, variant_layer_ids(base_layer_ids(cfg, LAYERS), LAYERS, v.bugs)),
            target,
            seed,
            torch.device("cpu"),
        )
        runs[v.name] = (model, make_optimizer(model, o, torch.device("cpu")), v.bugs)
    for step in range(steps):
        ids, seq_lens, prompt_lens = batcher.get(step)
        anchors, block_valid = sample_anchors(
            prompt_lens, seq_lens, o.blocks_per_seq, torch.Generator().manual_seed(seed * 7919 + step)
        )
        attn = (torch.arange(ids.shape[1])[None] < seq_lens[:, None]).long()
        with torch.no_grad():
            out = forward(target, ids, attention_mask=attn, hidden_states=True)
        hidden = out.hidden_states
        assert torch.allclose(
            target.lm_head(hidden[-1]), out.logits, atol=1e-5
        )  # hidden_states[-1] is through the final norm
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
    cfg = tiny_cfg(
        tmp_path,
        variants=["fixed", "noisy_labels", "final_layer", "loss_dilution"],
        optim={"noise_std": 0.3, "steps": 3},
    )
    assert needed_layers([[1, 2], [1, 3]], LAYERS, final=False) == [1, 2, 3] and needed_layers(
        [[0, 1]], LAYERS, final=True
    ) == [0, 1, 3]
    T.train(cfg, target=target, seqs=seqs)
    want = reference_weights(cfg, target, seqs, 3)
    for name, sd in want.items():
        got = torch.load(tmp_path / "runs" / name / "step_3" / "checkpoint.pt", weights_only=True)["model"]
        assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd), name
        start = init_drafter(drafter_config(cfg, target, [1, 2]), target, cfg.seed, torch.device("cpu")).state_dict()
        assert not torch.equal(got["layers.0.mlp.up_proj.weight"], start["layers.0.mlp.up_proj.weight"]), (
            "the steps moved the weights"
        )


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


@pytest.mark.parametrize("stop, status", [(KeyboardInterrupt, "KILLED"), (RuntimeError, "FAILED")])
def test_a_training_run_stopped_midway_ends_killed_or_failed(target, seqs, tmp_path, monkeypatch, stop, status):
    """Ctrl-C (or SIGTERM, raised as Terminated) and an error during training end every variant's MLflow run KILLED or
    FAILED, never FINISHED nor RUNNING."""
    mlflow = pytest.importorskip("mlflow")
    from dflash.train import loop

    cfg = tiny_cfg(tmp_path, variants=["fixed", "loss_dilution"], tracking={"enabled": True}, optim={"steps": 4})
    real = loop.after_step

    def after(lv, cfg, total, *a):
        real(lv, cfg, total, *a)
        if lv.rs.step == 2:
            raise stop("stopped at step 2")

    monkeypatch.setattr(loop, "after_step", after)
    with pytest.raises(stop):
        T.train(cfg, target=target, seqs=seqs)
    mlflow.set_tracking_uri(cfg.tracking.uri)
    runs = mlflow.search_runs(experiment_names=["dflash-train/tiny"])
    assert len(runs) == 2 and set(runs["status"]) == {status}, runs["status"].tolist()


def test_training_ratios_over_nothing_stay_undefined():
    """A window whose slot k has no labelled position: acc_k and what depends on it are None, not 0 or a clamp."""
    import torch

    from dflash.train.metrics import Window, summarise

    w = Window(
        hit_own=torch.tensor([3, 0, 0]),
        hit_clean=torch.tensor([3, 0, 0]),
        count=torch.tensor([4, 2, 0]),
        prefix=torch.tensor([1, 0, 0]),
        n=1,
    )
    s = summarise(w, 4)
    assert s["acc_1"] == 0.75 and s["acc_2"] == 0.0 and s["acc_3"] is None and s["acc_clean_3"] is None
    assert s["tf_expected_tau"] == 1 + 0.75 + 0.0  # summed up to the first undefined slot
    assert (
        summarise(
            Window(hit_own=torch.zeros(3), hit_clean=torch.zeros(3), count=torch.zeros(3), prefix=torch.zeros(3), n=1),
            4,
        )["acc"]
        is None
    )
    assert Window().tokens_per_s is None


def test_a_step_logs_no_grad_norm_without_clipping_and_no_flip_rate_over_no_label(target, seqs, tmp_path):
    """optim.grad_clip=0 computes no gradient norm: none is logged (not 0.0). Bug 1's label flip rate over no valid
    label is None, and a window of such steps has none either (not 0)."""
    from dflash.train.metrics import Window
    from dflash.train.step import VariantInputs, step_stats

    T.train(tiny_cfg(tmp_path, optim={"grad_clip": 0.0, "steps": 2}), target=target, seqs=seqs)
    rows = [json.loads(x) for x in (tmp_path / "runs" / "fixed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2] and all("grad_norm" not in r for r in rows)
    labels, clean = torch.tensor([[[3, 4, 5, 6]]]), torch.tensor([[[3, 4, 7, 6]]])  # [S, N, B]: slot 2's label flipped
    logits = torch.zeros(1, 1, 4, 8)

    def stats(valid: list[bool], noisy: bool = True):
        x = VariantInputs(torch.zeros(0), torch.zeros(0), labels, clean, torch.tensor([[valid]]))
        return step_stats(logits, x, 0.5, None, noisy)

    assert stats([True, True, True, False]).label_flip_rate == pytest.approx(1 / 3)
    assert stats([True, True, True, False], noisy=False).label_flip_rate is None
    none = stats([False] * 4)
    assert none.label_flip_rate is None and none.tokens == 0 and none.grad_norm is None
    w = Window()
    w.add(none, 0.1)
    assert w.label_flip_rate is None
    w.add(stats([True, True, True, True]), 0.1)
    assert w.label_flip_rate == pytest.approx(1 / 4) and w.n == 2
