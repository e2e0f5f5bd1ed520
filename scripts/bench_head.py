"""The drafter's LM head over full logits against the chunked one (dflash/models/drafter/head.py), on this machine.

    python scripts/bench_head.py [--H 5120] [--V 248320] [--rows 16,64,256] [--dtypes float32,bfloat16]
                                 [--bf16-rows 16,64] [--k 16] [--reps 3] [--device cpu]

Per row count (16 rows = one anchor's block of 16 slots): the product alone, then for DFlash the full argmax
against the chunked top-1, for DFlash2 torch.topk over full logits (its order among ties unspecified) and the
canonical top k over full logits (head.canonical_topk) against the chunked one, and the same with the scores
(log-sum-exp, NLL, top-1 probability, softcapped as DFlash2's transform). Each variant is timed as the median of
--reps round-robin rounds after a warm-up round (a shared machine's load falls on every variant alike); on a CPU
its peak memory is the process's peak RSS during one call above its RSS before it (VmHWM reset through
/proc/self/clear_refs; the process re-executes itself so that freed blocks leave RSS), on CUDA the allocator's
peak above its use before. Ratios are chunked / full, in the same run. No figure is asserted anywhere.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from dflash.models.drafter.head import Head, canonical_topk, select

ALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MKL_DISABLE_FAST_MM": "1"}  # RSS follows live memory (CPU)


def rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def peak_mb(fn: Callable[[], object], device: str) -> float:
    """Peak memory during one call of fn above the use before it, in MB."""
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    base = rss_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    fn()
    return (rss_kb("VmHWM") - base) / 1024


def measure(fns: dict[str, Callable[[], object]], reps: int, device: str) -> dict[str, tuple[float, float]]:
    """-> per variant (median seconds, peak MB), round robin; the warm-up round gives the peak memory."""
    peaks = {n: peak_mb(fn, device) for n, fn in fns.items()}
    times: dict[str, list[float]] = {n: [] for n in fns}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(reps):
        for n, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[n].append(time.perf_counter() - t0)
    return {n: (statistics.median(times[n]), peaks[n]) for n in fns}


def softcap(x: Tensor) -> Tensor:  # DFlash2's transform (multiplier 1, c = 30), as dflash2.transform computes it
    return torch.tanh(x.float() / 30.0) * 30.0


def full_scores(z: Tensor, ref: Tensor) -> tuple[Tensor, Tensor]:
    """The full-logit scores: the top-1 probability and the reference's NLL."""
    y = softcap(z)
    lse = y.logsumexp(-1)
    return (y.max(-1).values - lse).exp(), lse - y.gather(-1, ref[:, None])[:, 0]


def variants(h: Tensor, W: Tensor, k: int, ref: Tensor) -> dict[str, Callable[[], object]]:
    lin = nn.Linear(W.shape[1], W.shape[0], bias=False, device=W.device, dtype=W.dtype)
    lin.weight.data = W
    hd = Head(whole=lin, weight=W)
    return {
        "product only (logits [R, V])": lambda: lin(h),
        "full argmax": lambda: lin(h).argmax(-1),
        "chunked top-1": lambda: select(hd, h, 1),
        f"full torch.topk({k})": lambda: lin(h).topk(k, -1),
        f"full canonical top-{k}": lambda: canonical_topk(lin(h), k),
        f"chunked top-{k}": lambda: select(hd, h, k),
        f"full top-{k} + scores": lambda: (lambda z: (canonical_topk(z, k), full_scores(z, ref)))(lin(h)),
        f"chunked top-{k} + scores": lambda: select(hd, h, k, ref=ref, score=softcap),
    }


PAIRS = (
    ("chunked top-1", "full argmax"),
    ("chunked top-{k}", "full torch.topk({k})"),
    ("chunked top-{k}", "full canonical top-{k}"),
    ("chunked top-{k} + scores", "full top-{k} + scores"),
)


def weights(V: int, H: int, dtype: torch.dtype, device: str, block: int = 16384) -> Tensor:
    """W [V, H] ~ N(0, 0.02) (HF's init), written block by block: no float32 copy of the whole."""
    W = torch.empty(V, H, dtype=dtype, device=device)
    for lo in range(0, V, block):
        W[lo : lo + block] = (torch.randn(min(block, V - lo), H, device=device) * 0.02).to(dtype)
    return W


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--H", type=int, default=5120)
    ap.add_argument("--V", type=int, default=248320)
    ap.add_argument("--rows", default="16,64,256")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--bf16-rows", default=None, help="rows for bfloat16 (default: --rows)")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    if a.device == "cpu" and any(os.environ.get(k) != v for k, v in ALLOC_ENV.items()):  # before the process starts
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ALLOC_ENV})
    torch.manual_seed(0)
    print(
        f"# torch {torch.__version__}, {a.device}, {torch.get_num_threads()} CPU threads; H={a.H} V={a.V} k={a.k}; "
        f"median of {a.reps} round-robin rounds after a warm-up round; load average at start {os.getloadavg()[0]:.2f}"
    )
    for name in a.dtypes.split(","):
        dtype = getattr(torch, name)
        W = weights(a.V, a.H, dtype, a.device)
        rows = a.bf16_rows if dtype == torch.bfloat16 and a.bf16_rows else a.rows
        for R in (int(r) for r in rows.split(",")):
            h = torch.randn(R, a.H, device=a.device).to(dtype)
            ref = torch.randint(0, a.V, (R,), device=a.device)
            with torch.no_grad():
                res = measure(variants(h, W, a.k, ref), a.reps, a.device)
            gflop = 2 * R * a.H * a.V / 1e9
            print(
                f"\n{name}, rows {R}, logits {R * a.V * dtype.itemsize / 2**20:.0f} MB, product {gflop:.0f} GFLOP, "
                f"weights {W.numel() * W.element_size() / 2**30:.2f} GiB"
            )
            for n, (t, mb) in res.items():
                print(f"  {n:30s} {t * 1e3:9.1f} ms  {gflop / t:7.1f} GFLOP/s  peak {mb:8.1f} MB")
            for c, f in PAIRS:
                c, f = c.format(k=a.k), f.format(k=a.k)
                print(
                    f"  ratio {c} / {f}: time {res[c][0] / res[f][0]:.2f}x, "
                    f"peak memory {res[c][1] / max(res[f][1], 1e-9):.3f}x"
                )
            print(f"  (load average now {os.getloadavg()[0]:.2f})", flush=True)
        del W


if __name__ == "__main__":
    main()
