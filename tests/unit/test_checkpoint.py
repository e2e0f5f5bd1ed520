"""Drafter checkpoints (docs/family.md §5): training pickles, HF folders, HF step folders, and every
error a user can meet, each a CheckpointError that says what to do."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import MASK_ID
from shortcuts import load_drafter

from dflash.models.drafter.checkpoint import CheckpointError, check_against_target
from dflash.models.drafter.files import save_hf_folder, save_training_checkpoint
from dflash.models.drafter.model import DFlashDrafter, DrafterConfig

B = 4


@pytest.fixture(scope="module")
def drafter(qwen3_target, make_drafter):
    return make_drafter(qwen3_target, num_layers=2, num_taps=3, block_size=B, seed=11, std=0.1)


@pytest.fixture(scope="module")
def probe(qwen3_target):
    """Fixed drafter inputs: taps of 10 positions, 2 anchors."""
    g = torch.Generator().manual_seed(0)
    H = qwen3_target.hidden_size
    return torch.randn(1, 10, 3 * H, generator=g), torch.randn(1, 2, B, H, generator=g), torch.tensor([[3, 8]])


def _out(model, probe):
    with torch.no_grad():
        return model(*probe)


def _adamw_state(model: DFlashDrafter) -> dict:
    """A real AdamW state after one step (a copy of the model, so the weights stay as they are)."""
    clone = DFlashDrafter(model.cfg)
    clone.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(clone.parameters(), lr=1e-3)
    x = torch.randn(1, 5, 3 * model.cfg.hidden_size)
    clone(x, torch.randn(1, 1, B, model.cfg.hidden_size), torch.tensor([[4]])).pow(2).mean().backward()
    opt.step()
    return opt.state_dict()


def _write_pickle(run, step, model, cfg=None, sd=None):
    sd = model.state_dict() if sd is None else sd
    prefixed = {}
    for i, (k, v) in enumerate(sd.items()):  # DDP and torch.compile wrappers, mixed
        prefix = ("module.", "_orig_mod.", "module._orig_mod.")[i % 3]
        prefixed[prefix + k] = v.clone()
    d = run / f"step_{step}"
    d.mkdir(parents=True)
    path = d / "checkpoint.pt"
    torch.save(
        {"model": prefixed, "optimizer": _adamw_state(model), "step": step, "config": (cfg or model.cfg).to_hf()},
        path,
    )
    return path


def _assert_same_weights(a: DFlashDrafter, b: DFlashDrafter, dtype=None):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        want = sa[k] if dtype is None else sa[k].to(dtype).float()
        assert torch.equal(sb[k], want), k


# --- round trips -----------------------------------------------------------------------------


def test_training_pickle_round_trip(qwen3_target, drafter, probe, tmp_path):
    run = tmp_path / "run"
    path = _write_pickle(run, 40, drafter)
    got = load_drafter(qwen3_target, "training", "mine", run_dir=str(run), step=40)
    assert (got.name, got.step, got.path) == ("mine", 40, str(path))
    assert got.sha256 and len(got.sha256) == 64
    assert got.model.cfg == drafter.cfg
    assert got.warnings == []
    _assert_same_weights(drafter, got.model)
    assert torch.equal(_out(got.model, probe), _out(drafter, probe))


def test_a_file_loaded_drafter_skips_random_init_and_equals_the_old_build(
    qwen3_target, drafter, probe, tmp_path, monkeypatch
):
    """Built on the meta device and assigned: no init runs, and the module equals one built the old way
    (a randomly initialised module whose weights are then loaded), in float32 and in the target's bfloat16."""
    from dflash.models.drafter.checkpoint import build_drafter, fit_drafter, read_drafter

    run = tmp_path / "run"
    _write_pickle(run, 7, drafter)
    src = fit_drafter(read_drafter("training", "mine", run_dir=str(run), step=7), qwen3_target)
    old = DFlashDrafter(src.config)  # the old way: torch's default init, then the weights
    old.load_state_dict({k: src.state_dict[k] for k in old.state_dict()})
    calls = []
    for fn in ("kaiming_uniform_", "uniform_", "normal_"):
        real = getattr(torch.nn.init, fn)
        # an init on the meta device allocates and draws nothing; one on a real tensor is thrown-away work
        monkeypatch.setattr(
            torch.nn.init, fn, lambda t, *a, _r=real, _n=fn, **k: (t.is_meta or calls.append(_n)) or _r(t, *a, **k)
        )
    monkeypatch.setattr(DFlashDrafter, "init_weights", lambda *a, **k: calls.append("init_weights"))
    new = build_drafter(src).model
    assert calls == []  # no real tensor initialised
    _assert_same_weights(old, new)
    assert torch.equal(_out(new, probe), _out(old, probe))
    bf16 = build_drafter(src, dtype=torch.bfloat16).model
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in bf16.parameters()) and calls == []
    _assert_same_weights(old, bf16.float(), dtype=torch.bfloat16)


