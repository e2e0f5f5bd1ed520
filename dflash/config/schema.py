"""Typed config schemas (Hydra structured configs): what a composed config may hold.

`dflash/conf/` holds one folder per group (target, drafter, prompts, attention, device, references);
these dataclasses are their schemas, registered in Hydra's ConfigStore so a typo or a wrong
type in a YAML file or an override fails at compose time. The schema is strict: a key it does
not name is refused, `+key=value` included (Hydra's `+` would otherwise add it, and it would be
silently ignored), with a message naming the nearest key. `to_object` turns a composed config into
the typed `EvalConfig` the pipeline takes. This module and dflash.cli.app (the entry points' Hydra
glue: job context, sweeps, exit policy) are the only places that know Hydra; the rest of the
package takes plain values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from dflash.config.steps import StepSelection
from dflash.util.errors import ConfigError


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


INIT_ARCHS = ("dflash", "dflash2")  # drafter=init's architectures (docs/family.md §8: dflash2)


@dataclass
class DrafterSchema:
    kind: str = MISSING  # training | hf | init
    name: Optional[str] = None  # run names are <name>@step_<N>; default: the run or folder name
    # kind=training: the run folder (step_<N>/, SpecForge's epoch_<e>_step_<s>/ or <run_id>-step<N>/: layouts.py)
    run_dir: Optional[str] = None
    # kind=training: null | latest | best | N | all | [N, M, ...] | A..B (either end open) | all or A..B /k (every
    # k-th): StepSelection
    step: Any = None
    # kind=training, SpecForge's unified layout (no config.json in a step): the drafter JSON the run was launched with
    config: Optional[str] = None
    path: Optional[str] = None  # kind=hf
    # only where a checkpoint lacks them:
    block_size: Optional[int] = None
    mask_token_id: Optional[int] = None
    target_layer_ids: Optional[list[int]] = None
    sliding_window: str = (
        "apply"  # apply: sliding_attention layers as SGLang serves them; ignore: as full attention (z-lab's sdpa loop)
    )
    # kind=init:
    num_layers: int = 1
    num_taps: Optional[int] = None  # null: the public rule, one tap per draft layer
    seed: int = 0
    arch: str = "dflash"  # INIT_ARCHS; dflash2: block convolutions and selector, random (not identity), sizes below
    conv_kernel_size: int = 2  # arch=dflash2: taps of the block convolutions (1..block_size)
    conv_group_size: int = 16  # arch=dflash2: channels sharing one dynamic coefficient (divides the hidden size)
    selector_rank: int = 256  # arch=dflash2
    selector_top_k: int = 16  # arch=dflash2
    window: Optional[int] = (
        None  # every layer sliding_attention with this window (public DFlash2 configs: 2048); null: full layers
    )
    is_causal: Optional[bool] = (
        None  # the config's is_causal (public DFlash2: false); null: causal exactly on sliding layers
    )

    def __post_init__(self) -> None:
        init_only = {
            k: v
            for k, v in (
                ("arch", self.arch != "dflash"),
                ("window", self.window is not None),
                ("is_causal", self.is_causal is not None),
            )
            if v
        }
        if init_only and self.kind not in ("init", "???"):
            raise ConfigError(
                f"drafter.{next(iter(init_only))} shapes drafter=init only; a checkpoint's config says what it is "
                f"(drafter={self.kind})"
            )
        if self.arch not in INIT_ARCHS and self.arch != "???":
            raise ConfigError(f"drafter.arch={self.arch!r}: use one of {', '.join(INIT_ARCHS)}")
        if self.window is not None and self.window < 1:
            raise ConfigError(
                f"drafter.window={self.window}: use a positive number of positions (or null: full-attention layers)"
            )
        if self.config is not None and (not isinstance(self.config, str) or not self.config.strip()):
            raise ConfigError(
                f"drafter.config={self.config!r}: use the path of the drafter JSON a SpecForge run was launched with"
            )
        if self.config is not None and self.kind not in ("training", "???"):
            raise ConfigError(
                f"drafter.config is the launch JSON of a SpecForge training run (drafter=training, drafter.run_dir); "
                f"drafter={self.kind} reads its config from its own folder"
            )
        if self.step != "???":
            sel = StepSelection.parse(self.step)
            if sel.many and self.kind not in ("training", "???"):
                raise ConfigError(
                    f"drafter.step={self.step!r} selects several steps of a training run: it needs drafter=training "
                    f"(drafter.run_dir), not drafter={self.kind}"
                )


@dataclass
class PromptsConfig:
    # builtin | jsonl | humaneval_complete | a benchmark (dflash/stages/prompts/benchmarks.py: gsm8k, mt_bench, ...)
    source: str = MISSING
    path: Optional[str] = (
        None  # jsonl: the file; a benchmark: its local copy (file or hub-shaped folder); null: data_dir, else the hub
    )
    data_dir: Optional[str] = (
        None  # a benchmark: a folder holding <name>/ (or <hub id>/) local copies, e.g. for a suite
    )
    num_prompts: Optional[int] = None
    selection: Optional[str] = (
        None  # a benchmark: shuffle (random.seed(seed), z-lab 2026-04) | hf_shuffle (z-lab 2026-01) | first
    )
    seed: int = 42  # a benchmark's selection seed
    subsets: Optional[list[str]] = None
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        if self.selection is not None and self.selection not in ("shuffle", "hf_shuffle", "first", "???"):
            raise ConfigError(
                f"prompts.selection={self.selection!r}: use shuffle, hf_shuffle or first (or null: the source's "
                f"default)"
            )
        if isinstance(self.max_new_tokens, int) and self.max_new_tokens < 2:
            raise ConfigError(
                f"prompts.max_new_tokens={self.max_new_tokens}: use 2 or more (the first new token comes from the "
                f"prefill; "
                "a verify step, which τ counts, needs at least one more)"
            )


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
            raise ConfigError(
                f"device.name={self.name!r} is not a device: use cpu, cuda, cuda:<index>, auto or mps "
                f"(device=cpu|cuda|auto)"
            )


@dataclass
# every references.* option, declared here only: dflash.stages.references.collect.ReferenceOptions adds their checks
class ReferencesConfig:
    source: str = "local"  # local | sglang | openai
    url: Optional[str] = None
    model: Optional[str] = None  # openai: the served model name
    batch_size: int = 16
    # local on CUDA: inductor before the engine's CUDA graph capture: auto | true | false (auto: from compile_min_steps)
    compile: str = "auto"
    # auto compiles when the engine runs at least this many decode steps (ceil(prompts / batch) x max_new_tokens)
    compile_min_steps: int = 10000
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
    # 0: greedy references; > 0: sampled under z-lab's convention (greedy drafts accepted where they equal the sample)
    temperature: float = 0.0
    top_p: float = 1.0  # nucleus cut at temperature > 0 (1: none)
    top_k: int = 0  # top-k cut at temperature > 0 (0: none)
    seed: int = 0  # sampled references: the noise of token p is keyed by (seed, prompt, p), whatever the batch


BATCH_TOKENS_CUDA = 16384  # features.batch_tokens=auto on CUDA


@dataclass
class FeaturesConfig:
    cache: bool = True  # reuse tapped states: on disk across runs, in memory across the jobs of a -m sweep
    max_cache_gb: float = 10.0  # disk cap of <cache_dir>/features; least recently used files go first
    memory_gb: float = 2.0  # in-process cap
    chunk_tokens: Optional[int] = (
        1024  # positions per target pass on long sequences (bounds activations); null: one pass
    )
    # padded positions per target pass over consecutive sequences; null: one sequence per pass; auto: `batch`
    batch_tokens: Any = "auto"

    def __post_init__(self) -> None:
        for name in ("chunk_tokens", "batch_tokens"):
            v = getattr(self, name)
            if (
                v is not None
                and v != "???"
                and (isinstance(v, bool) or not isinstance(v, int) or v < 1)
                and (name, v) != ("batch_tokens", "auto")
            ):
                what = {
                    "chunk_tokens": "tokens, or null for one pass",
                    "batch_tokens": "padded tokens per target pass, null for one sequence per pass, or auto (batched "
                    "on CUDA only)",
                }[name]
                raise ConfigError(f"features.{name}={v!r}: use a positive number of {what}")
        for name in ("max_cache_gb", "memory_gb"):
            v = getattr(self, name)
            if v != "???" and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                raise ConfigError(f"features.{name}={v!r}: use a size in GB >= 0")

    def batch(self, cuda: bool) -> int | None:
        """`batch_tokens` resolved, as measured (`dflash-bench --scale`: the steady feature pass both ways):
        auto
        batches on CUDA (one sequence per pass is bound by the host launching kernels, which batching divides by the
        batch)
        and runs one sequence per pass on a CPU (the padding is computed and no launch is saved:
        scripts/feature_batching.py)."""
        if self.batch_tokens == "auto":
            return BATCH_TOKENS_CUDA if cuda else None
        return self.batch_tokens


@dataclass
class ReplayConfig:
    """The replay's modes (docs/how-it-works.md, "Modes"). τ and every loop counter are exact in every mode and at
    every stride; the stride samples the teacher-forced statistics (with their SE over prompts). Why the default is 4:
    a teacher-forced anchor sends all B-1 slots through the drafter's LM head, a walked one only the slots up to its
    first rejected one, and per slot the head costs about as much as the drafter's pass or more (SmolLM2's 49k
    vocabulary: twice a four-layer drafter's arithmetic; Qwen3.6's 248k: three quarters of a five-layer one's), so
    the stride is the replay's largest lever after the mode; what it saves and what it costs in SE are measured in
    `dflash-bench`'s replay section (docs/results-full.md)."""

    anchors: str = (
        "auto"  # auto (see mode) | visited: only the anchors the loop visits (+ the tf ones) | all: every anchor
    )
    tf_stride: int = 4  # teacher-forced accuracy (and scores) at every tf_stride-th anchor; 1: every anchor (exact)
    context_gb: float = 1.0  # visited: the drafter's context keys/values held for one lockstep group of prompts
    # DSpark drafters with a confidence head: also walk verifying only the drafts before the first slot whose
    # confidence is below each t (DeepSpec's rule; docs/dspark.md)
    confidence_thresholds: list[float] = field(default_factory=lambda: [0.3, 0.5, 0.7, 0.9])
    # warn when the drafter read in the other slot convention reaches a τ this many paired SEs above the served one
    convention_z: float = 3.0

    def __post_init__(self) -> None:
        ts = self.confidence_thresholds
        if isinstance(ts, (list, tuple)) and any(
            isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 1 for t in ts
        ):
            raise ConfigError(
                f"replay.confidence_thresholds={list(ts)!r}: use probabilities in [0, 1] (e.g. [0.5, 0.9]; 0 verifies "
                "the whole block)"
            )
        if isinstance(self.convention_z, (int, float)) and self.convention_z <= 0:
            raise ConfigError(
                f"replay.convention_z={self.convention_z}: use a positive number of standard errors (e.g. 3)"
            )
        if self.anchors not in ("auto", "visited", "all", "???"):
            raise ConfigError(
                f"replay.anchors={self.anchors!r}: use auto (the measured default: all), visited (only the anchors "
                "the loop visits) or all (every anchor)"
            )
        if isinstance(self.tf_stride, int) and self.tf_stride < 1:
            raise ConfigError(
                f"replay.tf_stride={self.tf_stride}: use 1 (teacher-forced accuracy at every anchor) or more (every "
                f"s-th anchor)"
            )
        if isinstance(self.context_gb, (int, float)) and self.context_gb <= 0:
            raise ConfigError(f"replay.context_gb={self.context_gb}: use a positive size in GB (e.g. 1)")

    def mode(self) -> str:
        """`anchors` resolved: auto drafts every anchor (`all`), as measured (dflash-bench: its `replay` section on
        the CPU, `--scale qwen3_6_27b` on CUDA): `all` pays the LM head only for the slots a walk reads, so at a
        stride the lockstep of `visited` saves less than it costs, on a CPU as on CUDA."""
        return "all" if self.anchors == "auto" else self.anchors


