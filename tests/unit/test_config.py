"""Every option of every config group composes with the real dflash/conf/ against the typed schema
(dflash/config/schema.py), resolves, and keeps its values; wrong types and typos fail at compose time."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "dflash" / "conf"
GROUPS = ("target", "drafter", "prompts", "attention", "device", "references")
# a value for every `???` a group option may leave to the command line
FILL = {"path": "/x", "run_dir": "/x", "model": "m"}
FILL_BY_GROUP = {"prompts": {"path": "/x.jsonl"}}


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _compose(config_name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name=config_name, overrides=overrides)


@pytest.fixture(autouse=True, scope="module")
def _register():
    from dflash.config.compose import register

    register()


def _required_overrides(group: str, option: str) -> dict[str, str]:
    raw = OmegaConf.load(CONF / group / f"{option}.yaml")
    out = {}
    for key in raw:
        if OmegaConf.is_missing(raw, key):
            fill = FILL_BY_GROUP.get(group, {}).get(key, FILL.get(key))
            assert fill is not None, f"{group}/{option}.yaml leaves {key} as ??? and this test has no value for it"
            out[f"{group}.{key}"] = fill
    return out


def _literal_leaves(node, prefix=""):
    """(dotted key, value) of every leaf that is neither ??? nor an interpolation."""
    for key in node:
        if OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key):
            continue
        value = node[key]
        if OmegaConf.is_dict(value):
            yield from _literal_leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", OmegaConf.to_container(value) if OmegaConf.is_list(value) else value


def test_every_group_has_options():
    for group in GROUPS:
        assert _options(group), f"dflash/conf/{group} has no yaml"
    assert {"sdpa", "eager", "flex"} <= set(_options("attention"))
    assert {"training", "hf", "init"} <= set(_options("drafter"))
    assert {"builtin", "jsonl", "humaneval", "humaneval_complete", "gsm8k", "mt_bench"} <= set(_options("prompts"))


def test_default_config_composes_and_resolves():
    cfg = _compose("config", [])
    c = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert c["drafter"]["kind"] == "training" and c["drafter"]["run_dir"] == "checkpoints/fixed-l4-dflash2-warm"
    assert c["prompts"]["source"] == "builtin"
    assert c["attention"] == {"drafter": "sdpa", "target": "sdpa"}
    assert c["device"]["name"] == "cpu"
    assert isinstance(c["cache_dir"], str) and c["tracking"]["enabled"] is True
    assert "hydra" not in c


@pytest.mark.parametrize("group, option", [(g, o) for g in GROUPS for o in _options(g)])
def test_group_option_composes(group, option):
    from dflash.config.compose import to_container

    fill = _required_overrides(group, option)
    cfg = _compose("config", [f"{group}={option}"] + [f"{k}={v}" for k, v in fill.items()])
    c = to_container(cfg)  # resolve=True, throw_on_missing=True
    assert OmegaConf.to_container(cfg, resolve=True) == c
    raw = OmegaConf.load(CONF / group / f"{option}.yaml")
    for key, value in _literal_leaves(raw):
        got = c[group]
        for part in key.split("."):
            got = got[part]
        assert got == value, f"{group}={option}: {key} is {got!r}, the yaml says {value!r}"
    for key, value in fill.items():
        assert c[group][key.split(".", 1)[1]] == value
    # the schema's fields are all there, typed
    assert set(c["prompts"]) >= {"source", "path", "num_prompts", "subsets", "max_new_tokens"}
    assert isinstance(c["prompts"]["max_new_tokens"], int)
    assert isinstance(c["target"]["template"]["enable_thinking"], bool)


@pytest.mark.parametrize(
    "group, option",
    [("drafter", "training"), ("drafter", "hf"), ("prompts", "jsonl"), ("target", "local"), ("references", "openai")],
)
def test_required_values_are_never_silently_filled(group, option):
    """A `???` left unset either fails on resolve (schema field MISSING: target.path) or stays null
    (schema field Optional: the `???` is masked by the schema's None on merge, and the consumer
    refuses the null with its own message, e.g. 'drafter=training needs drafter.run_dir=...')."""
    from omegaconf.errors import MissingMandatoryValue

    required = _required_overrides(group, option)
    assert required, f"{group}/{option} should leave something to the command line"
    cfg = _compose("config", [f"{group}={option}"])
    for key in required:
        sub = key.split(".", 1)[1]
        if OmegaConf.is_missing(cfg[group], sub):
            with pytest.raises(MissingMandatoryValue):
                OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        else:
            assert cfg[group][sub] is None, f"{key} got a default {cfg[group][sub]!r}"


def test_target_path_is_mandatory():
    from omegaconf.errors import MissingMandatoryValue

    with pytest.raises(MissingMandatoryValue, match="target.path"):
        OmegaConf.to_container(_compose("config", ["target=local"]), resolve=True, throw_on_missing=True)


def test_env_interpolation_resolves(monkeypatch):
    monkeypatch.setenv("QWEN3_8B_PATH", "/elsewhere/Qwen3-8B")
    monkeypatch.setenv("DFLASH_CACHE_DIR", "/tmp/dflash-cache")
    c = OmegaConf.to_container(_compose("config", ["target=qwen3_8b"]), resolve=True)
    assert c["target"]["path"] == "/elsewhere/Qwen3-8B" and c["cache_dir"] == "/tmp/dflash-cache"
    assert c["target"]["default_taps"] == [1, 9, 17, 25, 33] and c["target"]["mask_token_id"] == 151669


def test_typed_overrides_are_converted():
    c = OmegaConf.to_container(
        _compose(
            "config",
            ["prompts.max_new_tokens=64", "drafter.target_layer_ids=[1,2]", "target.template.enable_thinking=true"],
        ),
        resolve=True,
    )
    assert c["prompts"]["max_new_tokens"] == 64
    assert c["drafter"]["target_layer_ids"] == [1, 2]
    assert c["target"]["template"]["enable_thinking"] is True


@pytest.mark.parametrize(
    "override",
    [
        "prompts.max_new_tokens=abc",
        "drafter.num_layers=two",
        "target.template.enable_thinking=maybe",
        "drafter.target_layer_ids=[a,b]",
        "prompts.max_new_token=5",  # typo: not a field of the schema
        "attention.drafter_backend=flex",
    ],
)
def test_bad_override_fails_at_compose_time(override):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        _compose("config", [override])


def test_unknown_group_option_fails():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException):
        _compose("config", ["attention=flash"])


# --- the trainer's config, where it exists ---------------------------------------------------

TRAIN = CONF / "train.yaml"


@pytest.mark.skipif(not TRAIN.is_file(), reason="dflash/conf/train.yaml not there")
@pytest.mark.parametrize("target", _options("target"))
def test_train_config_composes(target):
    from dflash import train

    train.register()
    overrides = [f"target={target}"] + [f"{k}={v}" for k, v in _required_overrides("target", target).items()]
    cfg = _compose("train", overrides)
    c = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert c["target"]["name"] == OmegaConf.load(CONF / "target" / f"{target}.yaml").name
    assert "hydra" not in c
    with pytest.raises(Exception):
        _compose("train", overrides + ["optim.steps=abc"])


def _extra() -> dict[str, str]:
    """checkpoints/extra.txt: step folder -> the commit that holds it (drafters outside the budget: `make drafters`)."""
    lines = (ROOT / "checkpoints" / "extra.txt").read_text().splitlines()
    return dict(line.split() for line in lines if line.strip() and not line.startswith("#"))


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def test_shipped_drafters_exist_and_fit_the_budget():
    """Every drafter option that points into checkpoints/ has its step folders (weights + config, the
    step the option names) in the tree or in checkpoints/extra.txt, and what of checkpoints/ travels with the
    tree (what git tracks, or would: not what it ignores) holds at most 40 MB in all (issue 3's budget)."""
    root, extra = ROOT / "checkpoints", _extra()
    for opt in _options("drafter"):
        d = OmegaConf.load(CONF / "drafter" / f"{opt}.yaml")
        if d.get("kind") != "training" or not str(d.get("run_dir", "")).startswith("checkpoints/"):
            continue
        listed = [p for p in extra if p.startswith(f"{d.run_dir}/step_")]
        steps = sorted((ROOT / d.run_dir).glob("step_*"))
        assert steps or listed, f"drafter={opt}: no step folder under {d.run_dir}, none in checkpoints/extra.txt"
        for s in steps:
            assert (s / "config.json").is_file() and (s / "model.safetensors").is_file(), s
        if d.get("step") is not None:
            assert (ROOT / d.run_dir / f"step_{d.step}").is_dir() or f"{d.run_dir}/step_{d.step}" in extra, (
                f"drafter={opt}: step {d.step} not shipped"
            )
    ls = _git("ls-files", "-co", "--exclude-standard", "checkpoints")
    files = [ROOT / f for f in ls.stdout.split()] if ls.returncode == 0 else [p for p in root.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    assert 0 < size <= 40e6, f"checkpoints/ holds {size / 1e6:.1f} MB, over 40"


def test_extra_drafters_are_one_command_away():
    """Each step folder of checkpoints/extra.txt is ignored in the tree (it never travels with it) and its
    commit holds its config and weights, which `make drafters` (scripts/drafters.sh) restores."""
    if _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout: the extra drafters live in the git history")
    for path, rev in _extra().items():
        assert _git("check-ignore", "-q", f"{path}/model.safetensors").returncode == 0, f"{path}: not in .gitignore"
        if _git("cat-file", "-e", f"{rev}^{{commit}}").returncode != 0:
            assert _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true", (
                f"{path}: commit {rev} is not in the history"
            )
            pytest.skip(f"a shallow clone: commit {rev} ({path}) is not in it")
        for f in ("config.json", "model.safetensors"):
            assert _git("cat-file", "-e", f"{rev}:{path}/{f}").returncode == 0, f"{rev} holds no {path}/{f}"


# --- the strict schema and the exit policy's config checks ---------------------------------------


@pytest.mark.parametrize(
    "override, near",
    [("+prompts.num_prompt=3", "prompts.num_prompts"), ("+foo=1", None), ("+drafter.stpe=5", "drafter.step")],
)
def test_plus_cannot_add_a_key_the_schema_lacks(override, near):
    """Hydra's `+` adds the key and OmegaConf.to_object carries it silently: the strict check refuses it."""
    from dflash.config.compose import to_object
    from dflash.util.errors import ConfigError

    cfg = _compose("config", [override])  # composes: Hydra alone accepts it
    key = override[1:].split("=")[0]
    with pytest.raises(
        ConfigError, match=f"{key} is not a config key" + (rf" \(did you mean {near}\?\)" if near else "")
    ):
        to_object(cfg)


@pytest.mark.parametrize(
    "args, bad",
    [
        (["prompts.num_prompt=3"], "prompts.num_prompt"),
        (["nosuch=1"], "nosuch"),
        (["~drafter.sed"], None),
        (["drafter=init", "drafter.seed=1"], None),
        (["hydra.job.chdir=true", "hydra/launcher=joblib"], None),
        (
            ["-m", "suite=zlab", "prompts.data_dir=/data"],
            None,
        ),  # a group at _global_ (it sets the sweep), no key of the schema
        (["-m", "drafter.step=1,2", "+target.template.thinking=true"], "target.template.thinking"),
    ],
)
def test_command_line_overrides_are_checked_before_hydra(args, bad):
    from dflash.config.compose import check_overrides
    from dflash.util.errors import ConfigError

    if bad is None:
        check_overrides(args)  # group choices, hydra's own keys, deletions: left to Hydra
    else:
        with pytest.raises(ConfigError, match=rf"^{bad} is not a config key"):
            check_overrides(args)


@pytest.mark.parametrize(
    "override, message",
    [
        ("prompts.max_new_tokens=1", "use 2 or more"),
        ("prompts.max_new_tokens=-3", "use 2 or more"),
        ("device.name=tpu", "is not a device"),
        ("device.name=cuda:1", None),
        ("replay.anchors=some", "replay.anchors='some': use auto"),
        ("replay.tf_stride=0", r"replay.tf_stride=0: use 1"),
        ("replay.context_gb=0", "positive size"),
        ("features.batch_tokens=0", r"features.batch_tokens=0: use a positive number"),
        ("features.batch_tokens=sometimes", r"features.batch_tokens='sometimes': .* or auto"),
        ("features.chunk_tokens=-3", r"features.chunk_tokens=-3: use a positive number"),
        ("features.memory_gb=-1", r"features.memory_gb=-1.0: use a size in GB"),
    ],
)
def test_values_the_schema_refuses(override, message):
    from dflash.config.compose import to_object
    from dflash.util.errors import ConfigError

    cfg = _compose("config", [override])
    if message is None:
        assert to_object(cfg).device.name == "cuda:1"
    else:
        with pytest.raises(ConfigError, match=message):
            to_object(cfg)


def test_features_batch_tokens_auto_batches_on_cuda_only():
    """features.batch_tokens=auto (the default) runs one sequence per target pass on a CPU and batches on CUDA
    (FeaturesConfig.batch, the bench's measurement); a number or null is taken as given on both."""
    from dflash.config.compose import to_object
    from dflash.config.schema import BATCH_TOKENS_CUDA

    auto = to_object(_compose("config", [])).features
    assert auto.batch_tokens == "auto" and auto.batch(cuda=False) is None and auto.batch(cuda=True) == BATCH_TOKENS_CUDA
    for override, want in (("features.batch_tokens=4096", 4096), ("features.batch_tokens=null", None)):
        fc = to_object(_compose("config", [override])).features
        assert fc.batch(cuda=False) == fc.batch(cuda=True) == want


def test_sweep_name_says_what_was_swept():
    from dflash.cli.app import sweep_name

    assert sweep_name(["drafter.step=1633,5037", "scores=true"]) == "sweep drafter.step=1633,5037"
    assert sweep_name(["scores=true"]) == "sweep scores=true"  # a one-job -m: its overrides


def test_replay_anchors_auto_drafts_every_anchor():
    """auto (the default) resolves to `all` at any stride (the default stride, 4, the schema's alone); an explicit
    choice stays."""
    from dflash.config.compose import to_object
    from dflash.config.schema import ReplayConfig

    cfg = to_object(_compose("config", []))
    assert cfg.replay.anchors == "auto" and cfg.replay.tf_stride == ReplayConfig.tf_stride == 4
    assert cfg.replay.mode() == "all" and to_object(_compose("config", ["replay.tf_stride=1"])).replay.mode() == "all"
    assert (
        ReplayConfig(anchors="visited").mode() == "visited" and ReplayConfig(anchors="all", tf_stride=4).mode() == "all"
    )


def test_run_names_by_drafter_kind():
    """A run's name is `<drafter>@step_<N>`: an HF folder a trainer exported as `<run>/step_<N>` is named after
    its run and step (so `dflash.cli.compare run@step_N` finds it); any other folder by its name, with no step."""
    from dflash.config.schema import DrafterSchema
    from dflash.evaluation.pipeline import run_name

    assert run_name(DrafterSchema(kind="hf", path="/x/exports/fixed-dflash2/step_1090")) == "fixed-dflash2@step_1090"
    assert run_name(DrafterSchema(kind="hf", path="/models/Qwen3-8B-DFlash-b16")) == "Qwen3-8B-DFlash-b16"
    assert run_name(DrafterSchema(kind="hf", path="/x/fixed/step_7", name="mine")) == "mine@step_7"
    assert run_name(DrafterSchema(kind="training", run_dir="/ckpts/run7"), 20000) == "run7@step_20000"
    assert run_name(DrafterSchema(kind="training", run_dir="/ckpts/run7")) == "run7@latest"
