"""A training run evaluated step by step: `drafter.step=all` (a list, a range, every k-th) and `follow=true`.

One process and one plan (dflash.evaluation.pipeline.plan: device, target config, prompts, references' plan, resolved
once); the target and the references are loaded once, when the first step needs them (`prepare_run`); each
step is one replay (`evaluate_drafter`). The MLflow record (dflash.tracking.parents): one parent per training
run, found by a digest of what makes its τ comparable (`family`: the run folder, the target, the prompt,
template, references and replay settings, the drafter overrides), reopened by every invocation; a child per
step, logged as a single evaluation is (dflash.evaluation.logged). The parent holds one point per step on its curves
(MLflow step = training step: `tracking.series_point`) and the trainer's metrics under `train/`
(dflash.runs.trainlog; from its MLflow run through dflash.tracking). A step whose checkpoint digest a
finished child already holds is skipped, so a nightly job or a restarted follower evaluates only what is new.

follow=true: the run folder is polled every watch.poll_s; a step folder is evaluated once complete and
unchanged for watch.settle_s (dflash.runs.watch). It ends on watch.last_step, after watch.quiet_s without a
new step, or on SIGTERM / Ctrl-C while waiting (the parent ends FINISHED, exit 0); a signal during a step ends
that child and the parent KILLED (the step is evaluated again at the next start). A step that fails (a
damaged checkpoint) ends its child FAILED and the others go on; the parent then ends FAILED (exit 2).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.config.schema import EvalConfig, StepSelection, experiment_name
from dflash.evaluation import logged, pipeline
from dflash.models.drafter.files import checkpoint_files
from dflash.models.target.weights import checkpoint_sha256
from dflash.report import console
from dflash.report.samples import samples_of
from dflash.report.training_run import stall_text, training_run_markdown
from dflash.result import EvalResult
from dflash.runs import trainlog
from dflash.runs.watch import Settle, StepFolder, scan
from dflash.util.errors import CheckpointError, Terminated, UserError
from dflash.util.files import find_path
from dflash.util.progress import log


@dataclass
class Outcome:
    """What one invocation did: the steps it evaluated (their results), skipped (already in the parent), failed."""

    parent_id: str | None
    results: list[EvalResult] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)
    stall: trainlog.Stall | None = None
    ended: str = "every selected step evaluated"

    @property
    def last_tau(self) -> float | None:
        return self.results[-1].metrics.get("acceptance_length") if self.results else None


def family(cfg: EvalConfig, run_dir: Path) -> Any:
    """The training run's MLflow family: its id digests the run folder and every setting its τ depends on."""
    from dflash import tracking

    d, r = cfg.drafter, cfg.references
    ident = {
        "run_dir": str(run_dir.resolve()),
        "target": dataclasses.asdict(cfg.target),
        "prompts": dataclasses.asdict(cfg.prompts),
        "references": {k: getattr(r, k) for k in ("source", "model", "temperature", "top_p", "top_k", "seed")},
        "replay.tf_stride": cfg.replay.tf_stride,
        "drafter": {k: getattr(d, k) for k in ("block_size", "mask_token_id", "target_layer_ids", "sliding_window")},
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]
    name = f"{d.name or run_dir.name}: τ by step"
    return tracking.TrainingRunFamily(digest, name, str(run_dir.resolve()))


def read_train_metrics(cfg: EvalConfig, run_dir: Path) -> trainlog.Series:
    """The trainer's metrics, from train_metrics.source (auto: metrics.jsonl, else TensorBoard files in run_dir)."""
    tm = cfg.train_metrics
    where = find_path(tm.path) if tm.path else run_dir
    source = tm.source
    if source == "auto":
        source = (
            "jsonl"
            if (run_dir / "metrics.jsonl").is_file() or where.suffix == ".jsonl"
            else "tensorboard"
            if where.is_dir() and trainlog.event_files(where)
            else "none"
        )
    if source == "none":
        return {}
    if source == "mlflow":
        from dflash import tracking

        return tracking.metric_history(tm.uri or cfg.tracking.uri, str(tm.run))
    if source == "jsonl":
        path = where if where.is_file() else where / "metrics.jsonl"
        if not path.is_file():
            raise CheckpointError(
                f"train_metrics.source=jsonl: no {path}; pass train_metrics.path=<the trainer's metrics.jsonl>"
            )
        return trainlog.read_jsonl(path)
    if not where.is_dir() or not trainlog.event_files(where):
        raise CheckpointError(
            f"train_metrics.source=tensorboard: no event files (events.out.tfevents.*) under {where}; pass "
            "train_metrics.path=<the trainer's log folder>"
        )
    return trainlog.read_tensorboard(where)