def test_training_latest_step_is_numeric(qwen3_target, make_drafter, tmp_path):
    run = tmp_path / "run"
    models = {s: make_drafter(qwen3_target, block_size=B, seed=s) for s in (2, 10, 9)}
    for s, m in models.items():
        _write_pickle(run, s, m)
    (run / "step_x").mkdir()  # not a step
    (run / "logs").mkdir()
    got = load_drafter(qwen3_target, "training", "r", run_dir=str(run), step=None)
    assert got.step == 10  # not "9", the lexicographic last
    _assert_same_weights(models[10], got.model)
    assert load_drafter(qwen3_target, "training", "r", run_dir=str(run), step=9).step == 9


def test_save_training_checkpoint_then_load(qwen3_target, drafter, probe, tmp_path):
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    path = tmp_path / "run" / "step_3" / "checkpoint.pt"
    save_training_checkpoint(path, drafter, opt, 3, extra={"loss": 1.5})
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.pt"]  # no temp file left
    raw = torch.load(path, weights_only=True)
    assert raw["step"] == 3 and raw["loss"] == 1.5 and "state" in raw["optimizer"]
    got = load_drafter(qwen3_target, "training", "r", run_dir=str(tmp_path / "run"))
    assert got.step == 3
    _assert_same_weights(drafter, got.model)
    assert torch.equal(_out(got.model, probe), _out(drafter, probe))


