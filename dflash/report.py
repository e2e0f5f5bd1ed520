"""Console report: the short summary a run prints (pure formatting of an EvalResult).

Undefined values (None: a ratio over nothing, see dflash.metrics) print as "-", never as 0.
"""

from __future__ import annotations

from dflash.pipeline import EvalResult


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def summary(res: EvalResult, where: str | None = None, max_blocks: int = 6) -> str:
    m, info = res.metrics, res.info
    g = m.get
    lines = [
        f"== {info.run_name}  ({info.device}, {info.dtype}, block {info.block_size}, taps {info.target_layer_ids})",
        f"acceptance length τ (bonus included, token-weighted): {fmt(g('acceptance_length'))} ± {fmt(g('acceptance_length_se'))} (SE over prompts)   "
        f"macro (per-prompt mean): {fmt(g('acceptance_length_macro'))}   expected from accuracy: {fmt(g('expected_acceptance_length'))}",
    ]
    subsets = sorted(k.split("/", 1)[1] for k in m if k.startswith("acceptance_length/"))
    if subsets:
        lines.append("τ per subset: " + "   ".join(f"{s} {fmt(m[f'acceptance_length/{s}'])}" for s in subsets))
    if "leak_probe/acceptance_length" in m:
        lines.append(f"leak probe: τ with the anchor's own feature visible {fmt(g('leak_probe/acceptance_length'))} (gain {fmt(g('leak_probe/tau_gain'), '+.3f')})")
    cv = res.curves
    scored = "nll" in cv
    if scored:
        lines.append(f"NLL of the reference token (tf, nats): {fmt(g('nll_mean'))} ± {fmt(g('nll_mean_se'))}   "
                     f"overconfidence (confidence - accuracy): {fmt(g('overconfidence'), '+.3f')}")
    lines.append("pos   accept(cum)  accept(cond)  accuracy(tf)" + ("   nll(tf)  confidence" if scored else ""))
    for k, (a, c, t) in enumerate(zip(cv["accept_rate"], cv["accept_rate_cond"], cv["accuracy"]), start=1):
        extra = f"  {fmt(cv['nll'][k - 1]):>8}  {fmt(cv['confidence'][k - 1]):>10}" if scored else ""
        lines.append(f"{k:>3}   {fmt(a):>11}  {fmt(c):>12}  {fmt(t):>12}{extra}")
    if any(v is None for v in cv["accept_rate_cond"]):
        lines.append("(-: undefined, 0/0: no verify step reached that slot)")
    ref = info.references
    lines.append(
        f"{int(m['prompts'])} prompts, {int(m['new_tokens'])} new tokens, {int(m['steps'])} verify steps; references: "
        f"{ref.hits} cached, {ref.generated} generated"
    )
    lines.append("time (s): " + "  ".join(f"{k} {v:.1f}" for k, v in res.timings.items()))
    for s in res.samples[:1]:  # dflash.samples records
        lines.append(f"-- sample {s['id']} ({s['subset']}): first blocks, [accepted] rest")
        for b in s["blocks"][:max_blocks]:
            a, anchor = b["accepted"], s["reference_pieces"][b["anchor_pos"] - s["prompt_tokens"]]
            lines.append(f"   {anchor!r} -> [{''.join(b['proposal'][:a])!r}] {''.join(b['proposal'][a:])!r}  ({a} accepted)")
    for w in res.warnings:
        lines.append(f"WARNING: {w}")
    if where:
        lines.append(f"MLflow: {where}")
    return "\n".join(lines)
