"""Reports: pure formatting of results. `summary`: what a run prints on the console; `markdown`: the
run's MLflow description; `sweep_markdown`: a sweep parent's description (its children side by side).

Undefined values (None: a ratio over nothing, see dflash.stages.metrics) print as "-", never as 0.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Sequence

from dflash.report.sweep import yardstick_once

if TYPE_CHECKING:
    from dflash.report.samples import Sample
    from dflash.report.sweep import SweepRow
    from dflash.result import EvalResult


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def convention_line(res: EvalResult) -> str:
    """The convention check (every DFlash-family drafter): τ read in the other slot convention, beside τ."""
    c, dc = res.convention, res.info.drafter_config
    other = "DFlash's (row 0 dropped)" if dc.get("dspark_sample_from_anchor", False) else "the anchor convention"
    return (
        f"slot convention check: read in {other} ({c.other_width - 1} drafts) τ {fmt(c.other_tau)}; "
        f"other - served {fmt(c.gain, '+.3f')} ± {fmt(c.gain_se)} (paired SE, z {fmt(c.z, '+.1f')})"
    )


def dspark_lines(res: EvalResult) -> list[str]:
    """DSpark's extras: the Markov head's gain, τ at each confidence threshold, the confidence head's calibration."""
    d, m, dc = res.dspark, res.metrics, res.info.drafter_config
    if d is None:
        return []
    g = m.get
    lines = [
        f"DSpark ({dc.get('dspark_markov_head_type')} Markov head, rank {dc.get('dspark_markov_rank')}; gamma "
        f"{dc.get('dspark_gamma')}, sample_from_anchor={str(dc.get('dspark_sample_from_anchor')).lower()}): τ with the "
        f"whole block verified (SGLang's default) {fmt(g('acceptance_length'))} ± {fmt(g('acceptance_length_se'))}; "
        f"without the Markov head (base argmax) {fmt(d.tau_unary)} ± {fmt(d.tau_unary_se)}; Markov gain "
        f"{fmt(d.markov_gain, '+.3f')} ± {fmt(d.markov_gain_se)} (paired SE); verify rate {fmt(d.verify_rate)} "
        "(committed per token verified)"
    ]
    if d.thresholds:
        lines.append(
            "confidence threshold t (verify the drafts before the first slot whose confidence is below t):\n"
            "     t       τ    ± se   vs whole block  ± se   drafts/step  verify rate"
        )
        for r in d.thresholds:
            lines.append(
                f"  {r.threshold:>4g}  {fmt(r.tau):>6}  {fmt(r.tau_se):>6}  {fmt(r.gain, '+.3f'):>14}  "
                f"{fmt(r.gain_se):>5}  {fmt(r.drafted_per_step, '.2f'):>11}  {fmt(r.verify_rate):>11}"
            )
    if d.slots:
        lines.append(
            "confidence head calibration (teacher-forced anchors; predicted = Π σ(logit) over slots 1..k, realised = "
            f"drafts 1..k all equal the reference): Brier {fmt(d.brier, '.4f')} ± {fmt(d.brier_se, '.4f')} "
            "(0: perfect; always predicting the realised rate scores its variance)\n"
            "  slot       n  predicted  realised   brier"
        )
        lines += [
            f"  {c.pos:>4}  {c.n:>6}  {fmt(c.predicted):>9}  {fmt(c.realised):>8}  {fmt(c.brier, '.4f'):>6}"
            for c in d.slots
        ]
        lines.append("  reliability (all slots):   bin          n  predicted  realised")
        lines += [
            f"  {'':>25}[{b.lo:.1f}, {b.hi:.1f})  {b.n:>6}  {fmt(b.predicted):>9}  {fmt(b.realised):>8}"
            for b in d.bins
            if b.n
        ]
    return lines


