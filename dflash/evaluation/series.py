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

The run folder may be any layout dflash.models.drafter.layouts reads (dflash.train's, SpecForge's two): a step is
known by the digest of its weights, so SpecForge's final save repeating a step is evaluated once, and a step rewritten
with other weights (a rewind) is evaluated again, the old timeline's children tagged superseded and the parent
continued as a new lineage (`rewound`); a step the trainer deletes (rotation) stays as it was measured.

follow=true: the run folder is polled every watch.poll_s; a step folder is evaluated once complete and
unchanged for watch.settle_s (dflash.runs.watch; without follow, SpecForge's legacy steps, written in place, wait for
their files to be watch.settle_s old). It ends on watch.last_step, after watch.quiet_s without a
new step, or on SIGTERM / Ctrl-C while waiting (the parent ends FINISHED, exit 0); a signal during a step ends
that child and the parent KILLED (the step is evaluated again at the next start). A step that fails (a
damaged checkpoint) ends its child FAILED and the others go on; the parent then ends FAILED (exit 2).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from dflash.config.schema import EvalConfig, StepSelection, experiment_name
from dflash.evaluation import logged, pipeline
from dflash.models.drafter import layouts
from dflash.models.drafter.layouts import RunFolder, StepFolder
from dflash.models.target.weights import checkpoint_sha256
from dflash.report import console
from dflash.report.samples import samples_of
from dflash.report.training_run import Row, best_text, stall_text, training_run_markdown, training_run_png
from dflash.result import EvalResult
from dflash.runs import trainlog
from dflash.runs.watch import Settle, scan, settled
from dflash.util.errors import CheckpointError, ConfigError, Terminated, TrackingError, UserError
from dflash.util.files import find_path
from dflash.util.progress import log


@dataclass
class Outcome:
    """What one invocation did: the steps it evaluated (their results), skipped (already in the parent), failed,
    found rewritten by the trainer (superseded: their earlier evaluation), deleted before they could be read."""

    parent_id: str | None
    results: list[EvalResult] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)
    superseded: list[int] = field(default_factory=list)
    gone: list[int] = field(default_factory=list)
    stall: trainlog.Stall | None = None
    ended: str = "every selected step evaluated"

    @property
    def last_tau(self) -> float | None:
        return self.results[-1].metrics.get("acceptance_length") if self.results else None


def family(cfg: EvalConfig, run_dir: Path, run_id: str | None = None) -> Any:
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
        **({"run_id": run_id} if run_id and len(layouts.run_ids(run_dir)) > 1 else {}),  # one of a folder's runs
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]
    name = f"{d.name or run_id or run_dir.name}: τ by step"
    return tracking.TrainingRunFamily(digest, name, str(run_dir.resolve()))


def _mlflow_runs(cfg: EvalConfig, run: RunFolder) -> tuple[list[trainlog.Series], list[str]]:
    """The trainer's MLflow runs (train_metrics.run: ids or names, comma-separated; unset: SpecForge's run of this
    folder, by its run id (the unified trainer's run name) or its logged output_dir (the legacy one)) -> their
    metrics, oldest first, and notes."""
    from dflash import tracking

    tm = cfg.train_metrics
    uri = tm.uri or cfg.tracking.uri
    tokens = [t.strip() for t in (tm.run or "").split(",") if t.strip()]
    ids = [t for t in tokens if len(t) == 32 and t.isalnum()]
    names = [t for t in tokens if t not in ids]
    like = None
    if not tokens:
        if run.layout == layouts.UNIFIED:
            names = [str(run.run_id)]
        elif run.layout == layouts.LEGACY:
            like = run.root.name
        else:
            raise ConfigError(
                "train_metrics.source=mlflow needs train_metrics.run=<the trainer's run id or name> (and "
                "train_metrics.uri when it logs to another store)"
            )
    spans = tracking.trainer_runs(uri, names, ids, like)
    picked = [r for r in spans if r.run_id in ids]
    named = [r for r in spans if r.run_id not in ids]
    if like is not None or len(named) > 1:
        named = trainlog.pick_runs(named, [f.newest_ns / 1e9 for f in run.steps], run.root if like else None)
    picked = sorted(picked + named, key=lambda r: r.start_ms)
    if not picked:
        what = f"named {', '.join(names)}" if names else f"with output_dir {like}" if like else f"{', '.join(ids)}"
        raise TrackingError(
            f"no MLflow run {what} in {uri} belongs to {run.root}: pass the trainer's run id or name "
            "(train_metrics.run) and its store (train_metrics.uri)"
        )
    notes = []
    if len(picked) > 1 or len(spans) > len(picked):
        notes.append(
            f"trainer's MLflow runs read, stitched oldest first: {', '.join(r.run_id[:8] for r in picked)}"
            + (f"; {len(spans) - len(picked)} other run(s) of that name left out" if len(spans) > len(picked) else "")
        )
    return [trainlog.join_step(tracking.metric_history(uri, r.run_id)) for r in picked], notes