def test_hf_folder_round_trip_bf16(qwen3_target, drafter, probe, tmp_path):
    from safetensors.torch import load_file

    folder = tmp_path / "hf_drafter"
    save_hf_folder(drafter, folder)
    save_hf_folder(drafter, folder)  # overwriting an existing folder works
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_drafter"]  # no temp folder left
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": drafter.cfg.target_layer_ids}
    assert cfg["block_size"] == B and cfg["num_target_layers"] == 6 and len(cfg["layer_types"]) == 2
    sd = load_file(str(folder / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    public = {"norm.weight", "fc.weight", "hidden_norm.weight"}
    for i in range(2):
        public |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        public |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        public |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        public |= {f"layers.{i}.{p}_layernorm.weight" for p in ("input", "post_attention")}
    assert set(sd) == public  # public names; no embedding, no lm_head

    got = load_drafter(qwen3_target, "hf", "pub", path=str(folder))
    assert got.step is None and got.model.cfg == drafter.cfg
    _assert_same_weights(drafter, got.model, dtype=torch.bfloat16)
    torch.testing.assert_close(_out(got.model, probe), _out(drafter, probe), atol=0.1, rtol=0.05)


def test_hf_format_step_folder_in_a_run(qwen3_target, drafter, make_drafter, tmp_path):
    run = tmp_path / "run"
    _write_pickle(run, 5, make_drafter(qwen3_target, block_size=B, seed=5))
    save_hf_folder(drafter, run / "step_7", dtype=torch.float32)
    got = load_drafter(qwen3_target, "training", "r", run_dir=str(run))
    assert got.step == 7 and got.path == str(run / "step_7")
    _assert_same_weights(drafter, got.model)


def test_extra_keys_in_a_state_dict_are_refused(qwen3_target, drafter, tmp_path):
    sd = dict(drafter.state_dict())
    sd["verifier_norm.weight"] = torch.zeros(64)  # a trainer's copy of a target tensor the drafter does not use
    run = tmp_path / "run"
    _write_pickle(
        run, 1, drafter, sd=sd
    )  # (embed_tokens / lm_head are the drafter's own, as vLLM reads them: test_formats)
    with pytest.raises(CheckpointError, match=r"not consumed .*\['verifier_norm.weight'\]"):
        load_drafter(qwen3_target, "training", "r", run_dir=str(run))


def test_init_kind_is_deterministic(qwen3_target):
    init = {"num_layers": 1, "num_taps": 2, "seed": 4, "mask_token_id": MASK_ID}
    a = load_drafter(qwen3_target, "init", "init", init=init)
    b = load_drafter(qwen3_target, "init", "init", init=init)
    assert a.model.cfg.target_layer_ids == [1, 3] and a.model.cfg.block_size == 16
    _assert_same_weights(a.model, b.model)
    c = load_drafter(qwen3_target, "init", "init", init=init, overrides={"target_layer_ids": [0, 4], "block_size": 8})
    assert c.model.cfg.target_layer_ids == [0, 4] and c.model.cfg.block_size == 8
    d = load_drafter(qwen3_target, "init", "init", init={"num_layers": 2, "seed": 4, "mask_token_id": MASK_ID})
    assert d.model.cfg.target_layer_ids == [1, 3]  # no num_taps: the public rule, one tap per draft layer


# --- errors ----------------------------------------------------------------------------------


def test_missing_step_lists_existing_steps(qwen3_target, drafter, tmp_path):
    run = tmp_path / "run"
    for s in (100, 20):
        _write_pickle(run, s, drafter)
    with pytest.raises(CheckpointError, match="step 50") as e:
        load_drafter(qwen3_target, "training", "r", run_dir=str(run), step=50)
    assert "20, 100" in str(e.value)


def test_missing_or_empty_run_dir(qwen3_target, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_drafter(qwen3_target, "training", "r", run_dir=str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="holds no step folders of a layout.*step_<N>"):
        load_drafter(qwen3_target, "training", "r", run_dir=str(tmp_path))
    (tmp_path / "step_1").mkdir()
    with pytest.raises(CheckpointError, match="neither checkpoint.pt nor config.json"):
        load_drafter(qwen3_target, "training", "r", run_dir=str(tmp_path))
    with pytest.raises(CheckpointError, match="run_dir"):
        load_drafter(qwen3_target, "training", "r")


def test_hf_path_errors(qwen3_target, tmp_path):
    with pytest.raises(CheckpointError, match="drafter.path"):
        load_drafter(qwen3_target, "hf", "x")
    with pytest.raises(CheckpointError, match="not a folder"):
        load_drafter(qwen3_target, "hf", "x", path=str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="no config.json"):
        load_drafter(qwen3_target, "hf", "x", path=str(tmp_path))
    with pytest.raises(CheckpointError, match="training, hf or init"):
        load_drafter(qwen3_target, "bogus", "x")


def _other_target_drafter(hidden=32):
    cfg = DrafterConfig(
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        num_target_layers=6,
        target_layer_ids=[1, 2, 3],
        mask_token_id=MASK_ID,
        block_size=B,
    )
    return DFlashDrafter(cfg).init_weights(0)


def test_drafter_of_another_target_is_refused(qwen3_target, tmp_path):
    other = _other_target_drafter()
    run = tmp_path / "run"
    _write_pickle(run, 1, other)
    with pytest.raises(CheckpointError, match="hidden size 32 != the target's 64"):
        load_drafter(qwen3_target, "training", "r", run_dir=str(run))
    save_hf_folder(other, tmp_path / "hf")
    with pytest.raises(CheckpointError, match="another target"):
        load_drafter(qwen3_target, "hf", "x", path=str(tmp_path / "hf"))


def test_weights_that_do_not_fit_their_config(qwen3_target, drafter, tmp_path):
    run = tmp_path / "run"
    # the config says hidden 64 (passes the target check); the weights are hidden 32
    _write_pickle(run, 1, drafter, sd=_other_target_drafter().state_dict())
    with pytest.raises(CheckpointError, match="shape mismatch") as e:
        load_drafter(qwen3_target, "training", "r", run_dir=str(run))
    assert "fc.weight" in str(e.value) and "step_1" in str(e.value)
    sd = dict(drafter.state_dict())
    del sd["layers.1.mlp.down_proj.weight"]
    _write_pickle(run, 2, drafter, sd=sd)
    with pytest.raises(CheckpointError, match=r"missing \['layers.1.mlp.down_proj.weight'\]"):
        load_drafter(qwen3_target, "training", "r", run_dir=str(run), step=2)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"mask_token_id": 256}, "mask_token_id 256 is not a row of the target's embedding"),
        ({"mask_token_id": -1}, "mask_token_id.{1,2}-1"),
        ({"target_layer_ids": [1, 2, 6]}, r"taps \[6\] are outside the target's decoder layers 0..5"),
        ({"block_size": 1}, "block_size 1"),
    ],
)
def test_config_that_cannot_fit_the_target(qwen3_target, drafter, tmp_path, change, message):
    import dataclasses

    cfg = dataclasses.replace(drafter.cfg, **change)
    with pytest.raises(CheckpointError, match=message):
        check_against_target(cfg, qwen3_target)
    run = tmp_path / "run"
    _write_pickle(run, 1, drafter, cfg=cfg)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(qwen3_target, "training", "r", run_dir=str(run))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "not_a_dict"])