def summary(res: EvalResult, where: str | None = None, max_blocks: int = 6, samples: Sequence[Sample] = ()) -> str:
    """What a run prints; `samples` (dflash.report.samples.samples_of): the first one's first blocks."""
    m, info = res.metrics, res.info
    g = m.get
    gamma = info.drafter_config.get("dspark_gamma")
    block = f"block {info.block_size}" if gamma is None else f"DSpark gamma {gamma}"
    lines = [
        f"== {info.run_name}  ({info.device}, {info.dtype}, {block}, taps {info.target_layer_ids})",
        f"acceptance length τ (bonus included, token-weighted): {fmt(g('acceptance_length'))} ± "
        f"{fmt(g('acceptance_length_se'))} (SE over prompts)   "
        f"macro (per-prompt mean): {fmt(g('acceptance_length_macro'))}   expected from accuracy: "
        f"{fmt(g('expected_acceptance_length'))}",
    ]
    if "acceptance_length_unary" in m:  # DFlash2 (the rows are absent for DFlash)
        lines.append(
            f"DFlash2: τ (selector walk) {fmt(g('acceptance_length'))}   unary τ (argmax, no selector) "
            f"{fmt(g('acceptance_length_unary'))} "
            f"± {fmt(g('acceptance_length_unary_se'))}   selector gain {fmt(g('selector_gain'), '+.3f')} ± "
            f"{fmt(g('selector_gain_se'))} "
            f"(paired SE)   expected: unary {fmt(g('expected_acceptance_length_unary'))}, top-k ceiling "
            f"{fmt(g('expected_acceptance_length_topk'))}"
        )
    lines += dspark_lines(res)
    if res.convention is not None:
        lines.append(convention_line(res))
    if (pl := res.prompt_lookup) is not None:  # the yardstick beside τ
        lines.append(
            f"prompt lookup (vLLM's ngram: n {pl.min_n}..{pl.max_n}, {pl.k} drafted, same references): τ {fmt(pl.tau)} "
            f"± {fmt(pl.tau_se)};   "
            f"drafter - prompt lookup {fmt(pl.gain, '+.3f')} ± {fmt(pl.gain_se)} (paired SE)"
            + ("   the drafter does not beat it" if pl.gain is not None and pl.gain <= 0 else "")
        )
    if info.drafter_config:
        lines.append(
            "drafter config: "
            + ", ".join(f"{k}={v}" for k, v in info.drafter_config.items())
            + f"; stop ids {info.stop_ids}"
        )
    subsets = sorted(k.split("/", 1)[1] for k in m if k.startswith("acceptance_length/"))
    if subsets:
        lines.append("τ per subset: " + "   ".join(f"{s} {fmt(m[f'acceptance_length/{s}'])}" for s in subsets))
    if g("served/prompts"):
        lines.append(
            f"served τ (the server's own counters, {int(m['served/prompts'])} prompts): "
            f"{fmt(g('served/acceptance_length'))} pooled, "
            f"{fmt(g('served/acceptance_length_macro'))} macro;   offline, counted as the server counts (prefill token "
            f"included): "
            f"{fmt(g('served/offline_like'))};   offline - served {fmt(g('served/gap'), '+.3f')} ± "
            f"{fmt(g('served/gap_se'))} (paired SE)"
        )
    if "leak_probe/acceptance_length" in m:
        lines.append(
            f"leak probe: τ with the anchor's own feature visible {fmt(g('leak_probe/acceptance_length'))} "
            f"(gain {fmt(g('leak_probe/tau_gain'), '+.3f')})"
        )
    cv = res.curves
    scored = "nll" in cv
    if scored:
        lines.append(
            f"NLL of the reference token (tf, nats): {fmt(g('nll_mean'))} ± {fmt(g('nll_mean_se'))}   "
            f"overconfidence (confidence - accuracy): {fmt(g('overconfidence'), '+.3f')}"
        )
    stride, sel = info.tf_stride, "topk_recall" in cv
    lines.append(
        "pos   accept(cum)  accept(cond)  accuracy(tf)   ± se"
        + ("   unary(tf)  top-k recall" if sel else "")
        + ("   nll(tf)  confidence" if scored else "")
    )
    se = cv.get("accuracy_se") or [None] * len(cv["accuracy"])
    for k, (a, c, t) in enumerate(zip(cv["accept_rate"], cv["accept_rate_cond"], cv["accuracy"]), start=1):
        extra = f"  {fmt(cv['unary_accuracy'][k - 1]):>10}  {fmt(cv['topk_recall'][k - 1]):>12}" if sel else ""
        extra += f"  {fmt(cv['nll'][k - 1]):>8}  {fmt(cv['confidence'][k - 1]):>10}" if scored else ""
        lines.append(f"{k:>3}   {fmt(a):>11}  {fmt(c):>12}  {fmt(t):>12}  {fmt(se[k - 1]):>5}{extra}")
    if sel:
        lines.append(
            "(DFlash2: accuracy(tf) is the selector walk's, unary(tf) the unary top-1's; top-k recall bounds both)"
        )
    if stride > 1:
        lines.append(
            f"(accuracy(tf): every {stride}th anchor (replay.tf_stride={stride}), a systematic sample; ± se over "
            f"prompts)"
        )
    if any(v is None for v in cv["accept_rate_cond"]):
        lines.append("(-: undefined, 0/0: no verify step reached that slot)")
    ref = info.references
    lines.append(
        f"{int(m['prompts'])} prompts, {int(m['new_tokens'])} new tokens, {int(m['steps'])} verify steps; references: "
        f"{ref.hits} cached, {ref.generated} generated; {ref.convention}"
    )
    if info.linear_attention_kernel or ref.engine:
        lines.append(
            "; ".join(
                filter(
                    None,
                    [
                        f"linear attention: {info.linear_attention_kernel}" if info.linear_attention_kernel else None,
                        f"references engine: {ref.engine}" if ref.engine else None,
                    ],
                )
            )
        )
    lines.append(f"prompts: {info.prompt_format}; replay: anchors={info.replay_anchors}, tf_stride={info.tf_stride}")
    lines.append("time (s): " + "  ".join(f"{k} {v:.1f}" for k, v in res.timings.items()))
    for s in samples[:1]:
        lines.append(f"-- sample {s.id} ({s.subset}): first blocks, [accepted] rest")
        for b in s.blocks[:max_blocks]:
            a, anchor = b.accepted, s.reference_pieces[b.anchor_pos - s.prompt_tokens]
            lines.append(f"   {anchor!r} -> [{''.join(b.proposal[:a])!r}] {''.join(b.proposal[a:])!r}  ({a} accepted)")
    for w in res.warnings:
        lines.append(f"WARNING: {w}")
    if where:
        lines.append(f"MLflow: {where}")
    return "\n".join(lines)