def read_train_metrics(cfg: EvalConfig, run: RunFolder) -> trainlog.Series:
    """The trainer's metrics, from train_metrics.source (auto: metrics.jsonl, else TensorBoard files in the run
    folder: SpecForge's `runs/`)."""
    tm = cfg.train_metrics
    root = run.root
    where = find_path(tm.path) if tm.path else root
    source = tm.source
    if source == "auto":
        source = (
            "jsonl"
            if (root / "metrics.jsonl").is_file() or where.suffix == ".jsonl"
            else "tensorboard"
            if where.is_dir() and trainlog.event_files(where)
            else "none"
        )
    if source == "none":
        return {}
    if source == "mlflow":
        parts, notes = _mlflow_runs(cfg, run)
        for n in notes:
            log.info("train_metrics: %s", n)
        return trainlog.stitch(parts)
    if source == "jsonl":
        path = where if where.is_file() else where / "metrics.jsonl"
        if not path.is_file():
            raise CheckpointError(
                f"train_metrics.source=jsonl: no {path}; pass train_metrics.path=<the trainer's metrics.jsonl>"
            )
        return trainlog.join_step(trainlog.read_jsonl(path))
    if not where.is_dir() or not trainlog.event_files(where):
        raise CheckpointError(
            f"train_metrics.source=tensorboard: no event files (events.out.tfevents.*) under {where}; pass "
            "train_metrics.path=<the trainer's log folder>"
        )
    return trainlog.read_tensorboard(where)


def _signature(files: list[Path]) -> tuple | None:
    """What a step's weights files are now (name, size, mtime); None: one is gone."""
    try:
        return tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files)
    except OSError:
        return None


