"""What the Hydra entry points share: the job's context, `-m` sweeps, the exit policy.

The exit policy of a Hydra entry point (`main`, `run_job`), the same for every launcher:
- a user error (dflash.util.errors.UserError, a config that does not compose or names an unknown
  key or group option) exits 2 with its message, no traceback (HYDRA_FULL_ERROR=1 or
  DFLASH_VERBOSE=1 shows it); any other exception is a bug: exit 1 with a traceback;
- SIGINT / SIGTERM end the run (and its sweep parent) KILLED and exit 130 / 143, no traceback;
- in a `-m` sweep a failing job does not stop the sweep: it is recorded (its run ends FAILED with
  the error, the job's number, overrides and error go to the sweep's record) and the next job
  starts. When the sweep ends (`SweepCallback`) its MLflow parent is closed: FINISHED when every
  job passed, else FAILED listing the failed jobs, and the process exits 1.

Sweep identity: `on_multirun_start` draws a fresh sweep id and writes it, with the sweep's name
(what was swept), to `<hydra.sweep.dir>/.dflash/sweep.json`; every job reads it there, whatever
the launcher (in process, joblib processes, submitit/SLURM jobs on a shared disk), and its run
joins the parent holding that id. Re-using a sweep folder therefore starts a new parent. Each
job writes its outcome to `<sweep dir>/.dflash/<sweep id>/job_<n>.json`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from dflash.config.compose import check_overrides, check_schema
from dflash.config.schema import experiment_name
from dflash.report.sweep import swept_values
from dflash.util.errors import (
    ConfigError,
    Terminated,
    UserError,
    exit_code,
    install_signal_handlers,
    signals_deferred,
    verbose,
)
from dflash.util.files import atomic_write_text

# --- Hydra job context and sweeps ----------------------------------------------------------------


@dataclass
class SweepInfo:
    """One `-m` sweep: its unique id, its name (what was swept), its folder."""

    id: str
    name: str
    dir: str


@dataclass
class JobContext:
    """The running Hydra job: group choices, overrides, and in a `-m` sweep its number and sweep."""

    choices: dict[str, str] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    job_num: Optional[int] = None
    sweep: Optional[SweepInfo] = None


def hydra_context() -> JobContext:
    """The running Hydra job's context (empty outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return JobContext()
    hc = HydraConfig.get()
    choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra") and v is not None}
    if str(hc.mode) != "RunMode.MULTIRUN":
        return JobContext(choices, list(hc.overrides.task))
    return JobContext(choices, list(hc.overrides.task), hc.job.num, read_sweep(str(hc.sweep.dir)))


def _state_dir(sweep_dir: str) -> Path:
    return Path(sweep_dir) / ".dflash"


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1))