def markdown(res: EvalResult, prompts_label: str, target_name: str) -> str:
    """The run's description: τ ± SE, τ per subset, what was evaluated (drafter, target, prompts)."""
    m, info = res.metrics, res.info
    n = Counter(r.prompt.subset for r in res.prompts)
    ref = info.references
    ckpt = f", `{info.checkpoint_path}`" if info.checkpoint_path else ""
    sha = f" (sha256 `{info.checkpoint_sha256[:12]}`)" if info.checkpoint_sha256 else ""
    per_subset = ", ".join(f"{s} **{fmt(m.get(f'acceptance_length/{s}'))}** ({n[s]})" for s in sorted(n))
    lines = [
        f"**τ = {fmt(m.get('acceptance_length'))} ± {fmt(m.get('acceptance_length_se'))}**; per subset (prompts): "
        f"{per_subset}",
        "",
        f"τ: committed tokens per verify step, bonus included (plain decoding = 1); ± SE over {len(res.prompts)} "
        f"prompts. Expected from "
        f"teacher-forced accuracy {fmt(m.get('expected_acceptance_length'))}, per-prompt mean "
        f"{fmt(m.get('acceptance_length_macro'))}.",
        "",
        f"- **drafter**: {info.drafter_name} @ step "
        f"{info.drafter_step if info.drafter_step is not None else '-'}{ckpt}{sha}; "
        f"block {info.block_size}, taps {info.target_layer_ids}, mask id {info.mask_token_id}",
        f"- **target**: {target_name} (`{info.target_identity}`), {info.device}, {info.dtype}",
        f"- **prompts**: {prompts_label}: {len(res.prompts)} ({', '.join(f'{s} {n[s]}' for s in sorted(n))}); "
        f"{int(m.get('new_tokens') or 0)} new tokens, {int(m.get('steps') or 0)} verify steps; "
        f"references {ref.hits} cached, {ref.generated} generated",
    ]
    if (d := res.dspark) is not None:
        lines.append(
            f"- **DSpark**: τ without the Markov head {fmt(d.tau_unary)}; Markov gain {fmt(d.markov_gain, '+.3f')} ± "
            f"{fmt(d.markov_gain_se)} (paired SE); "
            + "; ".join(f"τ at confidence {r.threshold:g} {fmt(r.tau)}" for r in d.thresholds)
            + (f"; confidence Brier {fmt(d.brier, '.4f')} (`calibration.json`)" if d.slots else "")
        )
    if (c := res.convention) is not None:
        lines.append(
            f"- **slot convention check**: τ read in the other convention {fmt(c.other_tau)} "
            f"({fmt(c.gain, '+.3f')} ± {fmt(c.gain_se)}, paired SE)"
        )
    if "acceptance_length_unary" in m:
        lines.append(
            f"- **DFlash2**: unary τ (argmax, no selector) {fmt(m.get('acceptance_length_unary'))}; selector gain "
            f"{fmt(m.get('selector_gain'), '+.3f')} ± {fmt(m.get('selector_gain_se'))} (paired SE); expected τ of the "
            f"top-k ceiling {fmt(m.get('expected_acceptance_length_topk'))}"
        )
    if (pl := res.prompt_lookup) is not None:
        lines.append(
            f"- **prompt lookup** (the yardstick: vLLM's ngram, n {pl.min_n}..{pl.max_n}, {pl.k} drafted, same "
            f"references): "
            f"τ {fmt(pl.tau)} ± {fmt(pl.tau_se)}; drafter - prompt lookup {fmt(pl.gain, '+.3f')} ± {fmt(pl.gain_se)} "
            f"(paired SE)"
        )
    if m.get("leak_probe/acceptance_length") is not None:
        lines.append(
            f"- **leak probe**: τ {fmt(m['leak_probe/acceptance_length'])} with the anchor's own feature visible "
            f"(gain {fmt(m.get('leak_probe/tau_gain'), '+.3f')})"
        )
    lines += [f"- **warning**: {w}" for w in res.warnings]
    lines.append(
        "- artifacts: `samples.html` (each verify step's accepted / rejected / bonus tokens), `plots/`, "
        "`per_position.json`, "
        "`per_prompt.json` (what `dflash-compare` pairs), `config.yaml`"
    )
    return "\n".join(lines)