class Series:
    """One invocation on one training run: the plan, the parent, the steps known, the trainer's metrics logged."""

    def __init__(self, cfg: EvalConfig, config_text: str, tags: dict[str, Any]):
        self.cfg, self.config_text, self.tags = cfg, config_text, tags
        self.run_dir = find_path(str(cfg.drafter.run_dir))
        if not self.run_dir.is_dir() and not cfg.follow:  # following: the folder may come with the trainer's first step
            raise CheckpointError(
                f"drafter.run_dir={self.run_dir} does not exist; point it at a training run folder holding step_<N>/ "
                f"folders"
            )
        self.sel = StepSelection.parse(cfg.drafter.step)
        if cfg.follow and self.sel.single and self.sel.step is None:
            self.sel = StepSelection(single=False)  # follow=true, no step named: every step as it comes
        self.family = family(cfg, self.run_dir)
        self.plan = pipeline.plan(cfg)  # cheap checks once: device, target config, prompts, references' plan
        self.prep: pipeline.Prepared | None = None  # the target and references, loaded by the first step evaluated
        self.parent: Any = None
        self.done: dict[int, str] = {}  # step -> digest, evaluated (by this invocation or a finished child before it)
        self.train_logged: dict[str, set[int]] = {}
        self.out = Outcome(None)

    # --- one step -------------------------------------------------------------------------------

    def already(self, f: StepFolder, finished: dict[str, int]) -> bool:
        """Whether a finished child holds this step's checkpoint (matched by digest; a step rewritten since is new)."""
        if f.step not in finished.values():
            return False
        files = checkpoint_files(f.path)
        return bool(files) and checkpoint_sha256(files) in finished

    def evaluate_step(self, f: StepFolder) -> None:
        cfg = dataclasses.replace(self.cfg, drafter=dataclasses.replace(self.cfg.drafter, step=f.step), follow=False)
        timings: dict[str, float] = {}

        def work() -> EvalResult:
            src = self.plan.drafter(pipeline.read_drafter_conf(cfg, f.step))
            if self.prep is None:
                self.prep = pipeline.prepare_run(self.plan, timings)
            return pipeline.evaluate_drafter(self.prep, src, timings)

        out = logged.evaluate(cfg, work, self.config_text, self.tags, parent=self.family if self.parent else None)
        res = out.result
        print(console.summary(res, out.where, samples=samples_of(res, min(cfg.num_samples, 1))))
        if self.parent is not None:
            from dflash import tracking

            point = tracking.series_point({**res.metrics, **tracking.dspark_metrics(res)}, res.curves)
            self.parent.log_metrics(point, step=f.step)
        self.out.results.append(res)
        self.done[f.step] = res.info.checkpoint_sha256 or ""

    def visit(self, folders: list[StepFolder], chosen: set[int], finished: dict[str, int]) -> int:
        """Evaluate the `chosen`, not yet evaluated steps among `folders` (the ready ones) -> how many were new."""
        new = 0
        for f in folders:
            if f.step in self.done or f.step not in chosen:
                continue
            if self.already(f, finished):
                self.done[f.step] = ""
                self.out.skipped.append(f.step)
                log.info("step %d: already in the training run's parent (same checkpoint digest); skipped", f.step)
                continue
            new += 1
            try:
                self.evaluate_step(f)
            except UserError as e:  # this step's child ended FAILED with the error; the others go on
                log.warning("step %d failed: %s", f.step, e)
                self.out.failed.append((f.step, str(e)))
                self.done[f.step] = ""
        return new

    # --- the parent -----------------------------------------------------------------------------

    def log_train_metrics(self) -> trainlog.Series:
        """The trainer's chosen metrics: points not yet on the parent logged under train/ at their steps."""
        from dflash import tracking

        series = read_train_metrics(self.cfg, self.run_dir)
        chosen = {k: v for k, v in series.items() if k in trainlog.choose(list(series), self.cfg.train_metrics.keys)}
        if self.parent is None:
            return chosen
        names = [f"{tracking.TRAIN}{k}" for k in chosen if k not in self.train_logged]
        if names:  # what an earlier invocation logged
            for name, pts in tracking.metric_history(self.cfg.tracking.uri, self.parent.run_id, names).items():
                self.train_logged[name[len(tracking.TRAIN) :]] = {s for s, _ in pts}
        new = {
            f"{tracking.TRAIN}{k}": [(s, v) for s, v in pts if s not in self.train_logged.get(k, set())]
            for k, pts in chosen.items()
        }
        self.parent.log_points(new)
        for k, pts in chosen.items():
            self.train_logged.setdefault(k, set()).update(s for s, _ in pts)
        return chosen

    def update_parent(self, status: str) -> None:
        """The stall check over every evaluated step (this invocation's and earlier ones'), the parent's description."""
        from dflash import tracking

        train = self.log_train_metrics()
        acc = trainlog.accuracy_name(list(train), self.cfg.train_metrics.accuracy_key)
        if self.parent is not None:  # every finished step, this invocation's and earlier ones'
            steps = [
                (k.step, k.metrics)
                for k in tracking.children(self.cfg.tracking.uri, self.parent.run_id, rows=False)
                if k.status == "FINISHED" and k.step is not None
            ]
        else:
            steps = [(int(r.info.drafter_step or 0), r.metrics) for r in self.out.results]
        rows = sorted(
            (
                (
                    trainlog.Point(
                        s,
                        m.get("acceptance_length"),
                        m.get("acceptance_length_se"),
                        trainlog.at_or_before(train[acc], s) if acc else None,
                    ),
                    m.get("acceptance_length_macro"),
                    m.get("expected_acceptance_length"),
                )
                for s, m in steps
            ),
            key=lambda r: r[0].step,
        )
        self.out.stall = trainlog.stall([r[0] for r in rows], acc, self.cfg.train_metrics.min_rise) if acc else None
        if self.parent is not None:
            self.parent.set_note(training_run_markdown(str(self.run_dir), rows, acc, self.out.stall, status))
            tracking.setup_training_view(self.cfg.tracking.uri, self.parent.experiment_id, acc)

    # --- the loop -------------------------------------------------------------------------------

    def run(self) -> Outcome:
        from dflash import tracking

        tc, w = self.cfg.tracking, self.cfg.watch
        if tc.enabled:
            pid = tracking.open_parent(
                tc.uri, experiment_name(tc, self.cfg.target.name), self.family, tc.artifact_location
            )
            self.parent = tracking.Run.attach(tc.uri, pid, reopen=True)
            self.out.parent_id = pid
        with self.parent or tracking.NoRun():
            finished = tracking.evaluated_steps(tc.uri, self.parent.run_id) if self.parent else {}
            settle, quiet_since = Settle(w.settle_s if self.cfg.follow else 0.0), time.monotonic()
            while True:
                folders = scan(self.run_dir)
                chosen = set(
                    self.sel.select([f.step for f in folders])
                )  # every k-th counts the folders there, complete or not
                if not self.cfg.follow:
                    for f in folders:
                        if f.why_not and f.step in chosen:
                            log.warning("step %d is not complete (%s): not evaluated", f.step, f.why_not)
                if self.visit(settle.ready(folders, time.monotonic()), chosen, finished):
                    quiet_since = time.monotonic()
                    self.update_parent("following" if self.cfg.follow else "running")
                if not self.cfg.follow:
                    if not self.done and not self.out.failed:
                        raise CheckpointError(
                            f"drafter.step={self.cfg.drafter.step!r} selects no complete step of {self.run_dir} (steps "
                            f"there: "
                            f"{', '.join(str(f.step) for f in folders) or 'none'})"
                        )
                    break
                if w.last_step is not None and any(s >= w.last_step for s in self.done):
                    self.out.ended = f"step {max(self.done)} reached watch.last_step={w.last_step}"
                    break
                if w.quiet_s is not None and time.monotonic() - quiet_since >= w.quiet_s:
                    self.out.ended = f"no new step for watch.quiet_s={w.quiet_s:g} s"
                    break
                try:
                    time.sleep(w.poll_s)
                except (Terminated, KeyboardInterrupt) as e:  # between steps: the normal end of following
                    self.out.ended = f"{'SIGTERM' if isinstance(e, Terminated) else 'SIGINT'} while waiting for a step"
                    break
            self.update_parent(f"ended: {self.out.ended}")
            if self.out.failed:
                raise CheckpointError(
                    f"{len(self.out.failed)} step(s) of {self.run_dir} failed: "
                    + "; ".join(f"step {s}: {e}" for s, e in self.out.failed)
                )
        return self.out