@dataclass
class PromptLookupConfig:
    """The yardstick beside every τ: prompt lookup, vLLM's `ngram` speculator, replayed on the same references
    (dflash/stages/replay/prompt_lookup.py). min / max are vLLM's prompt_lookup_min / prompt_lookup_max (here its own
    defaults when neither is set); its num_speculative_tokens is the drafter's B - 1."""

    enabled: bool = True
    min: int = 5  # the shortest n-gram matched
    max: int = 5  # the longest n-gram matched (tried first)

    def __post_init__(self) -> None:
        if isinstance(self.min, int) and self.min < 1:
            raise ConfigError(f"prompt_lookup.min={self.min}: use 1 or more (tokens in the shortest n-gram matched)")
        if isinstance(self.min, int) and isinstance(self.max, int) and self.max < self.min:
            raise ConfigError(f"prompt_lookup.max={self.max} is below prompt_lookup.min={self.min}: use max >= min")


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: str = "sqlite:///mlflow.db"
    experiment: Optional[str] = None  # default: dflash/<target.name>
    artifact_location: Optional[str] = None  # default: ./mlruns/<experiment>


@dataclass
class WatchConfig:  # follow=true: how the run folder is watched (dflash/evaluation/series.py, dflash/runs/watch.py)
    poll_s: float = 10.0  # seconds between looks at drafter.run_dir
    settle_s: float = (
        5.0  # a complete-looking step folder is read once its files have not changed for this long (0: at once)
    )
    quiet_s: Optional[float] = (
        None  # end after this long without a new step; null: never (SIGTERM or last_step ends it)
    )
    last_step: Optional[int] = None  # end once this step (or a later one) is evaluated

    def __post_init__(self) -> None:
        for k in ("poll_s", "settle_s", "quiet_s"):
            v = getattr(self, k)
            if isinstance(v, (int, float)) and v < 0:
                raise ConfigError(f"watch.{k}={v}: use a number of seconds, 0 or more")


