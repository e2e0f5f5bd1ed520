"""Reference DFlash trainer, with the three training bugs of DFLASH.md §4 as switches (off by default).

    python -m dflash.train [target=...] [device=...] [key=value ...]      (conf/train.yaml)

Per step, for S sequences (prompt + the target's greedy response, data.py):
- one target forward gives every hidden state; the drafter's taps are `hidden_states[L + 1]`;
- N anchors per sequence are sampled at random inside the response (positions P .. T-2, P the
  first response position, as the inference loop's first anchor); each block is
  `[anchor, mask, ..., mask]` at positions p .. p+B-1;
- block n sees the context features of positions t < p_n and its own block, bidirectionally
  (drafter.visibility_mask on CPU, the same mask as a flex_attention BlockMask on CUDA);
- labels of slot k >= 1 are the target's greedy tokens at p + k (the regenerated sequence);
- loss: cross-entropy weighted by exp(-(k-1)/gamma), normalised by the weight sum over valid slots
  (slots past the sequence end and blocks padded in where a response is short carry no weight);
- AdamW, linear warm-up then cosine decay, gradient clipping, bf16 autocast on CUDA; optional
  Gaussian noise (relative to each position's RMS) on the fc inputs only.

The bugs (`bugs.*`), each reproducing its mechanism:
- `noisy_labels`: the augmentation noise is also added to the target's final hidden state before the
  logits whose argmax gives the labels: the drafter learns from corrupted labels;
- `final_layer`: fc is fed the target's final layer (it replaces the last tap) and the training mask
  lets a block see the feature at its anchor position (t <= p): at p that feature encodes token p+1,
  a shortcut inference never offers;
- `loss_dilution`: plain mean of the cross-entropy over every slot of every block: the anchor slot
  (label: the anchor itself), slots past the end and padded blocks included, no position weighting.

Several variants can train in lockstep (`variants=[fixed,noisy_labels,...]`): same data, same
anchors, same initial weights, one target forward per step; each has its own run folder, optimizer,
checkpoints, metrics file and MLflow run. Checkpoints: `<out_dir>/<variant>/step_<N>/checkpoint.pt`
(weights, optimizer, scheduler, step, drafter config; atomic) and, for `export_steps` and the last
step, weights-only bf16 HF folders `<export_dir>/<variant>/step_<N>/` (what checkpoints/ holds).
A run resumes from the latest checkpoint.pt of its folder; batches and anchors are a function of
(seed, step), so a resumed run sees what an uninterrupted one would have.

Throughput: `tokens_per_s` is a variant's labelled tokens over its own time (its step plus its
share of the target forward); `wall_s_per_step` is the wall clock of the whole loop per step.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

PROCESS_START = time.time()  # max_minutes counts from here: loading and data generation included
import torch.nn.functional as F
from torch import Tensor

from dflash.config import DeviceConfig, TargetConfig, TrackingConfig
from dflash.drafter import DFlashDrafter, DrafterConfig, build_target_layer_ids
from dflash.tracking import flatten

VARIANT_NAMES = ("fixed", "noisy_labels", "final_layer", "loss_dilution")


# --- config schema ----------------------------------------------------------------------------


@dataclass
class BugsConfig:
    noisy_labels: bool = False
    final_layer: bool = False
    loss_dilution: bool = False


@dataclass
class DrafterArch:
    num_layers: int = 1
    num_taps: int = 3
    intermediate_size: Optional[int] = None  # default: the target's
    block_size: int = 16
    mask_token_id: Optional[int] = None  # default: target.mask_token_id
    target_layer_ids: Optional[list[int]] = None  # default: build_target_layer_ids


@dataclass
class DataConfig:
    num_prompts: int = 8192
    prompts_path: Optional[str] = None  # a JSONL of prompts (python -m dflash.data writes one); else built here
    seed: int = 0
    arithmetic_fraction: float = 0.3
    max_new_tokens: int = 320
    max_prompt_tokens: int = 192
    min_response_tokens: int = 16
    gen_batch_size: int = 256
    shard_size: int = 1024


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
    noise_std: float = 0.0  # Gaussian noise on the fc inputs, relative to each position's RMS
    attention: str = "auto"  # auto (flex on CUDA, sdpa on CPU) | flex | sdpa | eager
    target_dtype: str = "float32"  # the target's weights (labels and taps); the drafter trains in fp32 + autocast
    amp: str = "auto"  # auto (bf16 on CUDA) | bf16 | none


@dataclass
class TrainConfig:
    target: Any = None  # dflash.config.TargetConfig
    device: Any = None  # dflash.config.DeviceConfig
    tracking: Any = None  # dflash.config.TrackingConfig
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


@dataclass
class TrainSchema(TrainConfig):
    target: TargetConfig = field(default_factory=TargetConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainSchema)


# --- variants ---------------------------------------------------------------------------------


@dataclass
class Variant:
    name: str
    bugs: BugsConfig


def resolve_variants(cfg: Any) -> list[Variant]:
    if cfg.variants:
        out = []
        for name in cfg.variants:
            parts = [p for p in str(name).split("+") if p != "fixed"]
            bad = [p for p in parts if p not in VARIANT_NAMES]
            if bad:
                raise ValueError(f"unknown variant {name!r}: use {', '.join(VARIANT_NAMES)} (joined by '+')")
            out.append(Variant(str(name), BugsConfig(**{p: True for p in parts})))
        return out
    b = BugsConfig(noisy_labels=bool(cfg.bugs.noisy_labels), final_layer=bool(cfg.bugs.final_layer), loss_dilution=bool(cfg.bugs.loss_dilution))
    on = [k for k in ("noisy_labels", "final_layer", "loss_dilution") if getattr(b, k)]
    return [Variant(cfg.name or ("+".join(on) if on else "fixed"), b)]


def variant_layer_ids(base: list[int], num_target_layers: int, bugs: BugsConfig) -> list[int]:
    """Bug 2 feeds fc the target's final layer in place of the last tap."""
    if not bugs.final_layer:
        return list(base)
    return list(base[:-1]) + [num_target_layers - 1]


