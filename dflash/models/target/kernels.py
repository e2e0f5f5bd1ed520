"""Which kernels a hybrid target's Gated DeltaNet layers run: flash-linear-attention's or transformers' torch fallback.

transformers (5.17 to 5.24) picks each linear-attention function once, when its modeling module is
imported (`use_kernel_func_from_hub_with_fallback`): the optimised package where it imports
(`fla` for the gated delta rule, `causal_conv1d` for the short convolution), else its own
reference PyTorch code, which is correct but much slower on CUDA (no effect on CPU, where neither
package runs). `linear_attention_kernel(model)` reads that choice back from the functions the
layer's module calls, so a run can say which path it took (the `target.linear_attention_kernel`
tag, the summary): `fla`, `fla, conv1d causal_conv1d`, `torch fallback`, ... or None for a target
without linear-attention layers. Install both with `pip install -e .[gpu]` (causal-conv1d builds
CUDA code and may not install; fla alone is the larger part).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

DELTA_RULE = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
)  # prefill (chunked), decode (recurrent)
CONV = ("causal_conv1d_fn", "causal_conv1d_update")


def implementation(fn: Callable) -> Callable:
    """The function transformers' fallback wrapper dispatches to (the wrapper itself when it is none)."""
    try:
        return inspect.getclosurevars(fn).nonlocals.get("implementation", fn) or fn
    except TypeError:  # a builtin or a callable object: nothing wrapped
        return fn


def package(fn: Callable) -> str:
    """Top-level package of the code `fn` dispatches to: 'fla', 'causal_conv1d', 'transformers', ..."""
    return (getattr(implementation(fn), "__module__", None) or "?").split(".")[0]


def use_torch_fallback(model: Any) -> list[str]:
    """Route the model's linear-attention functions to transformers' torch code (process-wide: its
    modeling module's names): fla's Triton kernels take only CUDA tensors, so a CPU target on a
    machine with fla installed would fail in its first forward (seen on the H200's CPU). -> names rerouted."""
    layer = _linear_layer(model)
    mod = sys.modules.get(type(layer).__module__) if layer is not None else None
    done = []
    for name in DELTA_RULE + CONV:
        fn = getattr(mod, name, None)
        torch_fn = getattr(fn, "__wrapped__", None)
        if callable(fn) and torch_fn is not None and package(fn) != "transformers":
            params = set(inspect.signature(torch_fn).parameters)
            setattr(mod, name, _filtered(torch_fn, params))
            done.append(name)
    return done


def _filtered(fn: Callable, params: set[str]) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **{k: v for k, v in kwargs.items() if k in params})

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    call.__module__ = fn.__module__
    return call


def _linear_layer(model: Any) -> Any | None:
    return next((m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)


def linear_attention_kernel(model: Any) -> str | None:
    """`fla` / `torch fallback` (the gated delta rule's code), with `, conv1d <package>` when the
    convolution's differs; None when the model has no Gated DeltaNet layer."""
    layer = _linear_layer(model)
    if layer is None:
        return None
    mod = sys.modules.get(type(layer).__module__)
    found = {name: package(getattr(mod, name)) for name in DELTA_RULE + CONV if callable(getattr(mod, name, None))}
    rule = {found[n] for n in DELTA_RULE if n in found}
    conv = {found[n] for n in CONV if n in found}

    def name(pkgs: set[str]) -> str:
        if pkgs <= {"transformers"}:
            return "torch fallback"
        return "+".join(sorted(pkgs - {"transformers"})) + (
            " (partly torch fallback)" if "transformers" in pkgs else ""
        )

    label = name(rule) if rule else "unknown"
    if conv and name(conv) != label and not (conv <= {"transformers"} and label == "torch fallback"):
        label += f", conv1d {name(conv)}"
    return label
