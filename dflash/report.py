"""Console report: the short summary a run prints (pure formatting of an EvalResult)."""

from __future__ import annotations

from dflash.pipeline import EvalResult


def summary(res: EvalResult, where: str | None = None, max_blocks: int = 6) -> str:
    m, info = res.metrics, res.info
    lines = [
        f"== {info.run_name}  ({info.device}, {info.dtype}, block {info.block_size}, taps {info.target_layer_ids})",
        f"acceptance length τ (bonus included, token-weighted): {m['acceptance_length']:.3f} ± {m['acceptance_length_se']:.3f} (SE over prompts)   "
        f"macro (per-prompt mean): {m['acceptance_length_macro']:.3f}   expected from accuracy: {m['expected_acceptance_length']:.3f}",
    ]
    if info.drafter_config:
        lines.append("drafter config: " + ", ".join(f"{k}={v}" for k, v in info.drafter_config.items()) + f"; stop ids {info.stop_ids}")
    subsets = sorted(k.split("/", 1)[1] for k in m if k.startswith("acceptance_length/"))
    if subsets:
        lines.append("τ per subset: " + "   ".join(f"{s} {m[f'acceptance_length/{s}']:.3f}" for s in subsets))
    if "leak_probe/acceptance_length" in m:
        lines.append(f"leak probe: τ with the anchor's own feature visible {m['leak_probe/acceptance_length']:.3f} (gain {m['leak_probe/tau_gain']:+.3f})")
    cv = res.curves
    if "nll" in cv:
        lines.append(f"NLL of the reference token (tf, nats): {m['nll_mean']:.3f} ± {m['nll_mean_se']:.3f}   overconfidence (confidence - accuracy): {m['overconfidence']:+.3f}")
    lines.append("pos   accept(cum)  accept(cond)  accuracy(tf)" + ("   nll(tf)  confidence" if "nll" in cv else ""))
    for k, (a, c, t) in enumerate(zip(cv["accept_rate"], cv["accept_rate_cond"], cv["accuracy"]), start=1):
        scores = f"  {cv['nll'][k - 1]:>8.3f}  {cv['confidence'][k - 1]:>10.3f}" if "nll" in cv else ""
        lines.append(f"{k:>3}   {a:>11.3f}  {c:>12.3f}  {t:>12.3f}{scores}")
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