# --- the pieces of a training step (small functions: tests exercise each) --------------------


def sample_anchors(prompt_lens: Tensor, seq_lens: Tensor, n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Anchors inside each response: positions P .. T-2 (slot 1 needs a label). -> anchors [S, n]
    (sorted; padded blocks sit at the first response position), block_valid [S, n]."""
    S = prompt_lens.shape[0]
    anchors = torch.zeros(S, n, dtype=torch.long)
    valid = torch.zeros(S, n, dtype=torch.bool)
    for s in range(S):
        lo, hi = int(prompt_lens[s]), int(seq_lens[s]) - 2
        count = hi - lo + 1
        if count <= 0:
            continue
        k = min(n, count)
        pick = lo + torch.randperm(count, generator=gen)[:k]
        anchors[s, :k] = pick.sort().values
        anchors[s, k:] = lo
        valid[s, :k] = True
    return anchors, valid


def block_labels(ids: Tensor, seq_lens: Tensor, anchors: Tensor, block_valid: Tensor, B: int) -> tuple[Tensor, Tensor]:
    """ids [S, L] (padded) -> labels [S, N, B] = ids[p + k] (slot 0: the anchor itself; past the
    padded length: the last id), slot_valid [S, N, B]: k >= 1, p + k < T, block valid."""
    S, L = ids.shape
    k = torch.arange(B, device=ids.device)
    pos = anchors[..., None] + k  # [S, N, B]
    labels = torch.gather(ids, 1, pos.clamp(max=L - 1).view(S, -1)).view_as(pos)
    valid = (k >= 1) & (pos < seq_lens[:, None, None]) & block_valid[..., None]
    return labels, valid


def noised(x: Tensor, std: float, gen: torch.Generator | None = None) -> Tensor:
    """x + N(0, std^2) scaled by each position's RMS (std 0: x itself)."""
    if std <= 0:
        return x
    rms = x.float().pow(2).mean(-1, keepdim=True).sqrt()
    eps = torch.randn(x.shape, generator=gen, device=x.device, dtype=torch.float32) if gen is not None else torch.randn_like(x, dtype=torch.float32)
    return (x.float() + std * rms * eps).to(x.dtype)


def logits_from_last(target: Any, h: Tensor, normed: bool) -> Tensor:
    """The target's logits from final-layer states h [..., H] (`normed`: already through the final norm)."""
    return target.lm_head(h if normed else target.model.model.norm(h))


def greedy_labels_from_hidden(target: Any, last_hidden: Tensor, anchors: Tensor, B: int, normed: bool) -> Tensor:
    """Labels of slot k = argmax of the target's logits at p + k - 1 computed from `last_hidden`
    (the final layer's state; `normed`: already through the final norm) -> [S, N, B] (slot 0: -1)."""
    S, L, H = last_hidden.shape
    k = torch.arange(1, B, device=anchors.device)
    pos = (anchors[..., None] + k - 1).clamp(max=L - 1)  # [S, N, B-1]
    h = torch.gather(last_hidden, 1, pos.reshape(S, -1, 1).expand(-1, -1, H))
    lab = logits_from_last(target, h, normed).argmax(-1).view(S, *pos.shape[1:])
    return torch.cat([torch.full_like(lab[..., :1], -1), lab], dim=-1)


@torch.no_grad()
def response_last_hidden(target: Any, seqs: list[Any]) -> Tensor:
    """Final-layer states at every position whose next token is a response token of seqs
    (dflash.data.Sequence) -> [N, H]."""
    from dflash.target import forward

    return torch.cat([forward(target, torch.tensor([s.ids], device=target.device), hidden_states=True).hidden_states[-1][0, s.prompt_len - 1 : -1] for s in seqs])


@torch.no_grad()
def label_flip_stats(target: Any, last_hidden: Tensor, std: float, normed: bool, draws: int = 32, gen: torch.Generator | None = None) -> dict[str, float]:
    """What bug 1 does to the labels at noise `std`, over positions last_hidden [N, H] (final layer):
    flip_rate, the share of noisy greedy labels that differ from the clean ones (what training logs);
    majority_flip_rate, the share of positions whose most frequent noisy label over `draws` draws is
    not the clean one: there, a drafter trained on these labels learns another token than the
    target's; majority_flip_rate_confident, the same over positions where the target's top-1
    probability is > 0.5, the positions a drafter can get right."""
    logits = logits_from_last(target, last_hidden, normed).float()  # [N, V]
    clean, confident = logits.argmax(-1), logits.softmax(-1).amax(-1) > 0.5  # [N]
    noisy = torch.stack([logits_from_last(target, noised(last_hidden, std, gen), normed).argmax(-1) for _ in range(draws)])  # [draws, N]
    majority = noisy.mode(0).values != clean  # [N]
    return {"flip_rate": float((noisy != clean).float().mean()), "majority_flip_rate": float(majority.float().mean()),
            "majority_flip_rate_confident": float(majority[confident].float().mean()) if bool(confident.any()) else float("nan"),
            "confident_share": float(confident.float().mean())}


def position_weights(B: int, gamma: float, device=None) -> Tensor:
    """[B]: 0 for the anchor slot, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(B, device=device, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


def dflash_loss(logits: Tensor, labels: Tensor, slot_valid: Tensor, gamma: float, dilution_bug: bool = False) -> Tensor:
    """logits [S, N, B, V], labels [S, N, B], slot_valid [S, N, B] -> scalar.

    Correct: sum_k w_k * CE over valid slots / sum of w_k over valid slots.
    Bug 3 (`dilution_bug`): mean CE over every slot (anchor slot, invalid slots, padded blocks)."""
    S, N, B, V = logits.shape
    ce = F.cross_entropy(logits.reshape(-1, V).float(), labels.reshape(-1).clamp(min=0), reduction="none").view(S, N, B)
    if dilution_bug:
        return ce.mean()
    w = position_weights(B, gamma, logits.device)[None, None] * slot_valid.float()
    return (ce * w).sum() / w.sum().clamp(min=1e-9)


def lr_at(step: int, total: int, warmup: int, base: float, min_ratio: float) -> float:
    """Linear warm-up to `base`, then cosine decay to base * min_ratio at `total` (step is 0-based)."""
    if warmup > 0 and step < warmup:
        return base * (step + 1) / warmup
    t = min(max(step - warmup, 0) / max(total - warmup, 1), 1.0)
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def resolve_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if name == "flex" and device.type != "cuda":
        raise ValueError("optim.attention=flex needs CUDA; use sdpa or eager on CPU")
    return name


# --- the trainer ------------------------------------------------------------------------------


class Batcher:
    """Deterministic batches: step -> (epoch permutation seeded by seed+epoch)[slice]."""

    def __init__(self, seqs: list, batch_size: int, max_len: int, pad_id: int, seed: int):
        self.seqs = [s for s in seqs if len(s.ids) - s.prompt_len >= 2]
        for s in self.seqs:
            if len(s.ids) > max_len:
                s.ids = s.ids[:max_len]
        self.seqs = [s for s in self.seqs if len(s.ids) - s.prompt_len >= 2]
        if not self.seqs:
            raise ValueError("no training sequence has a response of 2 tokens or more")
        self.bs, self.max_len, self.pad, self.seed = min(batch_size, len(self.seqs)), max_len, pad_id, seed
        self.per_epoch = len(self.seqs) // self.bs

    def get(self, step: int) -> tuple[Tensor, Tensor, Tensor]:
        epoch, i = divmod(step, self.per_epoch)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        idx = torch.randperm(len(self.seqs), generator=g)[i * self.bs : (i + 1) * self.bs].tolist()
        rows = [self.seqs[j] for j in idx]
        L = self.max_len  # fixed shape: flex_attention compiles once
        ids = torch.full((len(rows), L), self.pad, dtype=torch.long)
        for r, s in enumerate(rows):
            ids[r, : len(s.ids)] = torch.tensor(s.ids)
        return ids, torch.tensor([len(s.ids) for s in rows]), torch.tensor([s.prompt_len for s in rows])


@dataclass
class RunState:
    variant: Variant
    model: DFlashDrafter
    opt: torch.optim.Optimizer
    run_dir: Path
    step: int = 0
    metrics_file: Any = None
    tokens: int = 0
    time: float = 0.0


def make_drafter_config(cfg: Any, target: Any, layer_ids: list[int]) -> DrafterConfig:
    from dflash.checkpoint import init_config

    d = cfg.drafter
    mask = d.mask_token_id if d.mask_token_id is not None else cfg.target.mask_token_id
    if mask is None:
        raise ValueError("drafter.mask_token_id (or target.mask_token_id) must be set")
    c = init_config(target, int(d.num_layers), len(layer_ids), int(mask), int(d.block_size), layer_ids)
    if d.intermediate_size:
        c.intermediate_size = int(d.intermediate_size)
    return c


def _last_hidden_is_normed(target: Any) -> bool:
    """transformers' last hidden state is post-norm in the releases tested; check rather than assume."""
    ids = torch.tensor([[1, 2, 3, 4]], device=target.device)
    from dflash.target import forward

    with torch.no_grad():
        out = forward(target, ids, hidden_states=True)
        return bool(torch.allclose(target.lm_head(out.hidden_states[-1]).float(), out.logits.float(), atol=1e-3, rtol=1e-3))


def train_step_variant(
    rs: RunState,
    cfg: Any,
    target: Any,
    hidden: tuple[Tensor, ...],
    ids: Tensor,
    seq_lens: Tensor,
    anchors: Tensor,
    block_valid: Tensor,
    base_layer_ids: list[int],
    backend: str,
    amp: torch.dtype | None,
    noise_gen: torch.Generator | None,
    last_normed: bool,
    lr: float,
) -> dict[str, Any]:
    """One optimizer step of one variant on a shared batch -> metrics."""
    o = cfg.optim
    bugs = rs.variant.bugs
    model = rs.model
    B = model.cfg.block_size
    layer_ids = rs.model.cfg.target_layer_ids
    taps = torch.cat([hidden[L + 1] for L in layer_ids], dim=-1)
    taps = noised(taps, float(o.noise_std), noise_gen)  # augmentation: fc inputs only
    clean, slot_valid = block_labels(ids, seq_lens, anchors, block_valid, B)
    if bugs.noisy_labels:  # bug 1: the labels' logits come from noised hidden states
        noisy_last = noised(hidden[-1], float(o.noise_std), noise_gen)
        labels = greedy_labels_from_hidden(target, noisy_last, anchors, B, last_normed)
        labels = torch.where(torch.arange(B, device=ids.device) == 0, clean, labels)
    else:
        labels = clean
    block = torch.full_like(clean, model.cfg.mask_token_id)
    block[..., 0] = clean[..., 0]
    emb = target.embed(block)
    for g in rs.opt.param_groups:
        g["lr"] = lr
    with torch.autocast(device_type=ids.device.type, dtype=amp, enabled=amp is not None):
        h = model(taps.float() if amp is None else taps, emb.float() if amp is None else emb, anchors, backend=backend, see_anchor=bugs.final_layer)
        logits = target.lm_head(h.to(target.dtype) if amp is None else h)  # [S, N, B, V]
        loss = dflash_loss(logits, labels, slot_valid, float(o.gamma), dilution_bug=bugs.loss_dilution)
    rs.opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), float(o.grad_clip)) if o.grad_clip and o.grad_clip > 0 else torch.tensor(0.0)
    rs.opt.step()
    with torch.no_grad():
        pred = logits.argmax(-1)
        v = slot_valid.float()
        hit_own = ((pred == labels).float() * v).sum((0, 1))[1:]  # [B-1]
        hit_clean = ((pred == clean).float() * v).sum((0, 1))[1:]
        cnt = v.sum((0, 1))[1:]
        # teacher-forced exact prefix: slots 1..k all right (expected acceptance from training)
        ok = ((pred == labels) | ~slot_valid)[..., 1:].long().cumprod(-1).float() * v[..., 1:]
        prefix = ok.sum((0, 1))
        flips = (((labels != clean) & slot_valid).float().sum() / v.sum().clamp(min=1)) if bugs.noisy_labels else torch.tensor(0.0)
    return {
        "loss": float(loss.detach()), "grad_norm": float(gnorm), "hit_own": hit_own.cpu(), "hit_clean": hit_clean.cpu(),
        "count": cnt.cpu(), "prefix": prefix.cpu(), "label_flip_rate": float(flips),
        "tokens": int(slot_valid.sum()),
    }


