"""What bounds a stage of the scale bench (dflash/bench/scale.py): floors measured on its device, and a profile.

- Arithmetic floor of the feature pass: a forward over T tokens multiplies every token by every weight of
  the linear layers it runs, 2 FLOPs per weight and token (`forward_flops`, counted from the loaded
  modules). At the device's bf16 GEMM rate (`gemm_rate`: the largest of those linears on T tokens) that
  takes `flops / rate` seconds. Attention's scores, the Gated DeltaNet recurrence, norms and the rest are
  left out: a floor, not an estimate.
- Weight-read floor of a decode step: a step reads every weight once (all parameters but the input
  embeddings, whose rows are gathered: `weight_bytes`); at the device's copy bandwidth (`copy_rate`: a
  large tensor copied, bytes read + written per second) that takes `bytes / rate` seconds.
- Arithmetic floor of the replay: its matrix products' FLOPs, counted by torch's FLOP counter over one run of
  the replay (`counted_flops`: the drafter's passes, the LM head on the slots it runs on, attention), at the same
  GEMM rate.

`floors(model, layers, tokens)` measures the first two and returns plain numbers. `top_ops(fn, device)` runs `fn`
under torch.profiler and returns its top ops by self device time (self CPU time on a CPU) as a table.
No figure here is asserted anywhere: they are reported beside the stages' times.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

COPY_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}  # the copied tensor: larger than any cache


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def linears(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


def forward_flops(module: nn.Module, tokens: int) -> int:
    """2 x the weights of `module`'s linear layers x tokens: the multiply-adds of a forward over `tokens` tokens."""
    return 2 * sum(m.weight.numel() for m in linears(module)) * tokens


def weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads once: every parameter but the input embeddings (only their rows are read)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    skip = {id(p) for p in emb.parameters()} if emb is not None else set()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and any(id(p) in skip for p in head.parameters())  # a tied head reads the table whole
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip or tied)


def seconds_per_call(fn: Callable[[], Any], device: torch.device | str, min_s: float = 0.2) -> float:
    """fn's seconds per call: one warm-up call, then runs of 1, 2, 4, ... calls until one lasts `min_s`."""
    fn()
    sync(device)
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync(device)
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return dt / n
        n *= 2


def gemm_rate(weight: torch.Tensor, tokens: int) -> float:
    """FLOP/s of x [tokens, in] @ weight.T ([out, in], its own dtype and device): the linear's matmul."""
    x = torch.randn(tokens, weight.shape[1], dtype=weight.dtype, device=weight.device)
    s = seconds_per_call(lambda: nn.functional.linear(x, weight), weight.device)
    return 2 * tokens * weight.numel() / s


def copy_rate(device: torch.device | str, nbytes: int | None = None) -> float:
    """Bytes/s of one large tensor copy on `device`, counting bytes read + written."""
    n = nbytes or COPY_BYTES.get(torch.device(device).type, COPY_BYTES["cpu"])
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / seconds_per_call(lambda: dst.copy_(src), device)


def floors(model: nn.Module, layers: nn.Module, tokens: int) -> dict[str, Any]:
    """Both floors for `model` on its device: arithmetic of `layers` (what a feature pass runs) over `tokens`
    tokens at the GEMM rate of their largest linear, and one read of the model's weights at the copy rate."""
    big = max(linears(layers), key=lambda m: m.weight.numel())
    rate, flops = gemm_rate(big.weight, tokens), forward_flops(layers, tokens)
    bw, wb = copy_rate(big.weight.device), weight_bytes(model)
    return dict(
        gemm_shape=[tokens, big.weight.shape[1], big.weight.shape[0]],
        gemm_tflops=rate / 1e12,
        forward_flops=flops,
        arithmetic_s=flops / rate,
        copy_gbps=bw / 1e9,
        weight_bytes=wb,
        weight_read_s=wb / bw,
    )


def counted_flops(fn: Callable[[], Any]) -> float | None:
    """fn run once under torch's FLOP counter -> its matrix products' FLOPs (mm, addmm, bmm, attention), or None where
    the counter cannot follow it."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as fc:
            fn()
    except Exception:  # a kernel the counter's dispatch mode cannot trace: no floor rather than a wrong one
        return None
    return float(fc.get_total_flops())


def top_ops(fn: Callable[[], Any], device: torch.device | str, rows: int = 15) -> str:
    """fn run once under torch.profiler -> the table of its `rows` top ops by self device time (self CPU time on a
    CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
