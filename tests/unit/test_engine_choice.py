"""The references engine's set-up rule (references.compile=auto|true|false) and the report of which
kernels a hybrid target's Gated DeltaNet layers run. Logic only, on CPU: no timing is asserted."""

import sys
import types

import pytest

from dflash.models.engine.generator import choose_compile, decode_steps
from dflash.models.target import kernels
from dflash.stages.references import local as generate
from dflash.stages.references.collect import ReferenceOptions, get_references, greedy_generate
from dflash.util.errors import ConfigError


def test_decode_steps_counts_batches_times_new_tokens():
    assert decode_steps(12, 16, 256) == 256  # one batch of 12
    assert decode_steps(130, 16, 2048) == 9 * 2048  # ceil(130 / 16) batches
    assert decode_steps(1, 16, 10) == 10
    assert decode_steps(0, 16, 10) == 0


@pytest.mark.parametrize(
    "choice, steps, want",
    [
        ("auto", 256, False),
        ("auto", 3999, False),
        ("auto", 4000, True),
        ("auto", 10**6, True),
        ("true", 1, True),
        (True, 1, True),
        ("True", 1, True),
        ("false", 10**6, False),
        (False, 10**6, False),
    ],
)
def test_choose_compile(choice, steps, want):
    got, why = choose_compile(choice, steps, 4000)
    assert got is want
    assert ("auto" in why) == (str(choice).lower() == "auto")
    if str(choice).lower() == "auto":
        assert str(steps) in why and "4000" in why


def test_choose_compile_refuses_other_values():
    with pytest.raises(ValueError, match="auto, true or false"):
        choose_compile("sometimes", 10, 10)


def test_reference_options_name_the_bad_key():
    with pytest.raises(ConfigError, match=r"references.compile='sometimes'"):
        ReferenceOptions(compile="sometimes").validate(8)
    with pytest.raises(ConfigError, match=r"references.compile_min_steps=-1"):
        ReferenceOptions(compile_min_steps=-1).validate(8)
    ReferenceOptions(compile="False").validate(8)


def test_auto_rule_reaches_the_engine(qwen3_target, monkeypatch):
    """greedy_generate hands the engine the rule's choice and reports it (the CUDA engine stood in by a recorder)."""
    seen, closed = [], []

    class FakeEngine:
        eng = types.SimpleNamespace(graphs=True, batch=2)

        def __call__(self, prompts, on_tokens=None):
            return [[2] for _ in prompts]

        def close(self):
            closed.append(True)

    def fake(t, b, p, n, compile, *rest):
        seen.append((b, compile))
        return FakeEngine()

    monkeypatch.setattr(generate, "_static_engine", fake)
    for min_steps, want in ((3, True), (4, False)):
        heard = []
        greedy_generate(
            qwen3_target,
            [[5, 6], [7, 8, 9]],
            3,
            batch_size=2,
            compile="auto",
            compile_min_steps=min_steps,
            on_engine=lambda label, setup: heard.append((label, setup)),
        )
        assert seen[-1] == (2, want)  # 1 batch of 2 x 3 new tokens = 3 steps
        ((label, setup),) = heard
        assert ("not compiled" in label) is not want and setup is not None
    greedy_generate(qwen3_target, [[5]] * 4, 3, batch_size=2, compile="auto", compile_min_steps=6)
    assert seen[-1] == (2, True)  # 2 batches x 3 = 6 steps
    assert len(closed) == len(seen)  # each engine closed once its batches are done


def test_cpu_references_report_no_engine(qwen3_target, tmp_path):
    heard = []
    greedy_generate(
        qwen3_target, [[5, 6]], 3, on_engine=lambda label, setup: heard.append((label, setup)), compile="auto"
    )
    assert heard == [("dynamic cache", None)]
    _, stats = get_references(qwen3_target, [[5, 6]], 3, {}, tmp_path)  # what the references report of it
    assert stats.engine == "dynamic cache" and stats.setup_s is None


def test_linear_attention_kernel(vl_target, qwen3_target):
    assert kernels.linear_attention_kernel(qwen3_target.model) is None  # no Gated DeltaNet layer
    label = kernels.linear_attention_kernel(vl_target.model)
    try:
        import fla  # noqa: F401
    except ImportError:
        assert label == "torch fallback"  # transformers' own PyTorch code
    else:
        assert label.startswith("fla")


def _dispatching(impl):
    """A wrapper shaped like transformers' use_kernel_func_from_hub_with_fallback's."""
    implementation = impl

    def wrapped(*a, **k):
        return implementation(*a, **k)

    return wrapped


def test_linear_attention_kernel_reads_the_dispatch(vl_target, monkeypatch):
    layer = kernels._linear_layer(vl_target.model)
    mod = sys.modules[type(layer).__module__]
    fla_rule = types.FunctionType(
        (lambda: None).__code__, {"__name__": "fla.ops.gated_delta_rule.chunk"}, "chunk_gated_delta_rule"
    )
    fla_rule.__module__ = "fla.ops.gated_delta_rule.chunk"
    conv = types.FunctionType((lambda: None).__code__, {}, "causal_conv1d_fn")
    conv.__module__ = "causal_conv1d.cpp_functions"
    for name in kernels.DELTA_RULE:
        monkeypatch.setattr(mod, name, _dispatching(fla_rule))
    assert kernels.linear_attention_kernel(vl_target.model) == "fla, conv1d torch fallback"
    for name in kernels.CONV:
        monkeypatch.setattr(mod, name, _dispatching(conv))
    assert kernels.linear_attention_kernel(vl_target.model) == "fla, conv1d causal_conv1d"
    assert kernels.package(_dispatching(fla_rule)) == "fla"


def test_cpu_targets_fall_back_to_torch(vl_target, monkeypatch):
    """fla's kernels take CUDA tensors only: a CPU target is routed back to transformers' torch code."""
    layer = kernels._linear_layer(vl_target.model)
    mod = sys.modules[type(layer).__module__]
    fla_rule = types.FunctionType((lambda: None).__code__, {}, "chunk_gated_delta_rule")
    fla_rule.__module__ = "fla.ops.gated_delta_rule.chunk"
    for name in kernels.DELTA_RULE:
        w = _dispatching(fla_rule)
        w.__wrapped__ = getattr(mod, name).__wrapped__  # the torch function, as functools.wraps leaves it
        monkeypatch.setattr(mod, name, w)
    assert kernels.linear_attention_kernel(vl_target.model).startswith("fla")
    assert sorted(kernels.use_torch_fallback(vl_target.model)) == sorted(kernels.DELTA_RULE)
    assert kernels.linear_attention_kernel(vl_target.model) == "torch fallback"
