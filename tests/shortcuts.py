"""One-call shortcuts over the pipeline's pieces, for tests only (dflash itself never calls them).

The pipeline works in groups and phases (read, fit, build a drafter; stream features; replay groups
of prompts); a test usually wants one thing at once: a drafter loaded in one call, every prompt's
features as a list, one prompt's replay, the proposals at every anchor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from dflash.models.drafter.checkpoint import LoadedDrafter, build_drafter, fit_drafter, read_drafter
from dflash.models.drafter.model import DFlashDrafter
from dflash.models.target.model import Target
from dflash.stages.features import Features, FeatureStats, iter_features
from dflash.stages.metrics import Counters
from dflash.stages.replay.loop import Block, ReplayOptions, ReplaySeq, draft_anchors, prepare, replay_group


def load_drafter(
    target: Any,
    kind: str,
    name: str,
    run_dir: str | None = None,
    step: int | None = None,
    path: str | None = None,
    overrides: dict[str, Any] | None = None,
    init: dict[str, Any] | None = None,
    sliding_window: str = "apply",
) -> LoadedDrafter:
    """dflash.models.drafter.checkpoint's three phases at once: read, fit to the target, build."""
    src = read_drafter(kind, name, run_dir=run_dir, step=step, path=path, overrides=overrides, init=init)
    return build_drafter(fit_drafter(src, target), sliding_window)


def get_features(
    target: Target,
    seqs: Sequence[Sequence[int]],
    layer_sets: Sequence[Sequence[int]],
    cache_dir: str | Path = ".cache",
    **kw: Any,
) -> tuple[list[Features], FeatureStats]:
    """iter_features, all at once: -> (features per sequence, stats)."""
    stats = FeatureStats()
    return list(iter_features(target, seqs, layer_sets, cache_dir, stats=stats, **kw)), stats


def draft_every_anchor(
    drafter: DFlashDrafter,
    target: Target,
    seq: Tensor,
    taps: Tensor,
    first_anchor: int,
    backend: str = "sdpa",
    anchors_per_chunk: int = 32,
    see_anchor: bool = False,
    scores: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """`draft_anchors` at every anchor first_anchor .. T-2 of seq [T] (row i for the anchor first_anchor + i)
    -> proposals, nll, conf."""
    s = ReplaySeq(
        seq, first_anchor, drafter.context_kv(taps[None].to(drafter.fc.weight.device, drafter.fc.weight.dtype))
    )
    opt = ReplayOptions(chunk=anchors_per_chunk, backend=backend, scores=scores, see_anchor=see_anchor)
    d = draft_anchors(drafter, target, s, torch.arange(first_anchor, s.T - 1, device=seq.device), opt)
    return d.tokens, d.nll, d.conf


def evaluate_sequence(
    drafter: DFlashDrafter,
    target: Target,
    prompt_ids: list[int],
    completion_ids: list[int],
    taps: Tensor,
    backend: str = "sdpa",
    anchors_per_chunk: int = 32,
    see_anchor: bool = False,
    scores: bool = False,
    anchors: str = "all",
    tf_stride: int = 1,
) -> tuple[Counters, list[Block]]:
    """One prompt's replay in either mode (the pipeline replays groups of prompts: `replay_group`)."""
    opt = ReplayOptions(anchors, tf_stride, anchors_per_chunk, backend, scores, see_anchor)
    return replay_group(drafter, target, [prepare(drafter, target, prompt_ids, completion_ids, taps)], opt)[0]