class Series:
    """One invocation on one training run: the plan, the parent, the steps known, the trainer's metrics logged."""

    def __init__(self, cfg: EvalConfig, config_text: str, tags: dict[str, Any]):
        self.cfg, self.config_text, self.tags = cfg, config_text, tags
        self.run_dir = find_path(str(cfg.drafter.run_dir))
        self.root, self.run_id, _ = layouts.locate(self.run_dir)
        if not cfg.follow and scan(self.run_dir).layout is None:  # following: steps may come with the trainer
            raise layouts.unreadable(self.root)  # before the plan: nothing loads for a folder that cannot be read
        self.sel = StepSelection.parse(cfg.drafter.step)
        if cfg.follow and self.sel.single and self.sel.step is None and not self.sel.best:
            self.sel = StepSelection(single=False)  # follow=true, no step named: every step as it comes
        self.family = family(cfg, self.root, self.run_id)
        self.plan = pipeline.plan(cfg)  # cheap checks once: device, target config, prompts, references' plan
        self.prep: pipeline.Prepared | None = None  # the target and references, loaded by the first step evaluated
        self.parent: Any = None
        self.known: dict[str, tuple[int, str | None]] = {}  # digest -> (step, child id): evaluated, not superseded
        self.sigs: dict[int, tuple | None] = {}  # step -> its weights files' signature when last handled
        self.done: set[int] = set()  # steps this invocation evaluated or found evaluated
        self.folder: RunFolder = RunFolder(self.root, None, [])
        self.train_logged: dict[str, set[int]] = {}
        self.rows: list[Row] = []  # every evaluated step, as the parent's description shows it
        self.out = Outcome(None)

    # --- one step -------------------------------------------------------------------------------

    def evaluate_step(self, f: StepFolder) -> EvalResult:
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
        return res

    def rewound(self, step: int, stale: list[tuple[str, int, str | None]]) -> None:
        """The trainer rewrote `step` with other weights (a rewind: steps from there on deleted and trained
        again): the evaluations of the old timeline's steps >= `step` are superseded; the parent goes on as a new
        lineage holding the points below `step`."""
        from dflash import tracking

        old = sorted({s for _, s, _ in stale})
        log.warning(
            "step %d holds other weights than when it was evaluated (the trainer rewound): the evaluations of step(s) "
            "%s are superseded",
            step,
            ", ".join(map(str, old)),
        )
        for d, _, _ in stale:
            self.known.pop(d, None)
        self.out.superseded += old
        if self.parent is not None:
            note = f"τ by training step of `{self.root}`, after the trainer rewound it to step {step}."
            new = tracking.new_lineage(self.cfg.tracking.uri, self.parent.run_id, step, note)
            self.parent = tracking.Run.attach(self.cfg.tracking.uri, new, reopen=True)
            self.out.parent_id = new
            self.train_logged = {}

    def visit(self, ready: list[StepFolder], chosen: set[int]) -> int:
        """Evaluate the `chosen` steps among `ready` whose weights were not evaluated yet -> how many were new. A
        step is read again when its files change: the same weights (SpecForge's final save repeating a step) are
        skipped by digest, other weights (a rewind) supersede the step's earlier evaluation."""
        from dflash import tracking

        new = 0
        on_disk = {g.step for g in self.folder.steps}
        for f in ready:
            if f.step not in chosen:
                continue
            files = layouts.digest_files(f)
            sig = _signature(files)
            if sig is None or self.sigs.get(f.step) == sig:
                continue  # gone since the scan (rotation), or handled as it is
            self.sigs[f.step] = sig
            digest = None
            if f.step in {s for s, _ in self.known.values()}:
                try:
                    digest = checkpoint_sha256(files)
                except OSError:
                    continue
            if digest is not None and digest in self.known:
                if f.step not in self.done:
                    self.out.skipped.append(f.step)
                    log.info("step %d: already in the training run's parent (same checkpoint digest); skipped", f.step)
                self.done.add(f.step)
                continue
            stale = [(d, s, k) for d, (s, k) in self.known.items() if s == f.step or (s > f.step and s not in on_disk)]
            if stale:
                self.rewound(f.step, stale)
            new += 1
            self.done.add(f.step)
            try:
                res = self.evaluate_step(f)
            except (UserError, OSError) as e:  # this step's child ended FAILED with the error; the others go on
                if not f.path.is_dir() or _signature(files) is None:
                    log.warning("step %d was deleted by the trainer while it was read (rotation?): skipped", f.step)
                    self.out.gone.append(f.step)
                    continue
                if not isinstance(e, UserError):
                    raise
                log.warning("step %d failed: %s", f.step, e)
                self.out.failed.append((f.step, str(e)))
                continue
            self.known[res.info.checkpoint_sha256 or f"step {f.step}"] = (f.step, res.run_id)
            if stale and self.parent is not None:
                tracking.supersede(self.cfg.tracking.uri, [k for _, _, k in stale if k], res.run_id or "")
        return new

    # --- the parent -----------------------------------------------------------------------------

    def log_train_metrics(self) -> trainlog.Series:
        """The trainer's chosen metrics: points not yet on the parent logged at their steps (tracking.train_name:
        under train/, a name already there kept)."""
        from dflash import tracking

        series = read_train_metrics(self.cfg, self.folder)
        chosen = {k: v for k, v in series.items() if k in trainlog.choose(list(series), self.cfg.train_metrics.keys)}
        if self.parent is None:
            return chosen
        names = {tracking.train_name(k): k for k in chosen if k not in self.train_logged}
        if names:  # what an earlier invocation logged
            for name, pts in tracking.metric_history(self.cfg.tracking.uri, self.parent.run_id, list(names)).items():
                self.train_logged[names[name]] = {s for s, _ in pts}
        new = {
            tracking.train_name(k): [(s, v) for s, v in pts if s not in self.train_logged.get(k, set())]
            for k, pts in chosen.items()
        }
        self.parent.log_points(new)
        for k, pts in chosen.items():
            self.train_logged.setdefault(k, set()).update(s for s, _ in pts)
        return chosen

    def _steps(self) -> list[tuple[int, dict[str, Any], str | None]]:
        """Every finished evaluation of this run, this invocation's and earlier ones': (step, metrics, superseded
        by: None for the current ones)."""
        from dflash import tracking

        if self.parent is not None:
            return [
                (k.step, k.metrics, k.superseded_by)
                for k in tracking.series_children(self.cfg.tracking.uri, self.parent.run_id)
                if k.status == "FINISHED" and k.step is not None
            ]
        return [
            (int(r.info.drafter_step or 0), r.metrics, None if r.info.checkpoint_sha256 in self.known else "rewound")
            for r in self.out.results
        ]

    def update_parent(self, status: str) -> None:
        """The stall check over every evaluated step, the parent's description and chart, the trainer's best."""
        from dflash import tracking

        train = self.log_train_metrics()
        acc = trainlog.accuracy_name(list(train), self.cfg.train_metrics.accuracy_key)
        rows = sorted(
            (
                Row(
                    trainlog.Point(
                        s,
                        m.get("acceptance_length"),
                        m.get("acceptance_length_se"),
                        trainlog.at_or_before(train[acc], s) if acc else None,
                    ),
                    m.get("acceptance_length_macro"),
                    m.get("expected_acceptance_length"),
                    superseded is not None,
                )
                for s, m, superseded in self._steps()
            ),
            key=lambda r: (r.point.step, r.superseded),
        )
        self.rows = rows
        current = [r.point for r in rows if not r.superseded]
        self.out.stall = trainlog.stall(current, acc, self.cfg.train_metrics.min_rise) if acc else None
        if self.parent is not None:
            run, unit = self.folder, self.folder.unit
            note = training_run_markdown(str(self.root), rows, acc, self.out.stall, status, run.best, unit)
            self.parent.set_note(note)
            self.parent.set_tags(
                {
                    f"{tracking.ORIGIN_TAG}layout": run.layout,
                    f"{tracking.ORIGIN_TAG}step_unit": unit,
                    tracking.TRAINER_BEST_TAG: run.best.step if run.best else None,
                }
            )
            png = training_run_png(rows, train, acc, run.best, unit, f"{self.family.name}")
            self.parent.log_files({tracking.TRAINING_CHART: png})
            tracking.setup_training_view(self.cfg.tracking.uri, self.parent.experiment_id, acc)

    # --- the loop -------------------------------------------------------------------------------

    @contextmanager
    def parent_open(self) -> Iterator[None]:
        """The current parent (a rewind moves it to a new lineage) ends as the invocation does."""
        try:
            yield
        except BaseException:
            if self.parent is not None:
                self.parent.__exit__(*sys.exc_info())
            raise
        if self.parent is not None:
            self.parent.__exit__(None, None, None)

    def run_loop(self) -> None:
        w = self.cfg.watch
        settle, quiet_since = Settle(w.settle_s if self.cfg.follow else 0.0), time.monotonic()
        while True:
            self.folder = run = scan(self.run_dir)
            steps = [f.step for f in run.steps]
            if self.sel.best and not self.cfg.follow and run.layout is not None:
                layouts.best_step(run)  # none recorded: say so
            chosen = set(self.sel.select(steps, run.best.step if run.best else None))  # /k: every folder there
            ready = settle.ready(run.steps, time.monotonic())
            if not self.cfg.follow:
                if run.layout == layouts.LEGACY:  # written in place: read once its files are old enough
                    ready = [f for f in ready if settled(f, time.time(), w.settle_s)]
                for f in run.steps:
                    if f.step in chosen and f not in ready:
                        why = f.why_not or f"its files changed less than watch.settle_s={w.settle_s:g} s ago"
                        log.warning("step %d is not complete (%s): not evaluated", f.step, why)
            if self.visit(ready, chosen):
                quiet_since = time.monotonic()
                self.update_parent("following" if self.cfg.follow else "running")
            if not self.cfg.follow:
                if run.layout is None:
                    raise layouts.unreadable(self.root)
                if not self.done and not self.out.failed:
                    raise CheckpointError(
                        f"drafter.step={self.cfg.drafter.step!r} selects no complete step of {self.root} (steps "
                        f"there: {', '.join(map(str, steps)) or 'none'})"
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

    def run(self) -> Outcome:
        from dflash import tracking

        tc = self.cfg.tracking
        if tc.enabled:
            pid = tracking.open_parent(
                tc.uri, experiment_name(tc, self.cfg.target.name), self.family, tc.artifact_location
            )
            self.parent = tracking.Run.attach(tc.uri, pid, reopen=True)
            self.out.parent_id = pid
        with self.parent_open():
            if self.parent is not None:
                self.known = dict(tracking.evaluated_steps(tc.uri, self.parent.run_id))
            self.run_loop()
            self.update_parent(f"ended: {self.out.ended}")
            if self.out.failed:
                raise CheckpointError(
                    f"{len(self.out.failed)} step(s) of {self.root} failed: "
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
    if out.superseded:
        lines.append(f"  superseded (the trainer rewound the run): step(s) {', '.join(map(str, out.superseded))}")
    if out.gone:
        lines.append(f"  deleted by the trainer before they could be read: step(s) {', '.join(map(str, out.gone))}")
    if s.folder.best is not None:
        lines.append(f"  {best_text(s.folder.best, [r.point for r in s.rows if not r.superseded])}")
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
