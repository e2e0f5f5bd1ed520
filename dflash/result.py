"""The typed result of an evaluation: the contract between the pipeline (dflash/evaluation/pipeline.py), which returns
it, and the report and tracking, which read it (as lm-eval's results are).

`PromptResult` (one prompt: its rendered ids, reference, counters, the replay's verify steps),
`RunInfo` (what was evaluated, as resolved), `EvalResult` (metrics, curves, per-prompt results, summed
counters, timings, the target's tokenizer for the report's samples); `per_prompt_row` flattens a prompt's counters into
the typed row
(`dflash.stages.metrics.PromptRow`, with digests of its prompt and reference ids) that `per_prompt.json`
holds and dflash.report.pairs pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash.stages.metrics import (
    ConventionCheck,
    Counters,
    DSparkSummary,
    PromptRow,
    commit_share,
    ids_digest,
    position_table,
    scored,
)
from dflash.stages.prompts.sets import Prompt
from dflash.stages.references.collect import ReferenceStats
from dflash.stages.references.served import served_histogram
from dflash.stages.replay.loop import Block
from dflash.stages.replay.prompt_lookup import PromptLookup


@dataclass
class PromptResult:
    prompt: Prompt
    prompt_ids: list[int]  # rendered through the chat template
    reference: list[int]  # the target's greedy completion
    counters: Counters
    blocks: list[Block]  # every verify step of the replay
    leak: Counters | None = None  # leak_probe=true: the replay with the anchor's own feature visible


@dataclass
class RunInfo:
    """What was evaluated, as resolved (not as configured)."""

    run_name: str
    drafter_name: str
    drafter_step: int | None
    checkpoint_path: str | None
    checkpoint_sha256: str | None
    device: str
    dtype: str
    target_identity: str
    target_source: str
    block_size: int  # tokens per verify step, the anchor and its drafts (DFlash: its block size; DSpark: gamma + 1)
    target_layer_ids: list[int]
    mask_token_id: int
    stop_ids: list[int]
    prompt_ids: list[str]  # the selected prompts, in order
    references: ReferenceStats
    drafter_config: dict[str, Any] = field(default_factory=dict)  # drafter_config.effective_config: what was evaluated
    linear_attention_kernel: str | None = (
        None  # hybrid targets: the Gated DeltaNet layers' code (models.kernels), None for others
    )
    replay_anchors: str = (
        "all"  # replay.anchors: which anchors were drafted (the τ counters are the same in every mode)
    )
    tf_stride: int = 1  # replay.tf_stride: teacher-forced statistics at every tf_stride-th anchor
    prompt_format: str = (
        ""  # how prompts were rendered: chat template or not, thinking mode, system prompt (the summary prints it)
    )
    # a training run's step: its layout, what its step number counts, epoch, run id (dflash.models.drafter.layouts)
    checkpoint_origin: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalResult:
    metrics: dict[str, float | None]  # MLflow names (dflash.stages.metrics.summarize); None: undefined, not logged
    curves: dict[str, list[float]]  # per-position series, index k-1 for slot k
    prompts: list[PromptResult]
    total: Counters  # summed over prompts
    timings: dict[str, float]
    info: RunInfo
    warnings: list[str] = field(default_factory=list)
    tokenizer: Any = None  # the target's: what the report decodes samples with (dflash.report.samples.samples_of)
    run_id: str | None = None  # the MLflow run it was logged to (dflash.evaluate(log=True))
    prompt_lookup: PromptLookup | None = (
        None  # the n-gram yardstick on the same references (None: prompt_lookup.enabled=false)
    )
    dspark: DSparkSummary | None = None  # DSpark drafters: Markov gain, confidence thresholds, calibration
    convention: ConventionCheck | None = None  # the other slot convention's τ, from the same drafter passes

    def commit_share(self) -> list[float | None]:
        """Per c = 1..B: the share of verify steps that committed c tokens (index c-1)."""
        return commit_share(self.total)

    def served_commit_share(self) -> list[float | None]:
        """The server's own histogram as the same shares ([] when the references came with none)."""
        return served_histogram(list(self.info.references.served.values()))

    def position_table(self) -> list[dict[str, Any]]:
        """One row per draft slot: every per-slot rate and the counts behind it."""
        return position_table(self.total)


def per_prompt_row(r: PromptResult) -> PromptRow:
    """The per-prompt counters as one row (per_prompt.json holds its `to_dict`; what dflash.report.pairs pairs)."""
    c = r.counters
    return PromptRow(
        id=r.prompt.id,
        subset=r.prompt.subset,
        prompt_tokens=len(r.prompt_ids),
        new_tokens=c.new_tokens,
        steps=c.steps,
        committed=c.committed,
        accepted_at_pos=c.accepted_at_pos,
        tf_correct=c.tf_correct,
        tf_total=c.tf_total,
        tf_nll=sum(c.tf_nll) if scored(c) else None,
        prompt_digest=ids_digest(r.prompt_ids),
        reference_digest=ids_digest(r.reference),
        **(
            {
                "unary_steps": c.unary_steps,
                "unary_committed": c.unary_committed,
                "tf_unary_correct": c.tf_unary_correct,
                "tf_topk_hit": c.tf_topk_hit if c.selector else None,
            }
            if c.selector or c.markov
            else {}
        ),
        **({"other_steps": c.other_steps, "other_committed": c.other_committed} if c.other_width else {}),
        **(
            {
                "thresholds": c.thresholds,
                "thr_steps": c.thr_steps,
                "thr_committed": c.thr_committed,
                "cal_sq": sum(c.cal_sq),
                "cal_total": sum(c.cal_total),
            }
            if c.confidence
            else {}
        ),
    )
