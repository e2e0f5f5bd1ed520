"""The trainer's config schema (dflash/conf/train.yaml), registered with Hydra as `train_schema`.

`TrainConfig` is what `train()` reads (tests build it with OmegaConf.structured); `TrainSchema`
types the shared groups (target, device, tracking) with dflash.config.schema's schemas, so a typo or a
wrong type in dflash/conf/train.yaml or an override fails at compose time. `check` names the field of any
value the schema's types cannot refuse (an unknown backend, a non-positive size). This module and
`__main__.py` are the only ones of the trainer that know Hydra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dflash.config.schema import DeviceConfig, TargetConfig, TrackingConfig
from dflash.util.errors import ConfigError


@dataclass
class BugsConfig:
    noisy_labels: bool = False  # bug 1: the augmentation noise also reaches the labels' logits
    final_layer: bool = False  # bug 2: fc fed the target's final layer; a block sees its anchor's feature
    loss_dilution: bool = False  # bug 3: plain mean CE over every slot, no position weights


@dataclass
class DrafterArch:
    # dflash | dflash2 (docs/family.md §8: block convolutions + candidate selector, as SpecForge trains it) | dspark
    # (docs/dspark.md: the anchor convention, gamma = block_size rows each a proposal, a Markov and a confidence head)
    arch: str = "dflash"
    conv_kernel_size: int = 2  # dflash2, dspark: taps of the block convolutions (1..block_size; dspark: 0 = none)
    conv_group_size: int = 16  # dflash2, dspark: channels sharing one dynamic coefficient (divides the hidden size)
    selector_rank: int = 256  # dflash2: the selector's rank
    selector_top_k: int = 16  # dflash2: the unary candidates the selector chooses from
    markov_rank: int = 32  # dspark: the Markov head's rank (markov_w1 [V, r], markov_w2 [V, r])
    markov_head_type: str = "vanilla"  # dspark: vanilla | gated | rnn
    confidence_head: bool = True  # dspark: train (and export) the confidence head
    confidence_with_markov: bool = True  # dspark: the confidence head reads [h ; markov_w1[prev]] (else h alone)
    num_layers: int = 1
    num_taps: int = 3
    intermediate_size: Optional[int] = None  # default: the target's
    block_size: int = 16
    mask_token_id: Optional[int] = None  # default: target.mask_token_id
    target_layer_ids: Optional[list[int]] = None  # default: target.default_taps, else the public spread


@dataclass
class DataConfig:
    num_prompts: int = 8192
    prompts_path: Optional[str] = (
        None  # a JSONL of prompts (python -m dflash.train.prompts writes one); else built here
    )
    prompt_offset: int = (
        0  # prompts_path: skip this many of its prompts (a continued run on prompts an earlier one did not see)
    )
    seed: int = 0
    arithmetic_fraction: float = 0.3
    max_new_tokens: int = 320
    max_prompt_tokens: int = 192
    min_response_tokens: int = 16
    gen_batch_size: int = 256
    shard_size: int = 1024
    max_gen_minutes: Optional[float] = (
        None  # stop regenerating new shards this long after the process start; train on what exists
    )
    chat_prompt_tokens: Optional[int] = (
        448  # a multi-turn chat's later turn: its prompt (earlier answers included) at most this long
    )


@dataclass
class OptimConfig:
    steps: int = 2000
    batch_size: int = 32  # sequences per step
    blocks_per_seq: int = 32  # anchors sampled per sequence
    max_seq_len: int = 512
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    gamma: float = 7.0
    selector_loss_alpha: float = (
        1.0  # drafter.arch=dflash2: weight of the selector's CE over the unary top-k (SpecForge's)
    )
    # drafter.arch=dspark: the weights of its three terms (SpecForge's and DeepSpec's defaults), each over the rows'
    # weights exp(-j/gamma): CE of base + Markov bias on the label, the L1 distance between the drafter's and the
    # target's distributions, the confidence head's BCE toward 1 - TV (detached)
    ce_loss_alpha: float = 0.1
    l1_loss_alpha: float = 0.9
    confidence_loss_alpha: float = 1.0
    noise_std: float = 0.0  # Gaussian noise on the fc inputs, relative to each position's RMS
    attention: str = "auto"  # auto (flex on CUDA, sdpa on CPU) | flex | sdpa | eager
    target_dtype: str = "float32"  # the target's weights (labels and taps); the drafter trains in fp32 + autocast
    amp: str = "auto"  # auto (bf16 on CUDA) | bf16 | none


@dataclass
class TrainConfig:
    target: Any = None  # dflash.config.schema.TargetConfig
    device: Any = None  # dflash.config.schema.DeviceConfig
    tracking: Any = None  # dflash.config.schema.TrackingConfig
    drafter: DrafterArch = field(default_factory=DrafterArch)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    bugs: BugsConfig = field(default_factory=BugsConfig)
    variants: Optional[list[str]] = None  # lockstep variants by name; None: one run with `bugs`
    name: Optional[str] = None  # single-run name; default fixed, or the bug names joined by '+'
    out_dir: str = "outputs/train"
    export_dir: Optional[str] = None  # weights-only bf16 HF folders (checkpoints/)
    export_steps: list[int] = field(default_factory=list)
    save_every: int = 500
    log_every: int = 10
    metrics_every: int = 50  # per-position accuracy to MLflow / metrics.jsonl
    cache_dir: str = ".cache"
    seed: int = 0
    max_minutes: Optional[float] = None  # stop (and checkpoint) once the process has run this long; resume later
    stop_after: Optional[int] = None  # stop (and checkpoint) after this step; the schedule keeps optim.steps
    # warm start: a variant with no checkpoint starts from <init_from>/<variant>/step_<N>/ (an export, the latest N),
    # new optimizer and schedule
    init_from: Optional[str] = None
    # with init_from: every variant starts from <init_from>/<init_variant>/ instead (one export for all: bugs that enter
    # a run midway)
    init_variant: Optional[str] = None


@dataclass
class TrainSchema(TrainConfig):
    target: TargetConfig = field(default_factory=TargetConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainSchema)


ATTENTION = ("auto", "flex", "sdpa", "eager")
AMP = ("auto", "bf16", "none")
ARCHS = ("dflash", "dflash2", "dspark")
MARKOV_TYPES = ("vanilla", "gated", "rnn")  # dflash.models.drafter.dspark_config's, named here for the schema's check


def check(cfg: Any) -> None:
    """Raise ConfigError naming the first field whose value cannot work."""
    o, d = cfg.optim, cfg.drafter
    if o.attention not in ATTENTION:
        raise ConfigError(f"optim.attention={o.attention!r}: use one of {', '.join(ATTENTION)}")
    if o.amp not in AMP:
        raise ConfigError(f"optim.amp={o.amp!r}: use one of {', '.join(AMP)}")
    for name, value, low in (
        ("optim.steps", o.steps, 1),
        ("optim.batch_size", o.batch_size, 1),
        ("optim.blocks_per_seq", o.blocks_per_seq, 1),
        ("optim.max_seq_len", o.max_seq_len, 2),
        ("drafter.block_size", d.block_size, 2),
        ("drafter.num_layers", d.num_layers, 1),
        ("save_every", cfg.save_every, 1),
        ("log_every", cfg.log_every, 1),
        ("metrics_every", cfg.metrics_every, 1),
        ("data.prompt_offset", cfg.data.prompt_offset, 0),
    ):
        if int(value) < low:
            raise ConfigError(f"{name}={value}: must be >= {low}")
    if d.arch not in ARCHS:
        raise ConfigError(f"drafter.arch={d.arch!r}: use one of {', '.join(ARCHS)}")
    for name in ("selector_loss_alpha", "ce_loss_alpha", "l1_loss_alpha", "confidence_loss_alpha"):
        if float(getattr(o, name)) < 0:
            raise ConfigError(f"optim.{name}={getattr(o, name)}: must be >= 0")
    if d.arch == "dspark" or any("dspark" in str(n).split("-")[1:] for n in cfg.variants or []):
        check_dspark(d, o)
    if float(o.noise_std) < 0:
        raise ConfigError(f"optim.noise_std={o.noise_std}: must be >= 0 (0: no augmentation noise)")
    if cfg.init_variant and not cfg.init_from:
        raise ConfigError(
            f"init_variant={cfg.init_variant}: it names a variant's exports under init_from; set init_from=<an earlier "
            f"run's "
            "export_dir> too, or drop init_variant"
        )


def check_dspark(d: Any, o: Any) -> None:
    """The DSpark keys (drafter.markov_*, drafter.confidence_*, optim.*_loss_alpha) of a run that trains DSpark
    (drafter.arch=dspark, or a variant's `-dspark` suffix)."""
    if d.markov_head_type not in MARKOV_TYPES:
        raise ConfigError(f"drafter.markov_head_type={d.markov_head_type!r}: use one of {', '.join(MARKOV_TYPES)}")
    if int(d.markov_rank) < 1:
        raise ConfigError(
            f"drafter.markov_rank={d.markov_rank}: must be >= 1 (a DSpark drafter needs its Markov head; SGLang "
            "refuses markov_rank 0)"
        )
    if int(d.conv_kernel_size) < 0:
        raise ConfigError(f"drafter.conv_kernel_size={d.conv_kernel_size}: must be >= 0 (dspark: 0 = no convolutions)")
    if float(o.ce_loss_alpha) + float(o.l1_loss_alpha) <= 0:
        raise ConfigError(
            f"optim.ce_loss_alpha={o.ce_loss_alpha} and optim.l1_loss_alpha={o.l1_loss_alpha}: a DSpark drafter needs "
            "one of them > 0 (else nothing trains its drafts)"
        )
    if bool(d.confidence_head) and float(o.confidence_loss_alpha) <= 0:
        raise ConfigError(
            f"drafter.confidence_head=true with optim.confidence_loss_alpha={o.confidence_loss_alpha}: the head would "
            "ship untrained; set optim.confidence_loss_alpha > 0, or drafter.confidence_head=false"
        )
