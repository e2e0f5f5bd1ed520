"""The trainer learns DFlash2 (issue 27 part 5): `drafter.arch=dflash2` starts from identity convolutions and a
zero successor codebook (the proposals of DFlash), trains the selector's CE beside the DFlash loss, and exports
a DFlash2 HF folder the evaluator loads and replays."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from shortcuts import evaluate_sequence, load_drafter
from test_train import seqs, target, tiny_cfg  # noqa: F401 (fixtures)

from dflash import train as T
from dflash.models.drafter.dflash2 import BlockConv
from dflash.models.target.forward import tapped_forward
from dflash.train.arch import drafter_config, init_drafter
from dflash.train.loss import selector_loss
from dflash.util.errors import ConfigError

DFLASH2 = {"arch": "dflash2", "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 4}


def test_dflash2_trains_exports_and_evaluates(target, seqs, tmp_path):  # noqa: F811
    cfg = tiny_cfg(tmp_path, drafter=DFLASH2, optim={"steps": 4})
    out = T.train(cfg, target=target, seqs=seqs)
    assert out["fixed"]["step"] == 4
    folder = tmp_path / "ckpt" / "fixed" / "step_4"
    hf = json.loads((folder / "config.json").read_text())
    assert hf["architectures"] == ["DFlash2DraftModel"] and hf["dflash_config"]["selector_top_k"] == 4
    for kind, where in (
        ("hf", {"path": str(folder)}),
        ("training", {"run_dir": str(tmp_path / "runs" / "fixed"), "step": 4}),
    ):
        d = load_drafter(target, kind, "x", **where).model.float()
        assert d.cfg.arch == "dflash2" and d.cfg.dflash2.selector_rank == 4
        assert d.candidate_selector.successor_codebook.abs().sum() > 0, "the selector learned (it starts at zero)"
        conv = d.layers[0].attention_conv
        assert conv.kernel_projection.weight.abs().sum() > 0, "the convolutions learned (they start as identity)"
    s = seqs[0]
    taps = tapped_forward(target, torch.tensor([s.ids]), d.cfg.target_layer_ids)[0]
    c, blocks = evaluate_sequence(d, target, s.ids[: s.prompt_len], s.ids[s.prompt_len :], taps, anchors="visited")
    assert c.selector and c.steps > 0 and c.unary_steps > 0 and all(b.unary is not None for b in blocks)


def test_dflash2_starts_as_dflash_and_its_selector_loss_reaches_the_successor_codebook(target, tmp_path):  # noqa: F811
    cfg = tiny_cfg(tmp_path, drafter=DFLASH2)
    dcfg = drafter_config(cfg, target, [1, 2])
    model = init_drafter(dcfg, target, 0, torch.device("cpu"))
    assert all(
        torch.equal(m.base_kernel[:, 0], torch.ones_like(m.base_kernel[:, 0])) and not m.kernel_projection.weight.any()
        for m in model.modules()
        if isinstance(m, BlockConv)
    )
    assert not model.candidate_selector.successor_codebook.any()
    g = torch.Generator().manual_seed(0)
    S, N, B = 2, 3, 4
    taps, anchors = torch.randn(S, 20, 2 * dcfg.hidden_size, generator=g), torch.tensor([[4, 8, 12], [5, 9, 13]])
    labels = torch.randint(3, 90, (S, N, B), generator=g)
    h = model(taps, target.embed(labels.clone().index_fill_(2, torch.arange(1, B), 5)), anchors)
    logits = target.lm_head(h)
    labels[..., 1:] = logits[..., 1:, :].argmax(-1)  # every label among the top-k: each slot carries selector loss
    loss = selector_loss(model, logits, h, labels, torch.ones(S, N, B, dtype=torch.bool), 7.0)
    loss.backward()
    assert loss > 0 and model.candidate_selector.successor_codebook.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "drafter, words",
    [
        ({"arch": "dflash3"}, "drafter.arch='dflash3'"),
        (
            {**DFLASH2, "conv_group_size": 12},
            "drafter.conv_group_size=12 should be a positive divisor of hidden_size (32)",
        ),
        ({**DFLASH2, "conv_kernel_size": 5}, "drafter.conv_kernel_size=5 should be an integer in 1..block_size (4)"),
        ({**DFLASH2, "selector_top_k": 500}, "drafter.selector_top_k=500 should be an integer in 1..96"),
    ],
)
def test_bad_dflash2_train_config_names_the_field(target, tmp_path, drafter, words):  # noqa: F811
    cfg = tiny_cfg(tmp_path, drafter=drafter)
    with pytest.raises(ConfigError) as e:
        from dflash.config.train import check

        check(cfg)
        drafter_config(cfg, target, [1, 2])
    assert words in str(e.value), str(e.value)
    assert OmegaConf.select(cfg, "drafter.arch") == drafter.get("arch")