def _summarise(acc: dict[str, Tensor], B: int) -> dict[str, float]:
    cnt = acc["count"].clamp(min=1)
    own = acc["hit_own"] / cnt
    clean = acc["hit_clean"] / cnt
    out = {"acc": float(acc["hit_own"].sum() / cnt.sum()), "acc_clean": float(acc["hit_clean"].sum() / cnt.sum())}
    prod, tau = 1.0, 1.0
    for k in range(1, B):
        out[f"acc_{k}"] = float(own[k - 1])
        out[f"acc_clean_{k}"] = float(clean[k - 1])
        prod *= float(own[k - 1])
        tau += prod
    out["tf_expected_tau"] = tau  # 1 + sum_k prod_{i<=k} acc_i (teacher-forced, own labels)
    out["tf_prefix_tau"] = 1.0 + float(acc["prefix"].sum() / acc["count"][0].clamp(min=1))
    return out


def save_checkpoint(rs: RunState, cfg: Any, extra_meta: dict[str, Any]) -> Path:
    from dflash.checkpoint import save_training_checkpoint

    path = rs.run_dir / f"step_{rs.step}" / "checkpoint.pt"
    save_training_checkpoint(path, rs.model, rs.opt, rs.step, {"variant": rs.variant.name, "bugs": vars(rs.variant.bugs), "train_meta": extra_meta})
    return path