def sweep_name(overrides: list[str]) -> str:
    """What a sweep sweeps, e.g. `sweep drafter.step=1633,5037` (its sweep overrides, else all)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    swept = [o.input_line or "" for o in parsed if o.is_sweep_override()] or list(overrides)
    name = "sweep " + " ".join(swept) if swept else "sweep"
    return name if len(name) <= 250 else name[:249] + "…"


def start_sweep(sweep_dir: str, name: str) -> SweepInfo:
    """A fresh sweep id, written where every job of this sweep reads it."""
    info = SweepInfo(uuid.uuid4().hex, name, sweep_dir)
    _write_json(
        _state_dir(sweep_dir) / "sweep.json",
        {**dataclasses.asdict(info), "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()},
    )
    return info


def read_sweep(sweep_dir: str) -> Optional[SweepInfo]:
    path = _state_dir(sweep_dir) / "sweep.json"
    if not path.is_file():
        return None
    d = json.loads(path.read_text())
    return SweepInfo(d["id"], d["name"], d["dir"])


def record_job(sweep: SweepInfo, job: int, overrides: list[str], status: str, error: Optional[str] = None) -> None:
    _write_json(
        _state_dir(sweep.dir) / sweep.id / f"job_{job}.json",
        {"job": job, "overrides": overrides, "status": status, "error": error},
    )


def job_records(sweep: SweepInfo) -> list[dict[str, Any]]:
    folder = _state_dir(sweep.dir) / sweep.id
    recs = [json.loads(p.read_text()) for p in folder.glob("job_*.json")] if folder.is_dir() else []
    return sorted(recs, key=lambda r: r["job"])


# --- the exit policy -----------------------------------------------------------------------------


def _prog() -> str:
    p = Path(sys.argv[0])
    return (
        f"dflash-{p.parent.name}" if p.name == "__main__.py" else p.name or "dflash"
    )  # python -m dflash.train: dflash-train


def report_error(e: BaseException) -> None:
    """A user error: its message (and with verbose() its traceback); anything else: the traceback."""
    if isinstance(e, UserError) and not verbose():
        print(f"{_prog()}: error: {e}", file=sys.stderr)
    else:
        traceback.print_exception(e)


def run_job(task: Callable[[Any, JobContext], Any], cfg: Any) -> Any:
    """Run one Hydra job under the exit policy (see the module docstring)."""
    ctx = hydra_context()
    try:
        out = task(cfg, ctx)
    except (KeyboardInterrupt, Terminated):
        raise
    except Exception as e:
        if ctx.sweep is None and ctx.job_num is None:  # a single run
            if isinstance(e, UserError):
                report_error(e)
                sys.exit(exit_code(e))
            raise  # a bug: Hydra prints the traceback, exit 1
        report_error(e)  # a sweep job: recorded, and the next job starts
        if ctx.sweep is not None:
            record_job(ctx.sweep, int(ctx.job_num or 0), ctx.overrides, "FAILED", f"{type(e).__name__}: {e}"[:2000])
        return None
    if ctx.sweep is not None:
        record_job(ctx.sweep, int(ctx.job_num or 0), ctx.overrides, "FINISHED")
    return out


@dataclass
class _ActiveSweep:
    info: SweepInfo
    uri: Optional[str]  # None: tracking disabled


_ACTIVE: Optional[_ActiveSweep] = None


def _finish_sweep(status: Optional[str] = None, reason: str = "") -> list[dict[str, Any]]:
    """Close the sweep this process started (if any): its MLflow parent gets the comparison and ends
    `status` (None: FINISHED, or FAILED if a job failed). -> the failed jobs' records."""
    global _ACTIVE
    active, _ACTIVE = _ACTIVE, None
    if active is None:
        return []
    records = job_records(active.info)
    for r, vals in zip(records, swept_values([r["overrides"] for r in records])):  # name a job by what sets it apart
        r["label"] = " ".join(f"{k}={v}" for k, v in vals.items()) or " ".join(r["overrides"])
    failed = [r for r in records if r["status"] != "FINISHED"]
    if active.uri is not None:
        with signals_deferred():
            try:
                close_sweep(active.uri, active.info.id, failed, status, reason)
            except Exception as e:  # the sweep's outcome stands; say why its parent could not be closed
                print(f"{_prog()}: could not close the sweep's MLflow parent: {type(e).__name__}: {e}", file=sys.stderr)
    return failed


def close_sweep(
    uri: str, sweep_id: str, failed: list[dict[str, Any]], status: Optional[str] = None, reason: str = ""
) -> list[str]:
    """End every parent of the sweep: the comparison of its children (dflash.report.sweep: table, plots,
    best τ, description), the failed jobs, and the status (None: FINISHED when every job passed, else
    FAILED). -> the parents' run ids."""
    from dflash import tracking
    from dflash.report import console, sweep
    from dflash.report.pairs import RunIdentity

    parents = tracking.sweep_parents(uri, sweep_id)
    for parent in parents:
        kids = parent.children
        values = swept_values([k.overrides for k in kids])
        children = [
            sweep.Child.read(
                k.name,
                k.run_id,
                v,
                k.rows,
                k.params,
                RunIdentity(k.identity.target_identity, k.identity.dtype),
                k.prompt_lookup_tau,
            )
            for k, v in zip(kids, values)
        ]
        table = sweep.sweep_table(children) if children else []
        bad_jobs = sorted({int(r["job"]) for r in failed} | {k.job for k in kids if k.status != "FINISHED"})
        final = status or ("FAILED" if bad_jobs else "FINISHED")
        fails = [f"job {r['job']} ({r.get('label') or ' '.join(r['overrides'])}): {r['error']}" for r in failed]
        tags = {
            tracking.JOBS_TAG: f"{len(kids)} children, {len(bad_jobs)} failed",
            tracking.FAILED_JOBS_TAG: "; ".join(fails) or None,
        }
        if final != "FINISHED" and reason:
            tags[tracking.KILLED_TAG if final == "KILLED" else tracking.ERROR_TAG] = reason
        best = sweep.best(table)
        files = sweep.sweep_artifacts(children, title=parent.name) if children else {}
        note = console.sweep_markdown(parent.name, table, fails, final, reason)
        tracking.finish_parent(uri, parent.run_id, final, files, (best.run, best.run_id) if best else None, tags, note)
        print(
            f"\n{note}\nMLflow: sweep parent {parent.run_id} at {uri}"
        )  # the children side by side, on the console too
    return [p.run_id for p in parents]


