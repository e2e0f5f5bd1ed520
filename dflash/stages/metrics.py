"""Metrics: raw counters per prompt, and every ratio derived from their sums (docs/family.md §3).

Conventions (named here; dflash.tracking logs them under these names):
- `acceptance_length` τ: committed tokens per verify step, bonus included (plain decoding = 1);
  token-weighted over all steps. `acceptance_length_macro`: mean of per-prompt τ (what DFlash's
  benchmark prints). `mean_accepted` = τ - 1 is gpt-fast's "mean accepted" (bonus excluded).
  The last step of a prompt commits at most what is left of the reference (capped); the other side,
  `acceptance_length_uncapped` (and `_macro_uncapped`), counts every step in full (accepted + 1,
  the bonus past the reference end included), as z-lab's original benchmark loop does (docs/metrics.md).
- Per draft slot k = 1..B-1 (`position_curves`, one list per kind, index k-1):
  `accept_rate`: cumulative, accepted_at_pos[k] / steps (vLLM's);
  `accept_rate_cond`: accepted_at_pos[k] / accepted_at_pos[k-1] (comparable across B);
  `accuracy`: teacher-forced, slot k right whatever the earlier slots, over every anchor (every
  `replay.tf_stride`-th with a stride: a systematic sample), `accuracy_se` its SE over prompts;
  with `scores=true` also `nll` (mean -log p of the reference token, nats) and `confidence`
  (mean top-1 probability). `commit_share`: per c = 1..B, the share of verify steps that committed c tokens.
- `expected_acceptance_length`: 1 + Σ_k Π_{i<=k} accuracy_i.
- With `scores=true` only: `nll_mean` (± `nll_mean_se`): teacher-forced mean -log p of the reference
  token over every anchor and slot: the training loss's cross-entropy, unweighted, on evaluation
  prompts. `overconfidence`: mean confidence - accuracy over all slots (> 0: surer than it is right).
- `acceptance_length_se`: standard error of τ with prompts as the sampling unit (steps within a
  prompt are not independent): the delta-method SE of a ratio of sums. Two drafters evaluated on the
  same prompts: `paired_ratio_diff` gives the SE of their τ gap, smaller than either τ's SE since
  what is hard about a prompt is hard for both (`dflash-compare`).

DSpark drafters (`Counters.markov`, `dspark_summary`; names: dflash/tracking/record.py, docs/dspark.md):
- the Markov head's gain: τ - τ of the base argmax's own walk (the same block without the head), paired SE;
- per confidence threshold t (`Counters.thresholds`): τ of the walk that verifies only the drafts before the
  first slot whose confidence σ(logit) is below t, its paired gain on the whole block, drafts verified per
  step and the verify rate (tokens committed per token the target verifies);
- calibration, at the teacher-forced anchors: per slot k the predicted Π_{i<=k} σ(logit_i) against whether
  drafts 1..k all equal the reference (`acceptance_predicted` / `acceptance_realised` curves), a reliability
  table over CAL_BINS bins, and the Brier score (mean squared error of those predictions). Brier, not ECE:
  it is a proper score and a sum over anchors, so it comes from summed counters with an SE over prompts as
  every other figure here, with no choice of bins; the reliability table shows what ECE would summarise.
The convention check (`convention_check`, every DFlash-family drafter): τ of the same drafter read in the
other slot convention (the anchor convention for DFlash; DFlash's for DSpark), from the same drafter passes,
and its paired gap to τ.

DFlash2 drafters (`Counters.selector`; the rows are absent for DFlash, not 0), from the same drafter passes:
- `acceptance_length_unary`: τ of the same replay walking the unary argmax (the drafter without its
  selector; `unary_steps`, `unary_committed`); `selector_gain` = τ - unary τ, `selector_gain_se` its
  paired SE over prompts (`paired_ratio_diff`); `expected_acceptance_length_unary` from `unary_accuracy`.
- Per slot, teacher-forced over the same anchors as `accuracy` (which is the walk's, the drafted
  proposal's): `unary_accuracy` (the unary top-1 is the reference token), `topk_recall` (the reference
  token is among the unary top-k: the selector can draft nothing else, so it bounds `accuracy`);
  `expected_acceptance_length_topk` = 1 + Σ_k Π_{i<=k} topk_recall_i, the ceiling of a perfect selector.

Undefined is not 0: a ratio over nothing (0/0: no verify step reached slot k, a prompt with no
verify step, an SE over fewer than two prompts) is None. Nothing undefined is logged; the console
prints "-"; plots leave a gap.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional


@dataclass
class Counters:
    block_size: int
    steps: int = 0  # verify steps
    drafted: int = 0  # drafted tokens (B-1 per step)
    accepted: int = 0  # drafted tokens accepted
    committed: int = 0  # tokens committed by verify steps (accepted + bonus, capped at the reference end)
    committed_uncapped: int = 0  # the same with every step counted in full (accepted + 1): z-lab's original convention
    new_tokens: int = 0  # all generated tokens: committed + the first one from prefill
    prompts: int = 0
    wall_s: float = 0.0
    accepted_at_pos: list[int] = field(default_factory=list)  # [B-1]: steps whose slot k was accepted
    commit_hist: list[int] = field(default_factory=list)  # [B+1]: steps that committed c tokens
    tf_correct: list[int] = field(default_factory=list)  # [B-1]: teacher-forced hits at slot k
    tf_total: list[int] = field(default_factory=list)  # [B-1]: anchors with a label at slot k
    tf_nll: list[float] = field(default_factory=list)  # [B-1]: sum of -log p(reference token) at slot k
    tf_conf: list[float] = field(default_factory=list)  # [B-1]: sum of the top-1 probability at slot k
    selector: bool = False  # DFlash2: the unary walk and the unary top-k are counted too (the fields below)
    markov: bool = False  # DSpark: the unary walk (the base argmax: the block without its Markov head) is counted
    unary_steps: int = 0  # verify steps of the same replay walking the unary argmax
    unary_committed: int = 0  # tokens it committed (capped as `committed`)
    tf_unary_correct: list[int] = field(default_factory=list)  # [B-1] (selector, markov): teacher-forced unary hits
    tf_topk_hit: list[int] = field(default_factory=list)  # [B-1] (selector only): reference token among the unary top-k
    # DSpark's confidence head: the threshold walks (verify up to the first slot below t) and its calibration
    confidence: bool = False
    thresholds: list[float] = field(default_factory=list)  # the t walked, one entry of each thr_* list per t
    thr_steps: list[int] = field(default_factory=list)
    thr_committed: list[int] = field(default_factory=list)
    thr_accepted: list[int] = field(default_factory=list)
    thr_drafted: list[int] = field(default_factory=list)  # Σ n_t: the drafts verified
    cal_total: list[int] = field(default_factory=list)  # [B-1]: anchors with a label at slot k (teacher-forced)
    cal_hit: list[int] = field(default_factory=list)  # [B-1]: ... whose drafts 1..k all equal the reference
    cal_pred: list[float] = field(default_factory=list)  # [B-1]: Σ predicted (Π_{i<=k} confidence_i)
    cal_sq: list[float] = field(default_factory=list)  # [B-1]: Σ (predicted - hit)²: the Brier score's numerator
    bin_total: list[int] = field(default_factory=list)  # [CAL_BINS]: the reliability table, all slots pooled
    bin_pred: list[float] = field(default_factory=list)
    bin_hit: list[int] = field(default_factory=list)
    # the other slot convention's walk over the same references (the convention check); other_width 0: not walked
    other_width: int = 0
    other_steps: int = 0
    other_committed: int = 0

    def __post_init__(self):
        K, n_t = self.block_size - 1, len(self.thresholds)
        for name, n in (
            ("accepted_at_pos", K),
            ("commit_hist", K + 2),
            ("tf_correct", K),
            ("tf_total", K),
            ("tf_nll", K),
            ("tf_conf", K),
            *((("tf_unary_correct", K),) if self.selector or self.markov else ()),
            *((("tf_topk_hit", K),) if self.selector else ()),
            *((f"thr_{x}", n_t) for x in ("steps", "committed", "accepted", "drafted")),
            *(((f"cal_{x}", K) for x in ("total", "hit", "pred", "sq")) if self.confidence else ()),
            *(((f"bin_{x}", CAL_BINS) for x in ("total", "pred", "hit")) if self.confidence else ()),
        ):
            if not getattr(self, name):
                setattr(self, name, [0.0 if name in FLOAT_LISTS else 0] * n)

    def __add__(self, o: "Counters") -> "Counters":
        assert all(getattr(self, n) == getattr(o, n) for n in FIXED), "counters of different replays"
        kw = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(o, f.name)
            kw[f.name] = a if f.name in FIXED else [x + y for x, y in zip(a, b)] if isinstance(a, list) else a + b
        return Counters(**kw)


CAL_BINS = 10  # the reliability table's bins of predicted acceptance, [0, 0.1), ..., [0.9, 1]
FLOAT_LISTS = ("tf_nll", "tf_conf", "cal_pred", "cal_sq", "bin_pred")
FIXED = ("block_size", "selector", "markov", "confidence", "thresholds", "other_width")  # what a replay is, not counts


def count_step(c: Counters, accepted: int, committed: int, drafted: int | None = None) -> None:
    """One verify step into the counters, the same for the offline replay and the online loop: `accepted`
    drafted tokens taken, `committed` tokens committed (accepted + bonus, capped where the reference or the
    generation ends); the uncapped side counts accepted + 1, as z-lab's original loop does. `drafted`: the
    drafts verified (default: the whole block, B - 1)."""
    c.steps += 1
    c.drafted += c.block_size - 1 if drafted is None else drafted
    c.accepted += accepted
    c.committed += committed
    c.committed_uncapped += accepted + 1
    c.new_tokens += committed
    for k in range(accepted):
        c.accepted_at_pos[k] += 1
    c.commit_hist[committed] += 1


Rate = Optional[float]  # None: undefined (0/0)


def ids_digest(ids: list[int]) -> str:
    """A short digest of token ids (16 hex digits of sha256): two rows with one digest saw the same tokens."""
    return hashlib.sha256(json.dumps([int(t) for t in ids]).encode()).hexdigest()[:16]


@dataclass
class PromptRow:
    """One prompt's counters as a run's `per_prompt.json` holds them (`to_dict`, one dict per prompt)
    and dflash.report.pairs pairs them: two rows pair only where both digests match."""

    id: str
    subset: str
    prompt_tokens: int
    new_tokens: int
    steps: int
    committed: int
    accepted_at_pos: list[int]  # [B-1]
    tf_correct: list[int]  # [B-1]
    tf_total: list[int]  # [B-1]
    tf_nll: Optional[float]  # Σ -log p(reference token) over every anchor and slot; None without scores=true
    prompt_digest: str  # ids_digest of the rendered prompt ids (template, system prompt, tokenizer)
    reference_digest: str  # ids_digest of the reference ids (target, dtype, server, sampling)
    # DFlash2 (Counters.selector) and DSpark (Counters.markov; no top-k); absent from per_prompt.json otherwise
    unary_steps: Optional[int] = None  # the unary argmax's own walk: verify steps
    unary_committed: Optional[int] = None  # and tokens committed
    tf_unary_correct: Optional[list[int]] = None  # [B-1] teacher-forced unary top-1 hits
    tf_topk_hit: Optional[list[int]] = None  # [B-1] reference token among the unary top-k
    # the other slot convention's walk (the convention check; absent where it was not walked)
    other_steps: Optional[int] = None
    other_committed: Optional[int] = None
    # DSpark's confidence head: the threshold walks (one entry per threshold) and the Brier score's counts
    thresholds: Optional[list[float]] = None
    thr_steps: Optional[list[int]] = None
    thr_committed: Optional[list[int]] = None
    cal_sq: Optional[float] = None  # Σ (predicted - realised)² over every teacher-forced anchor and slot
    cal_total: Optional[int] = None  # the anchors and slots counted

    @property
    def acceptance_length(self) -> Rate:
        return ratio(self.committed, self.steps)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if v is not None or k not in OPTIONAL_ROW}
        return {
            **{k: d.pop(k) for k in ("id", "subset", "prompt_tokens", "new_tokens", "steps", "committed")},
            "acceptance_length": self.acceptance_length,
            **d,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PromptRow":
        """A row read back from per_prompt.json; KeyError names a field an older dflash-eval did not log."""
        return cls(**{f.name: d.get(f.name) if f.name in OPTIONAL_ROW else d[f.name] for f in fields(cls)})


SELECTOR_ROW = ("unary_steps", "unary_committed", "tf_unary_correct", "tf_topk_hit")  # PromptRow's DFlash2 fields
OPTIONAL_ROW = (
    *SELECTOR_ROW,
    "other_steps",
    "other_committed",
    "thresholds",
    "thr_steps",
    "thr_committed",
    "cal_sq",
    "cal_total",
)  # PromptRow's fields a replay may not have counted (absent, not null)


def row_counters(rows: list[PromptRow]) -> Counters:
    """The counters a set of rows holds, summed (steps, committed, accepted_at_pos, teacher-forced counts)."""
    K = len(rows[0].tf_total)

    def col(name: str) -> list[int]:
        return [sum(getattr(r, name)[k] for r in rows) for k in range(K)]

    return Counters(
        block_size=K + 1,
        steps=sum(r.steps for r in rows),
        committed=sum(r.committed for r in rows),
        new_tokens=sum(r.new_tokens for r in rows),
        prompts=len(rows),
        accepted_at_pos=col("accepted_at_pos"),
        tf_correct=col("tf_correct"),
        tf_total=col("tf_total"),
    )


def ratio(a: float, b: float) -> Rate:
    return a / b if b else None


def acceptance_length(c: Counters) -> Rate:
    return ratio(c.committed, c.steps)


def ratio_se(num: list[float], den: list[float]) -> Rate:
    """SE of Σnum/Σden over n clusters (delta method, n/(n-1) small-sample factor); None when n < 2
    (no spread to measure) or Σden = 0."""
    n, D = len(num), sum(den)
    if n < 2 or not D:
        return None
    r = sum(num) / D
    return (n / (n - 1) * sum((a - r * b) ** 2 for a, b in zip(num, den))) ** 0.5 / D


def paired_ratio_diff(
    num_a: list[float], den_a: list[float], num_b: list[float], den_b: list[float]
) -> tuple[Rate, Rate]:
    """Σnum_b/Σden_b - Σnum_a/Σden_a over the same n clusters, and its paired SE (delta method:
    each cluster's influence on b minus its influence on a, so what the prompts share cancels).
    Undefined is None: the gap when either side has Σden = 0 (no verify step), the SE under 2 clusters."""
    n, Da, Db = len(num_a), sum(den_a), sum(den_b)
    if not Da or not Db:
        return None, None
    ra, rb = sum(num_a) / Da, sum(num_b) / Db
    if n < 2:
        return rb - ra, None
    z = [(nb - rb * db) / Db - (na - ra * da) / Da for na, da, nb, db in zip(num_a, den_a, num_b, den_b)]
    return rb - ra, (n / (n - 1) * sum(x * x for x in z)) ** 0.5


def accept_rate(c: Counters) -> list[Rate]:
    return [ratio(n, c.steps) for n in c.accepted_at_pos]


def accept_rate_cond(c: Counters) -> list[Rate]:
    prev = [c.steps] + c.accepted_at_pos[:-1]
    return [ratio(n, p) for n, p in zip(c.accepted_at_pos, prev)]


def accuracy(c: Counters) -> list[Rate]:
    return [ratio(h, t) for h, t in zip(c.tf_correct, c.tf_total)]


def accuracy_se(per_prompt: list[Counters]) -> list[Rate]:
    """Per slot, the SE of the teacher-forced accuracy with prompts as the sampling unit (`ratio_se`):
    it holds the anchors' sampling too when only every tf_stride-th anchor was counted."""
    K = per_prompt[0].block_size - 1
    return [ratio_se([c.tf_correct[k] for c in per_prompt], [c.tf_total[k] for c in per_prompt]) for k in range(K)]


def scored(c: Counters) -> bool:
    """Whether NLL and confidence were counted (replay with `scores`): a probability is never 0."""
    return sum(c.tf_conf) > 0


def nll(c: Counters) -> list[Rate]:
    return [ratio(x, t) for x, t in zip(c.tf_nll, c.tf_total)]


def confidence(c: Counters) -> list[Rate]:
    return [ratio(x, t) for x, t in zip(c.tf_conf, c.tf_total)]


def unary_accuracy(c: Counters) -> list[Rate]:
    return [ratio(h, t) for h, t in zip(c.tf_unary_correct, c.tf_total)]


def topk_recall(c: Counters) -> list[Rate]:
    return [ratio(h, t) for h, t in zip(c.tf_topk_hit, c.tf_total)]


def selector_rows(per_prompt: list[Counters], total: Counters) -> dict[str, Rate]:
    """DFlash2's scalars (module docstring): unary τ, the selector's gain with its paired SE, the expected
    lengths of the unary argmax and of the top-k ceiling."""
    gain, se = paired_ratio_diff(
        [c.unary_committed for c in per_prompt],
        [c.unary_steps for c in per_prompt],
        [c.committed for c in per_prompt],
        [c.steps for c in per_prompt],
    )
    return {
        "acceptance_length_unary": ratio(total.unary_committed, total.unary_steps),
        "acceptance_length_unary_se": ratio_se(
            [c.unary_committed for c in per_prompt], [c.unary_steps for c in per_prompt]
        ),
        "selector_gain": gain,
        "selector_gain_se": se,
        "expected_acceptance_length_unary": expected_acceptance_length(unary_accuracy(total)),
        "expected_acceptance_length_topk": expected_acceptance_length(topk_recall(total)),
    }


def markov_rows(per_prompt: list[Counters], total: Counters) -> dict[str, Rate]:
    """DSpark's Markov head: τ of the base argmax's own walk (the block without the head) and the head's gain over it,
    with its paired SE over prompts (as `selector_rows` for DFlash2's selector)."""
    gain, se = paired_ratio_diff(
        [c.unary_committed for c in per_prompt],
        [c.unary_steps for c in per_prompt],
        [c.committed for c in per_prompt],
        [c.steps for c in per_prompt],
    )
    return {
        "tau_unary": ratio(total.unary_committed, total.unary_steps),
        "tau_unary_se": ratio_se([c.unary_committed for c in per_prompt], [c.unary_steps for c in per_prompt]),
        "gain": gain,
        "gain_se": se,
        "expected_unary": expected_acceptance_length(unary_accuracy(total)),
    }


@dataclass(frozen=True)
class ThresholdRow:
    """τ of the walk that verifies only the drafts before the first slot whose confidence is below `threshold`."""

    threshold: float
    tau: Rate
    tau_se: Rate
    gain: Rate  # τ - the whole block's τ, paired over prompts (<= 0 unless truncation changes the anchors visited)
    gain_se: Rate
    drafted_per_step: Rate  # drafts verified per step (DeepSpec's draft_tokens_per_proposal)
    verify_rate: Rate  # tokens committed per token the target verifies: committed / (drafts verified + steps)


@dataclass(frozen=True)
class SlotCalibration:
    """Slot k: the confidence head's predicted acceptance (Π_{i<=k} σ(logit_i)) against the realised one."""

    pos: int
    n: int  # teacher-forced anchors with a label at slot k
    predicted: Rate  # mean predicted probability that drafts 1..k are all accepted
    realised: Rate  # the share of anchors where they all equal the reference
    brier: Rate  # mean (predicted - realised)²


@dataclass(frozen=True)
class BinCalibration:
    """One bin of the reliability table (predicted in [lo, hi), all slots pooled)."""

    lo: float
    hi: float
    n: int
    predicted: Rate
    realised: Rate


@dataclass(frozen=True)
class DSparkSummary:
    """What a DSpark drafter adds to τ: the Markov head's gain, the confidence-threshold walks, the calibration."""

    tau_unary: Rate  # the base argmax's walk: the same block without the Markov head
    tau_unary_se: Rate
    markov_gain: Rate  # τ - tau_unary, paired over prompts
    markov_gain_se: Rate
    expected_unary: Rate  # 1 + Σ Π unary accuracy
    drafted_per_step: Rate  # the whole block: gamma
    verify_rate: Rate  # the whole block's committed / (drafted + steps)
    thresholds: list[ThresholdRow] = field(default_factory=list)
    slots: list[SlotCalibration] = field(default_factory=list)  # empty without a confidence head
    bins: list[BinCalibration] = field(default_factory=list)
    brier: Rate = None  # the Brier score over every slot and anchor (module docstring: why Brier)
    brier_se: Rate = None


def dspark_summary(per_prompt: list[Counters], total: Counters) -> DSparkSummary | None:
    """A DSpark replay's summary from its counters (None for other drafters)."""
    if not total.markov:
        return None
    m = markov_rows(per_prompt, total)
    rows = []
    for i, t in enumerate(total.thresholds):
        gain, se = paired_ratio_diff(
            [c.committed for c in per_prompt],
            [c.steps for c in per_prompt],
            [c.thr_committed[i] for c in per_prompt],
            [c.thr_steps[i] for c in per_prompt],
        )
        rows.append(
            ThresholdRow(
                t,
                ratio(total.thr_committed[i], total.thr_steps[i]),
                ratio_se([c.thr_committed[i] for c in per_prompt], [c.thr_steps[i] for c in per_prompt]),
                gain,
                se,
                ratio(total.thr_drafted[i], total.thr_steps[i]),
                ratio(total.thr_committed[i], total.thr_drafted[i] + total.thr_steps[i]),
            )
        )
    slots, bins, brier, brier_se = [], [], None, None
    if total.confidence:
        slots = [
            SlotCalibration(
                k + 1,
                total.cal_total[k],
                ratio(total.cal_pred[k], total.cal_total[k]),
                ratio(total.cal_hit[k], total.cal_total[k]),
                ratio(total.cal_sq[k], total.cal_total[k]),
            )
            for k in range(total.block_size - 1)
        ]
        bins = [
            BinCalibration(
                b / CAL_BINS,
                (b + 1) / CAL_BINS,
                total.bin_total[b],
                ratio(total.bin_pred[b], total.bin_total[b]),
                ratio(total.bin_hit[b], total.bin_total[b]),
            )
            for b in range(CAL_BINS)
        ]
        brier = ratio(sum(total.cal_sq), sum(total.cal_total))
        brier_se = ratio_se([sum(c.cal_sq) for c in per_prompt], [sum(c.cal_total) for c in per_prompt])
    return DSparkSummary(
        m["tau_unary"],
        m["tau_unary_se"],
        m["gain"],
        m["gain_se"],
        m["expected_unary"],
        ratio(total.drafted, total.steps),
        ratio(total.committed, total.drafted + total.steps),
        rows,
        slots,
        bins,
        brier,
        brier_se,
    )


@dataclass(frozen=True)
class ConventionCheck:
    """τ of the drafter read in the other slot convention, from the same drafter passes, against the served τ."""

    tau: Rate  # as read (the served convention)
    other_tau: Rate  # read in the other convention
    gain: Rate  # other_tau - tau, paired over prompts
    gain_se: Rate
    z: Rate  # gain / gain_se
    other_width: int  # the other convention's verify width (its proposals + 1)


def convention_check(per_prompt: list[Counters]) -> ConventionCheck | None:
    """The other slot convention's τ against the served one (None where it was not walked)."""
    if not per_prompt or not per_prompt[0].other_width:
        return None
    gain, se = paired_ratio_diff(
        [c.committed for c in per_prompt],
        [c.steps for c in per_prompt],
        [c.other_committed for c in per_prompt],
        [c.other_steps for c in per_prompt],
    )
    return ConventionCheck(
        ratio(sum(c.committed for c in per_prompt), sum(c.steps for c in per_prompt)),
        ratio(sum(c.other_committed for c in per_prompt), sum(c.other_steps for c in per_prompt)),
        gain,
        se,
        gain / se if gain is not None and se else None,
        per_prompt[0].other_width,
    )


def commit_share(c: Counters) -> list[Rate]:
    """Per c = 1..B: the share of verify steps that committed c tokens (index c-1)."""
    return [ratio(n, c.steps) for n in c.commit_hist[1:]]


def position_curves(c: Counters) -> dict[str, list[Rate]]:
    """Every per-slot series of summed counters, by kind (index k-1 for slot k); NLL and confidence
    only when they were counted (scores=true)."""
    out = {"accept_rate": accept_rate(c), "accept_rate_cond": accept_rate_cond(c), "accuracy": accuracy(c)}
    if c.selector:
        out.update(unary_accuracy=unary_accuracy(c), topk_recall=topk_recall(c))
    if c.markov:
        out.update(unary_accuracy=unary_accuracy(c))
    if c.confidence:  # the confidence head's calibration per slot (teacher-forced anchors)
        out.update(
            acceptance_predicted=[ratio(p, n) for p, n in zip(c.cal_pred, c.cal_total)],
            acceptance_realised=[ratio(h, n) for h, n in zip(c.cal_hit, c.cal_total)],
        )
    if scored(c):
        out.update(nll=nll(c), confidence=confidence(c))
    return out


def position_table(c: Counters) -> list[dict[str, Any]]:
    """One row per draft slot: every per-slot rate (None where undefined) and the counts behind it."""
    curves = position_curves(c)
    reached = [c.steps] + c.accepted_at_pos[:-1]
    sel = ("tf_unary_correct", "tf_topk_hit") if c.selector else ("tf_unary_correct",) if c.markov else ()
    sel += ("cal_total", "cal_hit", "cal_pred", "cal_sq") if c.confidence else ()
    return [
        {
            "pos": k + 1,
            **{name: v[k] for name, v in curves.items()},
            "accepted": c.accepted_at_pos[k],
            "reached": reached[k],
            "steps": c.steps,
            "tf_correct": c.tf_correct[k],
            "tf_total": c.tf_total[k],
            **{n: getattr(c, n)[k] for n in sel},
        }
        for k in range(c.block_size - 1)
    ]


def expected_acceptance_length(acc: list[Rate]) -> Rate:
    """1 + Σ_k Π_{i<=k} accuracy_i, summed up to the first undefined slot; None if slot 1 is undefined."""
    if not acc or acc[0] is None:
        return None
    total, run = 1.0, 1.0
    for a in acc:
        if a is None:
            break
        run *= a
        total += run
    return total


def summarize(per_prompt: list[tuple[str, Counters]]) -> dict[str, Rate]:
    """Scalars (MLflow names) over all prompts, plus τ per subset; None where undefined. The per-slot
    series are `position_curves` of the summed counters."""
    total = sum((c for _, c in per_prompt[1:]), per_prompt[0][1])
    taus = [t for _, c in per_prompt if (t := acceptance_length(c)) is not None]
    m: dict[str, Rate] = {
        "acceptance_length": acceptance_length(total),
        "acceptance_length_macro": ratio(sum(taus), len(taus)),
        "acceptance_length_se": ratio_se([c.committed for _, c in per_prompt], [c.steps for _, c in per_prompt]),
        "mean_accepted": ratio(total.accepted, total.steps),
        "expected_acceptance_length": expected_acceptance_length(accuracy(total)),
        "draft_acceptance_rate": ratio(total.accepted, total.drafted),
        "steps": float(total.steps),
        "new_tokens": float(total.new_tokens),
        "prompts": float(total.prompts),
    }
    if total.committed_uncapped:  # every step counted in full (replay and online loop alike)
        m["acceptance_length_uncapped"] = ratio(total.committed_uncapped, total.steps)
        m["acceptance_length_macro_uncapped"] = ratio(
            sum(ratio(c.committed_uncapped, c.steps) for _, c in per_prompt if c.steps), len(taus)
        )
    if total.selector:
        m.update(selector_rows([c for _, c in per_prompt], total))
    if scored(total):
        m["nll_mean"] = ratio(sum(total.tf_nll), sum(total.tf_total))
        m["nll_mean_se"] = ratio_se([sum(c.tf_nll) for _, c in per_prompt], [sum(c.tf_total) for _, c in per_prompt])
        m["overconfidence"] = ratio(sum(total.tf_conf) - sum(total.tf_correct), sum(total.tf_total))
    for subset in sorted({s for s, _ in per_prompt}):
        sub = [c for s, c in per_prompt if s == subset]
        st = sum(sub[1:], sub[0])
        m[f"acceptance_length/{subset}"] = acceptance_length(st)
        m[f"expected_acceptance_length/{subset}"] = expected_acceptance_length(accuracy(st))
    return m