@dataclass
class TrainMetricsConfig:  # the trainer's own metrics, logged beside τ under train/ (dflash/runs/trainlog.py)
    # auto: <run_dir>/metrics.jsonl, else TensorBoard event files under run_dir (SpecForge: <run_dir>/runs), else none
    # | jsonl | tensorboard | mlflow | none
    source: str = "auto"
    path: Optional[str] = None  # jsonl: the file; tensorboard: the log folder; null: drafter.run_dir
    uri: Optional[str] = None  # mlflow: the trainer's tracking URI; null: tracking.uri
    # mlflow: the trainer's run ids or names, comma-separated (a name: every run of it alive while the run folder's
    # steps were saved); null: SpecForge's runs of the folder (unified: named after its run_id; legacy: its output_dir)
    run: Optional[str] = None
    keys: Optional[list[str]] = (
        None  # regular expressions (searched in each name); null: accuracy- and loss-like names (acc, loss)
    )
    accuracy_key: Optional[str] = (
        None  # the training accuracy the stall check reads; null: the shortest chosen name with acc in it
    )
    min_rise: float = (
        0.01  # the stall check: training accuracy rose at least this much while τ did not rise past its best by 2 SE
    )

    def __post_init__(self) -> None:
        if self.source not in ("auto", "jsonl", "tensorboard", "mlflow", "none", "???"):
            raise ConfigError(f"train_metrics.source={self.source!r}: use auto, jsonl, tensorboard, mlflow or none")
        for k in self.keys or []:
            try:
                re.compile(k)
            except re.error as e:
                raise ConfigError(f"train_metrics.keys: {k!r} is not a regular expression ({e})") from None


