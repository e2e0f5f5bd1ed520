"""Two runs paired prompt by prompt: is B better or worse than A?

`align` pairs the per-prompt rows (`dflash.stages.metrics.PromptRow`; `rows_of` reads them from
per_prompt.json's dicts) of two evaluation runs by prompt id and refuses what differs, naming the
prompts: other prompts, prompts rendered to other ids or other references (each row's digests of its
prompt and reference ids), another target or dtype (`RunIdentity`, from the runs' tags; a run without
those tags cannot be checked and is refused too). `compare`
gives the gap in τ (overall and per subset), in teacher-forced accuracy at slots 1-3 and (both run
with scores=true) in the reference token's NLL, for two DFlash2 runs in the unary τ and the top-k recall at
slots 1-3 (a τ gap larger than the unary τ gap: the selector gained), for two DSpark runs in the unary τ (the
block without its Markov head), τ at each confidence threshold both walked and the confidence head's Brier score
(lower is better), for a DSpark run against a drafter without a confidence head τ at each of its thresholds against
the other's whole-block τ (what that drafter verifies at any threshold), and for any two runs in τ read in the
other slot convention, each with its paired SE (metrics.paired_ratio_diff;
what is undefined stays None, printed "-"); `render` prints it, `compare_artifacts` writes it as CSV
and a plot of the gaps. Plain functions over typed rows; no MLflow here (the CLI, dflash/cli/compare.py,
reads the runs through dflash.tracking).
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from dflash.stages.metrics import PromptRow, Rate, paired_ratio_diff
from dflash.util.errors import UserError


class CompareError(UserError):
    pass


@dataclass(frozen=True)
class RunIdentity:
    """What a run's references and features depend on beyond its rows: the target's identity and dtype
    (read back from the run by dflash.tracking: `RunTags`); None where a run did not say."""

    target: Optional[str] = None
    dtype: Optional[str] = None


Pair = tuple[PromptRow, PromptRow]


@dataclass(frozen=True)
class CompareRow:
    """One metric of `compare`: A's and B's value, the paired gap B − A, its SE and z; None where undefined."""

    # acceptance_length, acceptance_length/<subset>, accuracy/pos_0k, nll_mean; DFlash2: acceptance_length_unary,
    # topk_recall/pos_0k
    metric: str
    a: Rate
    b: Rate
    diff: Rate
    se: Rate
    z: Rate


def rows_of(dicts: list[dict[str, Any]]) -> list[PromptRow]:
    """A run's per_prompt.json rows as typed rows; refused (evaluate it again) when an older dflash-eval logged them."""
    try:
        return [PromptRow.from_dict(d) for d in dicts]
    except KeyError as e:
        raise CompareError(
            f"a run was logged by an older dflash-eval (its per-prompt rows have no {e.args[0]!r}): evaluate it again"
        ) from None


def _listed(ids: list[str], n: int = 5) -> str:
    return ", ".join(ids[:n]) + (", ..." if len(ids) > n else "")


