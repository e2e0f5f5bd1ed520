"""The served τ: a server's own per-request speculative counters, kept beside its reference (docs/family.md §7).

SGLang's `/generate` answers `meta_info.completion_tokens` and `spec_verify_ct` (verify steps; its
`spec_accept_length` = completion_tokens / spec_verify_ct, bonus included) when a speculative algorithm
runs, and a per-step histogram under one of three spellings (`spec_accept_histogram`, then
`spec_accepted_drafts` / `spec_proposed_drafts` without one, now `spec_correct_drafts_histogram`:
steps by drafted tokens accepted). vLLM with `--per-request-spec-decode-metrics summary` answers
`metrics.speculative_decoding` (`num_spec_steps`, `num_accepted_draft_tokens`, `mean_acceptance_length`,
`acceptance_histogram`) beside `usage.completion_tokens`. An answer without them ran no speculation:
`None`, and nothing is logged (never 0).

Convention. The server's completion tokens include the first token, which the prefill produces with
no verify step; the offline replay's τ (`acceptance_length`) counts only what verify steps commit. The
like-for-like offline figure is therefore `new_tokens / steps` (the prefill's token counted as the
server counts it): `served_metrics` logs it as `served/offline_like` and the gap offline − served
over the same prompts with its paired SE (`metrics.paired_ratio_diff`, prompts as the unit).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dflash.stages.metrics import Counters, paired_ratio_diff, ratio


@dataclass(frozen=True)
class Served:
    """One request's speculative counters as the server reported them."""

    completion_tokens: int
    verify_steps: int
    accept_length: float | None = None  # the server's own per-request τ
    histogram: tuple[int, ...] | None = None  # steps by drafted tokens accepted (index 0: none accepted)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: Any) -> "Served | None":
        try:
            return Served(
                int(d["completion_tokens"]),
                int(d["verify_steps"]),
                d.get("accept_length"),
                tuple(d["histogram"]) if d.get("histogram") else None,
            )
        except (KeyError, TypeError, ValueError):
            return None


def _ints(v: Any) -> tuple[int, ...] | None:
    return tuple(int(x) for x in v) if isinstance(v, list) and v and all(isinstance(x, int) for x in v) else None


def sglang_served(meta: Any) -> Served | None:
    """SGLang's meta_info -> Served, or None where it reports no speculation."""
    if not isinstance(meta, dict):
        return None
    ct, steps = meta.get("completion_tokens"), meta.get("spec_verify_ct")
    if not isinstance(ct, int) or not isinstance(steps, int) or steps <= 0:
        return None
    hist = _ints(meta.get("spec_correct_drafts_histogram")) or _ints(meta.get("spec_accept_histogram"))
    tau = meta.get("spec_accept_length")
    return Served(ct, steps, float(tau) if isinstance(tau, (int, float)) else None, hist)


def vllm_served(answer: Any) -> Served | None:
    """An OpenAI-compatible answer from vLLM -> Served (metrics.speculative_decoding), or None."""
    spec = (
        answer.get("metrics", {}).get("speculative_decoding")
        if isinstance(answer, dict) and isinstance(answer.get("metrics"), dict)
        else None
    )
    ct = (
        answer.get("usage", {}).get("completion_tokens")
        if isinstance(answer, dict) and isinstance(answer.get("usage"), dict)
        else None
    )
    if (
        not isinstance(spec, dict)
        or not isinstance(ct, int)
        or not isinstance(spec.get("num_spec_steps"), int)
        or spec["num_spec_steps"] <= 0
    ):
        return None
    tau = spec.get("mean_acceptance_length")
    return Served(
        ct,
        spec["num_spec_steps"],
        float(tau) if isinstance(tau, (int, float)) else None,
        _ints(spec.get("acceptance_histogram")),
    )


def served_metrics(pairs: list[tuple[Counters, Served]]) -> dict[str, float | None]:
    """Offline counters and served counters of the same prompts -> the served metrics (empty: none served)."""
    if not pairs:
        return {}
    ct, vs = [s.completion_tokens for _, s in pairs], [s.verify_steps for _, s in pairs]
    new, steps = [c.new_tokens for c, _ in pairs], [c.steps for c, _ in pairs]
    gap, se = paired_ratio_diff(ct, vs, new, steps)  # offline (new_tokens / steps) - served
    return {
        "served/acceptance_length": ratio(sum(ct), sum(vs)),
        "served/acceptance_length_macro": ratio(sum(a / b for a, b in zip(ct, vs)), len(pairs)),
        "served/offline_like": ratio(sum(new), sum(steps)),
        "served/gap": gap,
        "served/gap_se": se,
        "served/prompts": float(len(pairs)),
    }


def served_histogram(served: list[Served]) -> list[float | None]:
    """The served share of verify steps by tokens committed (drafts accepted + 1), summed over prompts; [] without
    histograms."""
    hists = [s.histogram for s in served if s.histogram]
    if not hists:
        return []
    n = max(map(len, hists))
    total = [sum(h[i] for h in hists if i < len(h)) for i in range(n)]
    return [ratio(x, sum(total)) for x in total]