def export(rs: RunState, cfg: Any) -> Path | None:
    from dflash.checkpoint import save_hf_folder

    if not cfg.export_dir:
        return None
    folder = Path(cfg.export_dir) / rs.variant.name / f"step_{rs.step}"
    save_hf_folder(rs.model, folder)
    return folder


def try_resume(rs: RunState, device: torch.device) -> None:
    from dflash.checkpoint import list_steps

    steps = [s for s in list_steps(rs.run_dir) if (rs.run_dir / f"step_{s}" / "checkpoint.pt").is_file()]
    if not steps:
        return
    obj = torch.load(rs.run_dir / f"step_{steps[-1]}" / "checkpoint.pt", map_location=device, weights_only=True)
    rs.model.load_state_dict(obj["model"])
    if obj.get("optimizer"):
        rs.opt.load_state_dict(obj["optimizer"])
    rs.step = int(obj["step"])
    meta = obj.get("train_meta") or {}
    rs.tokens, rs.time = int(meta.get("tokens", 0)), float(meta.get("time", 0.0))


class Tracker:
    """MLflow for one variant (optional), always mirrored to <run_dir>/metrics.jsonl."""

    def __init__(self, cfg: Any, rs: RunState, params: dict[str, Any], target_name: str):
        self.file = open(rs.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        (rs.run_dir / "params.json").write_text(json.dumps(params, indent=1, default=str))
        self.run = None
        t = cfg.tracking
        if t is not None and t.enabled:
            from dflash import tracking

            rid_file = rs.run_dir / "mlflow_run_id"
            run_id = rid_file.read_text().strip() if rid_file.is_file() else None  # resumed: keep logging to it
            tags = {"dflash.kind": "train", "dflash.variant": rs.variant.name, **{f"dflash.bug.{k}": str(v) for k, v in vars(rs.variant.bugs).items()}}
            self.run = tracking.Run(t.uri, t.experiment or f"dflash-train/{target_name}", rs.variant.name, getattr(t, "artifact_location", None), tags=tags, resume_id=run_id)
            if not run_id:
                rid_file.write_text(self.run.run_id)
                self.run.log_params(params)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.run is not None:
            self.run.log_metrics(metrics, step=step)

    def close(self) -> None:
        self.file.close()
        if self.run is not None:
            self.run.end()


def train(cfg: Any, target: Any = None, seqs: list | None = None, log=print) -> dict[str, dict[str, Any]]:
    """Train every variant of `cfg` in lockstep -> {variant: summary}. `target` / `seqs` may be
    given (tests); else loaded / generated from cfg."""
    from dflash.config import to_container

    torch.manual_seed(int(cfg.seed))
    dev_name = cfg.device.name
    if dev_name == "auto":
        dev_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev_name)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if cfg.device.threads:
        torch.set_num_threads(int(cfg.device.threads))
    o = cfg.optim
    if target is None:
        from dflash.target import load_target

        target = load_target(cfg.target.kind, cfg.target.path, o.target_dtype, str(device), "sdpa", cfg.cache_dir, cfg.target.max_context)
    template = dict(cfg.target.template) if cfg.target.template is not None else {}
    if seqs is None:
        from dflash.data import build_prompts, build_sequences
        from dflash.prompts import read_jsonl

        d = cfg.data
        prompts = read_jsonl(d.prompts_path)[: d.num_prompts] if d.prompts_path else build_prompts(int(d.num_prompts), int(d.seed), float(d.arithmetic_fraction))
        t0 = time.time()
        seqs = build_sequences(target, prompts, template, int(d.max_new_tokens), int(d.max_prompt_tokens), int(d.gen_batch_size), cfg.cache_dir, int(d.shard_size), int(d.min_response_tokens), log)
        log(f"data: {len(seqs)} sequences, {sum(len(s.ids) - s.prompt_len for s in seqs)} response tokens ({time.time() - t0:.1f}s)")
    backend = resolve_backend(o.attention, device)
    amp = {"auto": torch.bfloat16 if device.type == "cuda" else None, "bf16": torch.bfloat16, "none": None}[o.amp]
    variants = resolve_variants(cfg)
    base_ids = list(cfg.drafter.target_layer_ids) if cfg.drafter.target_layer_ids else (list(cfg.target.default_taps) if getattr(cfg.target, "default_taps", None) and int(cfg.drafter.num_taps) == len(cfg.target.default_taps) else build_target_layer_ids(target.num_layers, int(cfg.drafter.num_taps)))
    pad = target.tokenizer.pad_token_id if target.tokenizer is not None and target.tokenizer.pad_token_id is not None else target.eos_ids[0]
    batcher = Batcher(seqs, int(o.batch_size), int(o.max_seq_len), int(pad), int(cfg.seed))
    params = flatten(to_container(cfg) if not isinstance(cfg, dict) else cfg)
    last_normed = _last_hidden_is_normed(target)
    runs: list[RunState] = []
    for v in variants:
        dcfg = make_drafter_config(cfg, target, variant_layer_ids(base_ids, target.num_layers, v.bugs))
        model = DFlashDrafter(dcfg).init_weights(int(cfg.seed))
        tnorm = getattr(getattr(target.model, "model", None), "norm", None)
        if tnorm is not None and tuple(tnorm.weight.shape) == tuple(model.norm.weight.shape):
            with torch.no_grad():  # start the output norm at the target's final norm: its lm_head's scale
                model.norm.weight.copy_(tnorm.weight.float().cpu())
        model = model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=float(o.lr), betas=(float(o.beta1), float(o.beta2)), weight_decay=float(o.weight_decay), fused=device.type == "cuda")
        rs = RunState(v, model, opt, Path(cfg.out_dir) / v.name)
        rs.run_dir.mkdir(parents=True, exist_ok=True)
        try_resume(rs, device)
        runs.append(rs)
        log(f"variant {v.name}: bugs {vars(v.bugs)}, taps {dcfg.target_layer_ids}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, start at step {rs.step}")
    trackers = {rs.variant.name: Tracker(cfg, rs, {**params, "variant": rs.variant.name, **{f"bug.{k}": v for k, v in vars(rs.variant.bugs).items()}, "taps": json.dumps(rs.model.cfg.target_layer_ids), "num_sequences": len(batcher.seqs)}, cfg.target.name) for rs in runs}
    total = int(o.steps)
    start = min(rs.step for rs in runs)
    B = int(cfg.drafter.block_size)
    window = {rs.variant.name: None for rs in runs}
    wall_mark = {rs.variant.name: (time.time(), rs.step) for rs in runs}  # wall clock of the whole loop
    summaries: dict[str, dict[str, Any]] = {}
    try:
        for step in range(start, total):
            stop_now = cfg.stop_after is not None and step >= int(cfg.stop_after)
            if stop_now or (cfg.max_minutes and (time.time() - PROCESS_START) / 60 > float(cfg.max_minutes)):
                log(f"stopping at step {step} (stop_after / max_minutes): checkpointing, resume later")
                for rs in runs:
                    save_checkpoint(rs, cfg, {"tokens": rs.tokens, "time": rs.time})
                    export(rs, cfg)  # weights-only too: usable even if the run is never resumed
                break
            ids, seq_lens, prompt_lens = batcher.get(step)
            g = torch.Generator().manual_seed(int(cfg.seed) * 7919 + step)
            anchors, block_valid = sample_anchors(prompt_lens, seq_lens, int(o.blocks_per_seq), g)
            ids, seq_lens, anchors, block_valid = ids.to(device), seq_lens.to(device), anchors.to(device), block_valid.to(device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.time()
            from dflash.target import forward

            with torch.no_grad():
                attn = (torch.arange(ids.shape[1], device=device)[None] < seq_lens[:, None]).long()
                hidden = forward(target, ids, attention_mask=attn, hidden_states=True).hidden_states
            if device.type == "cuda":
                torch.cuda.synchronize()  # else the forward's GPU time lands outside every timer
            t_target = time.time() - t0
            lr = lr_at(step, total, int(o.warmup_steps), float(o.lr), float(o.min_lr_ratio))
            for rs in runs:
                if rs.step > step:
                    continue  # resumed further than the others
                ngen = torch.Generator(device=device).manual_seed(int(cfg.seed) * 104729 + step) if o.noise_std > 0 else None
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t1 = time.time()
                m = train_step_variant(rs, cfg, target, hidden, ids, seq_lens, anchors, block_valid, base_ids, backend, amp, ngen, last_normed, lr)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.time() - t1 + t_target / len(runs)
                rs.step, rs.tokens, rs.time = step + 1, rs.tokens + m["tokens"], rs.time + dt
                w = window[rs.variant.name]
                if w is None:
                    w = window[rs.variant.name] = {"hit_own": 0, "hit_clean": 0, "count": 0, "prefix": 0, "loss": 0.0, "n": 0, "tokens": 0, "time": 0.0, "flip": 0.0}
                for k in ("hit_own", "hit_clean", "count", "prefix"):
                    w[k] = w[k] + m[k]
                w["loss"] += m["loss"]; w["n"] += 1; w["tokens"] += m["tokens"]; w["time"] += dt; w["flip"] += m["label_flip_rate"]
                tr = trackers[rs.variant.name]
                if rs.step % int(cfg.log_every) == 0 or rs.step == total:
                    tr.log(rs.step, {"loss": m["loss"], "lr": lr, "grad_norm": m["grad_norm"], "tokens_per_s": w["tokens"] / max(w["time"], 1e-9)})
                if rs.step % int(cfg.metrics_every) == 0 or rs.step == total:
                    s = _summarise(w, B)
                    s.update(loss_avg=w["loss"] / w["n"], tokens_per_s=w["tokens"] / max(w["time"], 1e-9), wall_time_s=rs.time, train_tokens=rs.tokens)
                    t_mark, s_mark = wall_mark[rs.variant.name]
                    s["wall_s_per_step"] = (time.time() - t_mark) / max(rs.step - s_mark, 1)  # all variants, data and logging included
                    wall_mark[rs.variant.name] = (time.time(), rs.step)
                    if rs.variant.bugs.noisy_labels:
                        s["label_flip_rate"] = w["flip"] / w["n"]
                    tr.log(rs.step, s)
                    summaries[rs.variant.name] = {"step": rs.step, **s}
                    log(f"[{rs.variant.name}] step {rs.step}/{total} loss {s['loss_avg']:.3f} acc {s['acc']:.3f} acc_1 {s['acc_1']:.3f} tf_tau {s['tf_expected_tau']:.2f} lr {lr:.2e} {s['tokens_per_s']:.0f} tok/s {s['wall_s_per_step'] * 1e3:.0f} ms/step wall")
                    window[rs.variant.name] = None
                if rs.step % int(cfg.save_every) == 0 or rs.step == total or rs.step in set(cfg.export_steps or []):
                    save_checkpoint(rs, cfg, {"tokens": rs.tokens, "time": rs.time})
                    if rs.step in set(cfg.export_steps or []) or rs.step == total:
                        export(rs, cfg)
    finally:
        for t in trackers.values():
            t.close()
    for rs in runs:
        summ = summaries.get(rs.variant.name, {"step": rs.step})
        summ.update(wall_time_s=rs.time, train_tokens=rs.tokens, tokens_per_s=rs.tokens / max(rs.time, 1e-9), taps=rs.model.cfg.target_layer_ids, bugs=vars(rs.variant.bugs))
        summaries[rs.variant.name] = summ
        (rs.run_dir / "summary.json").write_text(json.dumps(summ, indent=2))
    return summaries


def import_metrics(run_dir: str | Path, uri: str = "sqlite:///mlflow.db", experiment: str | None = None, target_name: str = "smollm2_135m") -> str:
    """Log a run's metrics.jsonl (written where MLflow was off, e.g. on the GPU machine) to MLflow."""
    from dflash import tracking

    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    tags = {"dflash.kind": "train", "dflash.variant": run_dir.name, "dflash.imported_from": str(run_dir / "metrics.jsonl"),
            **{f"dflash.bug.{k}": str(v) for k, v in (summary.get("bugs") or {}).items()}}
    with tracking.Run(uri, experiment or f"dflash-train/{target_name}", run_dir.name, tags=tags) as run:
        if (run_dir / "params.json").is_file():
            run.log_params(json.loads((run_dir / "params.json").read_text()))
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            step = int(row.pop("step"))
            run.log_metrics({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)
        return run.run_id


def _hydra_main() -> None:
    import hydra

    register()

    @hydra.main(version_base="1.3", config_path="../conf", config_name="train")
    def main(cfg) -> None:
        out = train(cfg)
        print(json.dumps({k: {kk: vv for kk, vv in v.items() if not kk.startswith(("acc_clean_",))} for k, v in out.items()}, indent=1))

    main()


if __name__ == "__main__":
    _hydra_main()
