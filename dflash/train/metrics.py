"""Training metrics: counters summed over a window of steps, their ratios, and where they go.

`Window` sums each step's `StepStats` between two metrics lines; `summarise` derives every ratio
from those sums: accuracy per slot against the variant's own labels (`acc_k`) and against the
target's greedy tokens (`acc_clean_k`: differs under bug 1 only), the expected acceptance length
from them (`tf_expected_tau` = 1 + Σ_k Π_{i≤k} acc_i) and from exact prefixes (`tf_prefix_tau`: for DSpark,
whose Markov head is teacher-forced, the accepted length its greedy rollout reaches on the data); a DSpark
variant adds the ratios of its own sums (step.dspark_sums: `ce_loss`, `l1_loss`, `confidence_loss`,
`accept_p_k`, `tau_probabilistic`, `confidence_abs_error`, `confidence_bias`), SpecForge's names where it has one.
`Tracker` writes every row to `<run_dir>/metrics.jsonl` and, when tracking is on, to one MLflow
run per variant through dflash.tracking (resumed runs keep logging to theirs); `import_metrics`
logs a metrics.jsonl written without MLflow (the GPU machine) to a store.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from dflash.stages.metrics import expected_acceptance_length, ratio
from dflash.train.step import StepStats
from dflash.util.files import atomic_write_text, open_append


@dataclass
class Window:
    hit_own: Tensor | int = 0  # [B-1]
    hit_clean: Tensor | int = 0
    count: Tensor | int = 0
    prefix: Tensor | int = 0
    loss: float = 0.0
    n: int = 0  # steps
    tokens: int = 0
    time: float = 0.0  # the variant's own seconds
    flip: float = 0.0  # bug 1's label flip rates, summed over the steps that had one
    flip_n: int = 0
    sums: dict[str, tuple[float, float]] | None = None  # DSpark: name -> (numerator, denominator) summed

    def add(self, m: StepStats, dt: float) -> None:
        self.hit_own, self.hit_clean = self.hit_own + m.hit_own, self.hit_clean + m.hit_clean
        self.count, self.prefix = self.count + m.count, self.prefix + m.prefix
        self.loss, self.n, self.tokens, self.time = (
            self.loss + m.loss,
            self.n + 1,
            self.tokens + m.tokens,
            self.time + dt,
        )
        if m.label_flip_rate is not None:
            self.flip, self.flip_n = self.flip + m.label_flip_rate, self.flip_n + 1
        if m.sums is not None:
            old = self.sums or {}
            self.sums = {
                k: (old.get(k, (0.0, 0.0))[0] + a, old.get(k, (0.0, 0.0))[1] + b) for k, (a, b) in m.sums.items()
            }

    @property
    def tokens_per_s(self) -> float | None:
        return ratio(self.tokens, self.time)

    @property
    def label_flip_rate(self) -> float | None:
        """Bug 1: the mean of the steps' label flip rates; None where no step had a valid label."""
        return ratio(self.flip, self.flip_n)


def summarise(w: Window, B: int) -> dict[str, float | None]:
    """Ratios of a window's sums over slots 1..B-1 (B = the proposals + 1: DFlash's block, DSpark's gamma + 1);
    None where a ratio is over nothing (no labelled slot k in the window)."""
    assert isinstance(w.count, Tensor), "summarise needs a window with at least one step"
    cnt, own_hits, clean_hits = w.count.tolist(), w.hit_own.tolist(), w.hit_clean.tolist()
    own = [ratio(h, c) for h, c in zip(own_hits, cnt)]  # [B-1]
    out: dict[str, float | None] = {
        "acc": ratio(sum(own_hits), sum(cnt)),
        "acc_clean": ratio(sum(clean_hits), sum(cnt)),
    }
    for k in range(1, B):
        out[f"acc_{k}"] = own[k - 1]
        out[f"acc_clean_{k}"] = ratio(clean_hits[k - 1], cnt[k - 1])
    out["tf_expected_tau"] = expected_acceptance_length(own)  # 1 + sum_k prod_{i<=k} acc_i (teacher-forced, own labels)
    prefix = ratio(float(w.prefix.sum()), cnt[0])
    out["tf_prefix_tau"] = None if prefix is None else 1.0 + prefix
    out.update({k: ratio(a, b) for k, (a, b) in (w.sums or {}).items()})
    return out


class Tracker:
    """MLflow for one variant (optional), always mirrored to <run_dir>/metrics.jsonl."""

    def __init__(
        self,
        tracking_cfg: Any,
        run_dir: Path,
        name: str,
        bugs: dict[str, bool],
        params: dict[str, Any],
        target_name: str,
    ):
        self.file = open_append(run_dir / "metrics.jsonl")
        atomic_write_text(run_dir / "params.json", json.dumps(params, indent=1, default=str))
        self.run = None
        t = tracking_cfg
        if t is not None and t.enabled:
            from dflash import tracking

            rid_file = run_dir / "mlflow_run_id"
            run_id = rid_file.read_text().strip() if rid_file.is_file() else None  # resumed: keep logging to it
            tags = tracking.train_tags(name, bugs)
            self.run = tracking.Run(
                t.uri,
                t.experiment or f"dflash-train/{target_name}",
                name,
                getattr(t, "artifact_location", None),
                tags=tags,
                resume_id=run_id,
            )
            if not run_id:
                atomic_write_text(rid_file, self.run.run_id)
                self.run.log_params(params)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.run is not None:
            self.run.log_metrics(metrics, step=step)

    def close(self, exc_type: type[BaseException] | None = None, exc: BaseException | None = None) -> None:
        """The rows' file closed and the MLflow run ended: FINISHED, or with the exception that stops training
        FAILED (an error) or KILLED (Ctrl-C, SIGTERM), as an evaluation's run ends (tracking.Run.__exit__)."""
        self.file.close()
        if self.run is not None:
            self.run.__exit__(exc_type, exc, None)


def import_metrics(
    run_dir: str | Path,
    uri: str = "sqlite:///mlflow.db",
    experiment: str | None = None,
    target_name: str = "smollm2_135m",
) -> str:
    """Log a run's metrics.jsonl (written where MLflow was off, e.g. on the GPU machine) to MLflow -> run id."""
    from dflash import tracking

    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    tags = tracking.train_tags(run_dir.name, summary.get("bugs") or {}, str(run_dir / "metrics.jsonl"))
    with tracking.Run(uri, experiment or f"dflash-train/{target_name}", run_dir.name, tags=tags) as run:
        if (run_dir / "params.json").is_file():
            run.log_params(json.loads((run_dir / "params.json").read_text()))
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            step = int(row.pop("step"))
            run.log_metrics({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)
        return run.run_id
