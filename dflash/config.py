"""Typed config schemas (Hydra structured configs) and the Hydra glue.

`conf/` holds one folder per group (target, drafter, prompts, attention, device, references);
these dataclasses are their schemas, registered in Hydra's ConfigStore so a typo or a wrong
type in a YAML file or an override fails at compose time. This module and the entry points
are the only places that know Hydra; the rest of the package takes plain values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


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


@dataclass
class ReferencesConfig:
    source: str = "local"  # local | sglang | openai
    url: Optional[str] = None
    model: Optional[str] = None  # openai: the served model name
    batch_size: int = 16
    use_cache: bool = True


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


def to_container(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]


def to_object(cfg: Any) -> EvalConfig:
    """The composed Hydra config as the typed EvalConfig (resolved; a ??? left unset raises)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def hydra_context() -> dict[str, Any]:
    """Group choices and sweep identity of the running Hydra job (empty outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {"choices": {}, "sweep_dir": None, "job_num": None, "overrides": []}
    hc = HydraConfig.get()
    multirun = str(hc.mode) == "RunMode.MULTIRUN"
    return {
        "choices": {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra") and v is not None},
        "sweep_dir": str(hc.sweep.dir) if multirun else None,
        "job_num": hc.job.num if multirun else None,
        "overrides": list(hc.overrides.task),
    }


def _sweep_callback_base():
    from hydra.experimental.callback import Callback

    return Callback


class SweepCallback(_sweep_callback_base()):
    """Ends a sweep's MLflow parent run once every job of `-m` has run (see tracking.close_sweep)."""

    def on_multirun_end(self, config, **kwargs) -> None:
        from dflash import tracking

        if config.tracking.enabled:
            tracking.close_sweep(str(config.tracking.uri), str(config.hydra.sweep.dir))