def _sweep_callback_base():
    from hydra.experimental.callback import Callback

    return Callback


class SweepCallback(_sweep_callback_base()):
    """A `-m` sweep's life: a fresh sweep id and its MLflow parent at the start; at the end the parent
    gets the comparison of its children and ends FINISHED (every job passed) or FAILED (the failed
    jobs listed; the process then exits 1). Registered in dflash/conf/config.yaml (hydra.callbacks)."""

    def on_multirun_start(self, config, **kwargs) -> None:
        from omegaconf import OmegaConf

        global _ACTIVE
        try:
            check_schema(config)
            info = start_sweep(str(config.hydra.sweep.dir), sweep_name(list(config.hydra.overrides.task)))
            uri = str(config.tracking.uri) if config.tracking.enabled else None
            _ACTIVE = _ActiveSweep(info, uri)
            if uri is not None:
                from dflash import tracking

                target = OmegaConf.select(config, "target.name", default="target")
                tracking.open_parent(
                    uri,
                    experiment_name(config.tracking, target),
                    tracking.SweepFamily(info.id, info.name, info.dir),
                    config.tracking.artifact_location,
                )
        except UserError as e:
            report_error(e)
            sys.exit(exit_code(e))

    def on_multirun_end(self, config, **kwargs) -> None:
        failed = _finish_sweep()
        if failed:
            jobs = "; ".join(f"job {r['job']} ({r['label']}): {r['error']}" for r in failed)
            print(f"{_prog()}: {len(failed)} job(s) of the sweep failed: {jobs}", file=sys.stderr)
            sys.exit(1)


def main(hydra_main: Callable[[], Any], schema: Optional[type] = None) -> None:
    """Run an entry point's @hydra.main function under the exit policy (its `if __name__ == "__main__":`);
    `schema`: the strict schema its overrides are checked against (default: the evaluation's)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    install_signal_handlers()
    try:
        check_overrides(sys.argv[1:], *([schema] if schema else []))
    except ConfigError as e:
        report_error(e)
        sys.exit(exit_code(e))
    try:
        hydra_main()
    except SystemExit as e:
        code, why = e.code, f"exit status {e.code}"
        if code == 1 and isinstance(e.__context__, (HydraException, OmegaConfBaseException)):
            code = 2  # Hydra printed why the config does not compose (an unknown key, group option, a bad value)
            why = f"a job's config does not compose: {str(e.__context__).strip().splitlines()[0]}"
        _finish_sweep("FAILED" if code else None, why)
        sys.exit(code)
    except (KeyboardInterrupt, Terminated) as e:
        name = "SIGTERM" if isinstance(e, Terminated) else "SIGINT"
        _finish_sweep("KILLED", f"{name}: interrupted")
        print(f"{_prog()}: interrupted ({name}); the run was ended KILLED", file=sys.stderr)
        sys.exit(exit_code(e))
    except (HydraException, OmegaConfBaseException) as e:  # HYDRA_FULL_ERROR=1: Hydra raised it as is
        traceback.print_exception(e)
        _finish_sweep("FAILED", f"config error: {e}")
        sys.exit(2)
    except BaseException as e:
        _finish_sweep("FAILED", f"{type(e).__name__}: {e}")
        raise
