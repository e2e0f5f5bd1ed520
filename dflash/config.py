"""Typed config schemas (Hydra structured configs) and the Hydra glue of the entry points.

`conf/` holds one folder per group (target, drafter, prompts, attention, device, references);
these dataclasses are their schemas, registered in Hydra's ConfigStore so a typo or a wrong
type in a YAML file or an override fails at compose time. The schema is strict: a key it does
not name is refused, `+key=value` included (Hydra's `+` would otherwise add it, and it would be
silently ignored), with a message naming the nearest key. This module and the entry points are
the only places that know Hydra; the rest of the package takes plain values.

The exit policy of a Hydra entry point (`main`, `run_job`), the same for every launcher:
- a user error (dflash.errors.UserError, a config that does not compose or names an unknown
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
import difflib
import json
import os
import re
import socket
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, get_type_hints

from omegaconf import MISSING

from dflash.compare import swept_values
from dflash.errors import ConfigError, Terminated, UserError, exit_code, install_signal_handlers, signals_deferred, verbose


@dataclass
class TemplateConfig:
    use_chat_template: bool = True
    enable_thinking: bool = False  # explicit: a mismatched thinking mode is the top cause of low τ
    system_prompt: Optional[str] = None


@dataclass
class TargetConfig:
    name: str = MISSING
    kind: str = MISSING  # gguf | hf | vlm_text
    path: str = MISSING  # file, folder, or pkg:<package> for a GGUF shipped by a package
    dtype: Optional[str] = None  # weights dtype; null: the device group's dtype
    max_context: Optional[int] = None  # tokens; defaults to the model's max_position_embeddings
    default_taps: Optional[list[int]] = None  # taps for drafter=init (else the public default)
    mask_token_id: Optional[int] = None  # mask id for drafter=init
    template: TemplateConfig = field(default_factory=TemplateConfig)


@dataclass
class DrafterSchema:
    kind: str = MISSING  # training | hf | init
    name: Optional[str] = None  # run names are <name>@step_<N>; default: the run or folder name
    run_dir: Optional[str] = None  # kind=training: <run_dir>/step_<N>/
    step: Optional[int] = None  # kind=training: None = latest
    path: Optional[str] = None  # kind=hf
    # only where a checkpoint lacks them:
    block_size: Optional[int] = None
    mask_token_id: Optional[int] = None
    target_layer_ids: Optional[list[int]] = None
    sliding_window: str = "apply"  # apply: sliding_attention layers as SGLang serves them; ignore: as full attention (z-lab's sdpa loop)
    # kind=init:
    num_layers: int = 1
    num_taps: Optional[int] = None  # null: the public rule, one tap per draft layer
    seed: int = 0


@dataclass
class PromptsConfig:
    source: str = MISSING  # builtin | jsonl | humaneval
    path: Optional[str] = None
    num_prompts: Optional[int] = None
    subsets: Optional[list[str]] = None
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, int) and self.max_new_tokens < 2:
            raise ConfigError(f"prompts.max_new_tokens={self.max_new_tokens}: use 2 or more (the first new token comes from the prefill; "
                              "a verify step, which τ counts, needs at least one more)")


@dataclass
class AttentionConfig:
    drafter: str = "sdpa"  # sdpa | eager | flex (CUDA only)
    target: str = "sdpa"  # transformers attn_implementation of the target


@dataclass
class DeviceConfig:
    name: str = "cpu"  # cpu | cuda | auto
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto (bf16 on cuda, fp32 on cpu)
    threads: Optional[int] = None  # CPU threads (torch.set_num_threads)
    device_map: Optional[Any] = None  # e.g. "auto": shard the target over the visible GPUs
    gpu_per_job: bool = False  # in a -m sweep, job i runs on GPU i % (visible GPUs)

    def __post_init__(self) -> None:
        if isinstance(self.name, str) and not re.fullmatch(r"cpu|auto|mps|cuda(:\d+)?|\?\?\?", self.name):
            raise ConfigError(f"device.name={self.name!r} is not a device: use cpu, cuda, cuda:<index>, auto or mps (device=cpu|cuda|auto)")


@dataclass
class ReferencesConfig:  # dflash.references.ReferenceOptions checks every field
    source: str = "local"  # local | sglang | openai
    url: Optional[str] = None
    model: Optional[str] = None  # openai: the served model name
    batch_size: int = 16
    compile: bool = True  # local on CUDA: inductor over the static-cache engine's step (seconds once; 1.7-1.9x HF static generate on an H200)
    use_cache: bool = True  # false: neither read nor write the reference cache
    refresh: bool = False  # regenerate every reference and overwrite its cache entry
    concurrency: int = 8  # server: requests in flight at once
    connect_timeout_s: float = 10.0  # server calls: connecting
    read_timeout_s: float = 300.0  # the longest the server may stay silent (a whole answer, unstreamed)
    deadline_s: float = 600.0  # one call in all, retries included; a slow trickle cannot pass it
    retries: int = 3  # on connection errors, resets and 5xx, with exponential back-off
    backoff_s: float = 1.0  # first back-off; doubles each retry
    probe_prompts: int = 0  # server: prompts also generated by the local target to measure agreement (0: off)
    probe_min_agreement: float = 0.9  # warn below this token agreement before the first divergence


@dataclass
class FeaturesConfig:
    cache: bool = True  # reuse tapped states: on disk across runs, in memory across the jobs of a -m sweep
    max_cache_gb: float = 10.0  # disk cap of <cache_dir>/features; least recently used files go first
    memory_gb: float = 2.0  # in-process cap
    chunk_tokens: Optional[int] = 1024  # positions per target pass on long sequences (bounds activations); null: one pass


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: str = "sqlite:///mlflow.db"
    experiment: Optional[str] = None  # default: dflash/<target.name>
    artifact_location: Optional[str] = None  # default: ./mlruns/<experiment>


@dataclass
class EvalConfig:
    target: TargetConfig = MISSING
    drafter: DrafterSchema = MISSING
    prompts: PromptsConfig = MISSING
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    references: ReferencesConfig = field(default_factory=ReferencesConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    cache_dir: str = ".cache"
    seed: int = 0
    num_samples: int = 3  # sample generations printed and logged in full
    anchors_per_chunk: Optional[int] = None  # anchors per drafter pass; null: 32 on CPU, 256 on CUDA
    leak_probe: bool = False  # also replay with the training-time leak (block sees its anchor's feature)
    scores: bool = False  # also the reference token's NLL and the drafter's confidence (~30% more replay on CPU)


def register() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="eval_schema", node=EvalConfig)


# --- the strict schema ---------------------------------------------------------------------------


def _dataclass_of(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp  # type: ignore[return-value]
    inner = [a for a in getattr(tp, "__args__", ()) if dataclasses.is_dataclass(a)]  # Optional[Schema]
    return inner[0] if inner else None


def unknown_keys(tree: dict[str, Any], schema: type, prefix: str = "") -> list[tuple[str, list[str]]]:
    """Keys of a composed config (a plain dict) that its schema does not name -> [(dotted key, the keys the schema has there)]."""
    hints, names = get_type_hints(schema), [f.name for f in dataclasses.fields(schema)]
    out = []
    for k, v in tree.items():
        if k not in names:
            out.append((prefix + k, names))
        elif isinstance(v, dict) and (sub := _dataclass_of(hints[k])) is not None:
            out += unknown_keys(v, sub, f"{prefix}{k}.")
    return out


def _unknown_key_error(bad: list[tuple[str, list[str]]]) -> ConfigError:
    key, names = bad[0]
    near = difflib.get_close_matches(key.rsplit(".", 1)[-1], names, n=1)
    where = key.rsplit(".", 1)[0] + "." if "." in key else ""
    hint = f" (did you mean {where}{near[0]}?)" if near else ""
    more = f"; also {', '.join(k for k, _ in bad[1:])}" if len(bad) > 1 else ""
    return ConfigError(f"{key} is not a config key{hint}{more}. The keys {'of ' + where[:-1] if where else 'at the top'} are: {', '.join(names)} "
                       "(schema: dflash/config.py; it is strict: `+key=value` cannot add a key either)")


def check_schema(cfg: Any, schema: type = EvalConfig) -> None:
    """Refuse keys the schema does not name (a `+key=value` typo would otherwise be carried and ignored)."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    tree.pop("hydra", None)  # type: ignore[union-attr]
    bad = unknown_keys(tree, schema)  # type: ignore[arg-type]
    if bad:
        raise _unknown_key_error(bad)