def sweep_markdown(name: str, table: Sequence[SweepRow], failed: Sequence[str], status: str, reason: str = "") -> str:
    """A sweep parent's description: one row per child (dflash.report.sweep.sweep_table), the failed jobs.
    Columns: run, the swept values, the data set (prompts.source) unless `prompts` is swept, τ ± SE,
    z-lab's published τ, Δτ ± paired SE against the first child that finished ("not paired", and why below the
    table, where dflash.report.pairs.align refused the pair)."""
    swept = list(table[0].values) if table else []
    if "prompts" not in swept and any(r.dataset for r in table):
        swept.append("dataset")
    base = next((r.paired_against for r in table if r.paired_against), None)
    once = yardstick_once(
        table
    )  # prompt lookup's τ, one value for the whole sweep; else a column where children differ
    per_child = once is None and any(r.prompt_lookup_tau is not None for r in table)
    lines = [f"**{name}**: {len(table)} children, ended {status}" + (f" ({reason})" if reason else "") + ".", ""]
    if table:
        head = " | ".join("data set" if k == "dataset" else k for k in swept)
        lines += [
            f"| run | {head} | τ ± SE | published τ | Δτ ± SE vs {base or '-'} |".replace("|  |", "|")
            + (" prompt lookup τ |" if per_child else ""),
            "| --- |" + " --- |" * (len(swept) + 3 + per_child),
        ]
        first = next((i for i, r in enumerate(table) if r.tau is not None), None)  # what the others are paired against
        unpaired = [i for i, r in enumerate(table) if i != first and r.tau is not None and r.not_paired]
        for i, r in enumerate(table):
            vals = "".join(f" {(r.dataset if k == 'dataset' else r.values.get(k)) or ''} |" for k in swept)
            delta = (
                "baseline"
                if i == first
                else "not paired"
                if i in unpaired
                else "-"
                if r.delta_tau is None
                else f"{fmt(r.delta_tau, '+.3f')} ± {fmt(r.delta_tau_se)}"
            )
            tau = "- (no result)" if r.tau is None else f"{fmt(r.tau)} ± {fmt(r.tau_se)}"
            pub = fmt(r.published_tau) + (" (another setting)" if r.published_differs else "")
            lines.append(
                f"| {r.run} |{vals} {tau} | {pub} | {delta} |" + (f" {fmt(r.prompt_lookup_tau)} |" if per_child else "")
            )
        if once is not None:
            lines += [
                "",
                f"Prompt lookup (the yardstick: vLLM's ngram on the same references, prompt_lookup.* params): τ "
                f"**{fmt(once)}**; "
                "a drafter that does not beat it is not worth serving.",
            ]
        if unpaired:  # compare.align refused them: why, naming the prompts or the tag that differs
            lines += [
                "",
                f"**Not paired with {base}** (their Δτ would mix drafter and data):",
                *[f"- {table[i].run}: {table[i].not_paired}" for i in unpaired],
            ]
    if other := [r for r in table if r.published_differs]:  # the published τ beside a run measured otherwise: say how
        lines += [
            "",
            "**Published τ measured in another setting** (z-lab 2026-01: 2048 new tokens, thinking off, hf_shuffle "
            "seed 0):",
            *[f"- {r.run}: {r.published_differs}" for r in other],
        ]
    if failed:
        lines += ["", f"**Failed jobs ({len(failed)})**:", *[f"- {f}" for f in failed]]
    if table:
        lines += [
            "",
            "Artifacts: `sweep/children.csv` (also τ per subset, z, paired-against), `sweep/tau.png`, "
            "`sweep/per_position.png`.",
        ]
    return "\n".join(lines)