def test_corrupt_training_checkpoint(qwen3_target, drafter, tmp_path, damage):
    run = tmp_path / "run"
    path = _write_pickle(run, 1, drafter)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00not a checkpoint\xff" * 100)
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        torch.save([1, 2, 3], path)
    with pytest.raises(CheckpointError, match="corrupt|expected a dict") as e:
        load_drafter(qwen3_target, "training", "r", run_dir=str(run))
    assert str(path) in str(e.value)


def test_corrupt_hf_folder(qwen3_target, drafter, tmp_path):
    folder = tmp_path / "hf"
    save_hf_folder(drafter, folder)
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_drafter(qwen3_target, "hf", "x", path=str(folder))
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_drafter(qwen3_target, "hf", "x", path=str(folder))


def test_pickle_without_weights(qwen3_target, drafter, tmp_path):
    path = tmp_path / "run" / "step_1" / "checkpoint.pt"
    path.parent.mkdir(parents=True)
    torch.save({"step": 1, "config": drafter.cfg.to_hf(), "notes": "x"}, path)
    with pytest.raises(CheckpointError, match="no weights found"):
        load_drafter(qwen3_target, "training", "r", run_dir=str(tmp_path / "run"))


def test_config_lacking_mask_id(qwen3_target, drafter, tmp_path):
    folder = tmp_path / "hf"
    save_hf_folder(drafter, folder, dtype=torch.float32)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["dflash_config"]["mask_token_id"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mask_token_id") as e:
        load_drafter(qwen3_target, "hf", "x", path=str(folder))
    assert str(folder) in str(e.value) and "drafter.mask_token_id" in str(e.value)
    got = load_drafter(qwen3_target, "hf", "x", path=str(folder), overrides={"mask_token_id": 7})
    assert got.model.cfg.mask_token_id == 7
    _assert_same_weights(drafter, got.model)


def test_bare_state_dict_without_config(qwen3_target, drafter, tmp_path):
    """A pickle that is only a state dict: the weights are found, the missing config is named."""
    path = tmp_path / "run" / "step_1" / "checkpoint.pt"
    path.parent.mkdir(parents=True)
    torch.save(drafter.state_dict(), path)
    with pytest.raises(CheckpointError, match="lacks .*hidden_size"):
        load_drafter(qwen3_target, "training", "r", run_dir=str(tmp_path / "run"))


# --- warnings --------------------------------------------------------------------------------


def test_warns_when_taps_include_the_final_layer(qwen3_target, drafter, tmp_path):
    import dataclasses

    assert check_against_target(drafter.cfg, qwen3_target) == []
    leaky = dataclasses.replace(drafter.cfg, target_layer_ids=[1, 3, 5])
    warns = check_against_target(leaky, qwen3_target)
    assert len(warns) == 1 and "final layer 5" in warns[0]
    run = tmp_path / "run"
    _write_pickle(run, 1, drafter, cfg=leaky)
    assert any("final layer" in w for w in load_drafter(qwen3_target, "training", "r", run_dir=str(run)).warnings)


def test_warns_on_layer_count_mismatch(qwen3_target, drafter):
    import dataclasses

    warns = check_against_target(dataclasses.replace(drafter.cfg, num_target_layers=36), qwen3_target)
    assert len(warns) == 1 and "36-layer target" in warns[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_sees_nan_and_both_infinities(dtype):
    """The one-reduction finite check (min and max propagate NaN and inf) refuses what isfinite().all() refuses."""
    from dflash.models.target.weights import all_finite

    t = torch.randn(64, 33).to(dtype)
    assert all_finite(t) and all_finite(t[:0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        u = t.clone()
        u[17, 5] = bad
        assert not all_finite(u) and not bool(torch.isfinite(u).all())


def test_the_checkpoint_digest_is_computed_beside_the_load(tmp_path):
    """sha256_later hashes in a thread; the digest equals hashlib's, and a file that cannot be read raises when asked
    for."""
    import hashlib

    from dflash.models.target.weights import sha256_later

    f = tmp_path / "w.bin"
    f.write_bytes(bytes(range(256)) * 5000)
    assert sha256_later(f).result(timeout=30) == hashlib.sha256(f.read_bytes()).hexdigest()
    with pytest.raises(FileNotFoundError):
        sha256_later(tmp_path / "gone.bin").result(timeout=30)


def test_a_run_folder_kept_in_the_git_history_says_make_drafters(tmp_path, monkeypatch):
    """A shipped drafter outside checkpoints/' budget (listed in checkpoints/extra.txt) whose step folders are not
    restored names `make drafters`; any other run folder without steps asks whether drafter.run_dir is right."""
    from dflash.models.drafter import files as checkpoint_files
    from dflash.models.drafter.layouts import find_step

    monkeypatch.setattr(checkpoint_files, "PROJECT_ROOT", tmp_path)
    (tmp_path / "checkpoints" / "r").mkdir(parents=True)
    (tmp_path / "checkpoints" / "extra.txt").write_text("# step folder  commit\ncheckpoints/r/step_5  abc123\n")
    with pytest.raises(CheckpointError, match=r"kept in the git history.*`make drafters` restores them"):
        find_step(tmp_path / "checkpoints" / "r", None)
    (tmp_path / "other").mkdir()
    with pytest.raises(
        CheckpointError, match=r"holds no step folders of a layout.*step_<N>/.*Is drafter.run_dir right"
    ):
        find_step(tmp_path / "other", None)


def test_a_sharded_checkpoint_is_identified_by_every_shard(qwen3_target, drafter, tmp_path):
    """A folder of several safetensors loads whole, and its digest covers every shard: a change to the second
    shard alone is a new checkpoint; a single-file folder keeps its file's plain sha256."""
    import hashlib

    from safetensors.torch import load_file, save_file

    from dflash.models.drafter.checkpoint import read_drafter

    folder = tmp_path / "hf"
    save_hf_folder(drafter, folder)
    whole = read_drafter("hf", "one", path=str(folder))
    one = whole.digest.result(timeout=30)
    assert one == hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    sd = load_file(str(folder / "model.safetensors"))
    names = sorted(sd)
    (folder / "model.safetensors").unlink()
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        save_file({n: sd[n] for n in part}, str(folder / f"model-0000{i + 1}-of-00002.safetensors"))
    first = read_drafter("hf", "sharded", path=str(folder))
    assert first.state_dict.keys() == whole.state_dict.keys()
    assert all(torch.equal(first.state_dict[k], whole.state_dict[k]) for k in whole.state_dict)
    assert first.digest.result(timeout=30) != one
    last = folder / "model-00002-of-00002.safetensors"
    part = load_file(str(last))
    n = sorted(part)[0]
    save_file({**part, n: part[n] + 1}, str(last))
    assert read_drafter("hf", "changed", path=str(folder)).digest.result(timeout=30) != first.digest.result(timeout=30)