def align(rows_a: list[PromptRow], rows_b: list[PromptRow], run_a: RunIdentity, run_b: RunIdentity) -> list[Pair]:
    """Pair the rows by prompt id; refuse other prompt sets, prompts rendered otherwise, other references
    (the rows' digests differ), another target or dtype (the runs' identities differ) or a run that does
    not say its target or dtype (it cannot be checked), naming the prompts."""
    a, b = {r.id: r for r in rows_a}, {r.id: r for r in rows_b}
    if a.keys() != b.keys():
        only_a, only_b = [i for i in a if i not in b], [i for i in b if i not in a]
        raise CompareError(
            f"the runs replayed different prompts ({len(only_a)} only in A{': ' + _listed(only_a) if only_a else ''}; "
            f"{len(only_b)} only in B{': ' + _listed(only_b) if only_b else ''}): "
            "evaluate both with the same prompts=... and prompts.num_prompts, or pass run ids"
        )
    for what, tag in (("target", "target_identity"), ("dtype", "dtype")):
        x, y = getattr(run_a, what), getattr(run_b, what)
        missing = [side for side, v in (("A", x), ("B", y)) if v is None]
        if missing:
            who, it = ("runs A and B have", "them") if len(missing) == 2 else (f"run {missing[0]} has", "it")
            raise CompareError(
                f"{who} no {tag} tag (logged before dflash-eval tagged it, or by another tool): whether both used one "
                f"{what} "
                f"cannot be checked; evaluate {it} again"
            )
        if x != y:
            raise CompareError(
                f"the runs used another {what} (A: {x}, B: {y}): their gap mixes drafter and {what}; "
                "compare runs of one target setting"
            )
    prompts = [i for i in a if a[i].prompt_digest != b[i].prompt_digest]
    if prompts:
        raise CompareError(
            f"{len(prompts)} prompts were rendered to other token ids: {_listed(prompts)}; the runs used another chat "
            f"template, "
            "system prompt, thinking mode or tokenizer; compare runs of one prompt setting"
        )
    refs = [i for i in a if a[i].reference_digest != b[i].reference_digest]
    if refs:
        raise CompareError(
            f"{len(refs)} prompts have other references: {_listed(refs)}; the runs used another target, dtype, server "
            f"or sampling "
            "(or prompts.max_new_tokens); compare runs of one reference setting"
        )
    return [(a[i], b[i]) for i in a]


def _row(
    name: str, pairs: list[Pair], num: Callable[[PromptRow], float], den: Callable[[PromptRow], float]
) -> CompareRow:
    """One metric's paired gap; None where undefined (no step on a side; an SE under 2 prompts; z over an SE of 0)."""
    na, da = [num(x) for x, _ in pairs], [den(x) for x, _ in pairs]
    nb, db = [num(y) for _, y in pairs], [den(y) for _, y in pairs]
    d, se = paired_ratio_diff(na, da, nb, db)
    a = sum(na) / sum(da) if sum(da) else None
    b = sum(nb) / sum(db) if sum(db) else None
    return CompareRow(name, a, b, d, se, d / se if d is not None and se else None)


def compare(pairs: list[Pair]) -> list[CompareRow]:
    """-> one row per metric: τ overall and per subset, tf accuracy at slots 1-3, NLL."""
    out = [_row("acceptance_length", pairs, lambda r: r.committed, lambda r: r.steps)]
    subsets = sorted({x.subset for x, _ in pairs})
    if len(subsets) > 1:
        out += [
            _row(
                f"acceptance_length/{s}",
                [p for p in pairs if p[0].subset == s],
                lambda r: r.committed,
                lambda r: r.steps,
            )
            for s in subsets
        ]
    for k in range(min(3, len(pairs[0][0].tf_total) if pairs else 0)):
        out.append(
            _row(f"accuracy/pos_{k + 1:02d}", pairs, lambda r, k=k: r.tf_correct[k], lambda r, k=k: r.tf_total[k])
        )
    if pairs and all(x.tf_nll is not None and y.tf_nll is not None for x, y in pairs):  # both ran with scores=true
        out.append(_row("nll_mean", pairs, lambda r: r.tf_nll, lambda r: sum(r.tf_total)))

    def both(f: str) -> bool:
        return bool(pairs) and all(getattr(x, f) is not None and getattr(y, f) is not None for x, y in pairs)

    if both("unary_steps"):  # two DFlash2 runs, or two DSpark runs (the block without its Markov head)
        out.append(_row("acceptance_length_unary", pairs, lambda r: r.unary_committed, lambda r: r.unary_steps))
    if both("tf_topk_hit"):  # two DFlash2 runs
        for k in range(min(3, len(pairs[0][0].tf_total))):
            out.append(
                _row(
                    f"topk_recall/pos_{k + 1:02d}", pairs, lambda r, k=k: r.tf_topk_hit[k], lambda r, k=k: r.tf_total[k]
                )
            )
    if both("thresholds"):  # two DSpark runs: τ at each confidence threshold both walked, the Brier score
        a, b = pairs[0][0].thresholds, pairs[0][1].thresholds
        for t in [t for t in a if t in b]:
            out.append(
                _row(
                    f"confidence_threshold/{t:g}",
                    pairs,
                    lambda r, t=t: r.thr_committed[_idx(r, t)],
                    lambda r, t=t: r.thr_steps[_idx(r, t)],
                )
            )
        out.append(_row("confidence_brier", pairs, lambda r: r.cal_sq, lambda r: r.cal_total))
    elif pairs and (one := _one_side(pairs)) is not None:  # DSpark against a drafter without a confidence head
        for t in one:  # which verifies its whole block at any threshold: its τ stands against each threshold's τ
            out.append(
                _row(
                    f"confidence_threshold/{t:g}",
                    pairs,
                    lambda r, t=t: r.committed if r.thresholds is None else r.thr_committed[_idx(r, t)],
                    lambda r, t=t: r.steps if r.thresholds is None else r.thr_steps[_idx(r, t)],
                )
            )
    if both("other_steps"):  # the convention check: τ read in the other slot convention
        out.append(_row("acceptance_length_other", pairs, lambda r: r.other_committed, lambda r: r.other_steps))
    return out