def evaluate_training_run(cfg: EvalConfig, config_text: str, tags: dict[str, Any] | None = None) -> Outcome:
    """Evaluate the selected steps of drafter.run_dir (follow=true: as they appear); print what was done."""
    s = Series(cfg, config_text, tags or {})
    out = s.run()
    lines = [
        f"== training run {s.run_dir}: {len(out.results)} step(s) evaluated"
        + (f", {len(out.skipped)} already in its parent ({', '.join(map(str, out.skipped))})" if out.skipped else "")
        + f"; {out.ended}"
    ]
    for r in out.results:
        m = r.metrics
        lines.append(
            f"  step {r.info.drafter_step}: τ {console.fmt(m.get('acceptance_length'))} ± "
            f"{console.fmt(m.get('acceptance_length_se'))}"
            f"   expected {console.fmt(m.get('expected_acceptance_length'))}"
        )
    if out.stall is not None:
        lines.append(f"WARNING: {stall_text(out.stall)}")
    if out.parent_id:
        from dflash import tracking

        exp = tracking.mlflow_client(cfg.tracking.uri).get_run(out.parent_id).info.experiment_id
        lines.append(
            f"MLflow: training run parent {out.parent_id} at {cfg.tracking.uri}\n  see it: mlflow ui "
            f"--backend-store-uri "
            f"{cfg.tracking.uri}   then {tracking.training_view_url(exp)}"
        )
    print("\n".join(lines))
    return out