def check_overrides(args: list[str], schema: type = EvalConfig) -> None:
    """Refuse command-line overrides of keys the schema does not name, before Hydra composes anything
    (its own message would suggest `+key=...`, which the strict schema refuses too)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")])
    except Exception:
        return  # malformed: Hydra says what is wrong with it
    tree: dict[str, Any] = {}
    for o in parsed:
        parts = o.key_or_group.split(".")
        if parts[0] == "hydra" or "/" in o.key_or_group or o.package:
            continue
        node = tree
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}  # (a group choice `drafter=init` left None here)
            node = node[part]
        node.setdefault(parts[-1], None)
    bad = unknown_keys(tree, schema)
    if bad:
        raise _unknown_key_error(bad)


def to_container(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]


def to_object(cfg: Any, schema: type = EvalConfig) -> Any:
    """The composed Hydra config as its typed schema object (resolved, checked: an unknown key, a
    ??? left unset, an interpolation that fails or a value a schema's __post_init__ refuses raises
    ConfigError)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    check_schema(cfg, schema)
    try:
        return OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} has no value (??? in conf/): pass {e.full_key}=... on the command line") from e
    except OmegaConfBaseException as e:
        raise ConfigError(str(e).strip()) from e


def experiment_name(tracking: Any, target_name: str) -> str:
    """The MLflow experiment of an evaluation: tracking.experiment, else dflash/<target>."""
    return tracking.experiment or f"dflash/{target_name}"


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
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


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
    _write_json(_state_dir(sweep_dir) / "sweep.json", {**dataclasses.asdict(info), "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()})
    return info


def read_sweep(sweep_dir: str) -> Optional[SweepInfo]:
    path = _state_dir(sweep_dir) / "sweep.json"
    if not path.is_file():
        return None
    d = json.loads(path.read_text())
    return SweepInfo(d["id"], d["name"], d["dir"])


def record_job(sweep: SweepInfo, job: int, overrides: list[str], status: str, error: Optional[str] = None) -> None:
    _write_json(_state_dir(sweep.dir) / sweep.id / f"job_{job}.json", {"job": job, "overrides": overrides, "status": status, "error": error})


def job_records(sweep: SweepInfo) -> list[dict[str, Any]]:
    folder = _state_dir(sweep.dir) / sweep.id
    recs = [json.loads(p.read_text()) for p in folder.glob("job_*.json")] if folder.is_dir() else []
    return sorted(recs, key=lambda r: r["job"])


# --- the exit policy -----------------------------------------------------------------------------


def _prog() -> str:
    return Path(sys.argv[0]).name or "dflash"


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
        from dflash import tracking

        with signals_deferred():
            try:
                tracking.close_sweep(active.uri, active.info.id, failed, status, reason)
            except Exception as e:  # the sweep's outcome stands; say why its parent could not be closed
                print(f"{_prog()}: could not close the sweep's MLflow parent: {type(e).__name__}: {e}", file=sys.stderr)
    return failed


def _sweep_callback_base():
    from hydra.experimental.callback import Callback

    return Callback


class SweepCallback(_sweep_callback_base()):
    """A `-m` sweep's life: a fresh sweep id and its MLflow parent at the start; at the end the parent
    gets the comparison of its children and ends FINISHED (every job passed) or FAILED (the failed
    jobs listed; the process then exits 1). Registered in conf/config.yaml (hydra.callbacks)."""

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
                tracking.open_sweep(uri, experiment_name(config.tracking, target), info, config.tracking.artifact_location)
        except UserError as e:
            report_error(e)
            sys.exit(exit_code(e))

    def on_multirun_end(self, config, **kwargs) -> None:
        failed = _finish_sweep()
        if failed:
            jobs = "; ".join(f"job {r['job']} ({r['label']}): {r['error']}" for r in failed)
            print(f"{_prog()}: {len(failed)} job(s) of the sweep failed: {jobs}", file=sys.stderr)
            sys.exit(1)


def main(hydra_main: Callable[[], Any]) -> None:
    """Run an entry point's @hydra.main function under the exit policy (its `if __name__ == "__main__":`)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    install_signal_handlers()
    try:
        check_overrides(sys.argv[1:])
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