@dataclass
class EvalConfig:
    target: TargetConfig = MISSING
    drafter: DrafterSchema = MISSING
    prompts: PromptsConfig = MISSING
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    references: ReferencesConfig = field(default_factory=ReferencesConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    prompt_lookup: PromptLookupConfig = field(default_factory=PromptLookupConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    cache_dir: str = ".cache"
    seed: int = 0
    num_samples: int = 3  # sample generations printed and logged in full
    anchors_per_chunk: Optional[int] = (
        None  # anchors per drafter pass; null: 32 on CPU, on CUDA >= 256 by the drafter's size (drafts.auto_chunk)
    )
    leak_probe: bool = False  # also replay with the training-time leak (block sees its anchor's feature)
    scores: bool = False  # also the reference token's NLL and the drafter's confidence (~30% more replay on CPU)
    progress: bool = True  # stage lines and progress bars (dflash.util.progress); false: warnings only
    follow: bool = (
        False  # watch drafter.run_dir and evaluate each new step once it is complete (watch.*): a training run's parent
    )
    watch: WatchConfig = field(default_factory=WatchConfig)
    train_metrics: TrainMetricsConfig = field(default_factory=TrainMetricsConfig)

    def __post_init__(self) -> None:
        if self.follow is True and not isinstance(self.drafter, str) and self.drafter.kind not in ("training", "???"):
            raise ConfigError(
                f"follow=true watches a training run's folder: it needs drafter=training (drafter.run_dir), not "
                f"drafter={self.drafter.kind}"
            )

    @property
    def series(self) -> bool:
        """Whether this evaluates a training run step by step (several steps, or follow=true): one MLflow parent per
        training run."""
        return self.follow or StepSelection.parse(self.drafter.step).many


def experiment_name(tracking: Any, target_name: str) -> str:
    """The MLflow experiment of an evaluation: tracking.experiment, else dflash/<target>."""
    return tracking.experiment or f"dflash/{target_name}"