def _one_side(pairs: list[Pair]) -> list[float] | None:
    """The thresholds one side walked (the same on every prompt) where the other side walked none, else None."""
    for me, other in ((0, 1), (1, 0)):
        ts = {tuple(p[me].thresholds) if p[me].thresholds is not None else None for p in pairs}
        if len(ts) == 1 and None not in ts and all(p[other].thresholds is None for p in pairs):
            return list(next(iter(ts)))
    return None


def _idx(r: PromptRow, t: float) -> int:
    """Where threshold t sits in a row's thr_* lists."""
    return r.thresholds.index(t)


def _f(x: float | None, spec: str, width: int) -> str:
    return f"{'-' if x is None else format(x, spec):>{width}}"


def render(name_a: str, name_b: str, n: int, rows: list[CompareRow]) -> str:
    lines = [
        f"A = {name_a}   B = {name_b}   {n} prompts, paired by prompt",
        f"{'metric':<28}{'A':>8}{'B':>8}{'B-A':>9}{'± SE':>8}{'z':>7}",
    ]
    for r in rows:
        verdict = "" if r.z is None or abs(r.z) < 2 else ("  B higher" if r.z > 0 else "  B lower")
        lines.append(
            f"{r.metric:<28}{_f(r.a, '.3f', 8)}{_f(r.b, '.3f', 8)}{_f(r.diff, '+.3f', 9)}"
            f"{_f(r.se, '.3f', 8)}{_f(r.z, '+.1f', 7)}{verdict}"
        )
    lines.append(
        "|z| >= 2: a measurable gap (lower NLL and Brier are better; higher τ and accuracy are better); -: undefined "
        "(no verify step, an SE over fewer than 2 prompts, z over an SE of 0)"
    )
    return "\n".join(lines)


def table_csv(rows: list[dict[str, Any]]) -> str:
    """Rows (column -> value) as CSV, columns in order of first appearance; floats to 6 significant digits, None
    empty."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for r in rows:
        w.writerow(["" if r.get(c) is None else f"{r[c]:.6g}" if isinstance(r[c], float) else r[c] for c in cols])
    return buf.getvalue()


def compare_artifacts(name_a: str, name_b: str, rows: list[CompareRow]) -> dict[str, bytes]:
    """The comparison as files: `compare_<A>_vs_<B>.csv` (compare's rows) and `.png` (the gaps)."""
    from dflash.report import plots

    stem = re.sub(r"[^A-Za-z0-9_.@=-]+", "_", f"compare_{name_a}_vs_{name_b}")
    png = plots.gaps_png(
        [r.metric for r in rows],
        [r.diff for r in rows],
        [r.se for r in rows],
        title=f"B = {name_b}  minus  A = {name_a}, paired by prompt",
    )
    return {f"{stem}.csv": table_csv([asdict(r) for r in rows]).encode(), f"{stem}.png": png}
