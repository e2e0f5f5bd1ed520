"""What an evaluation warns about (or refuses) beyond its inputs' own checks: prompts that measured nothing, a thinking
mode a public drafter was not trained with, sequences past the drafter's sliding window, a drafter that reads better in
the other slot convention (`convention_warning`); how prompts were rendered."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from dflash.config.schema import EvalConfig, TemplateConfig
from dflash.models.drafter.config import DrafterConfig
from dflash.stages.metrics import ConventionCheck
from dflash.util.errors import ReferenceError
from dflash.util.progress import log

if TYPE_CHECKING:
    from dflash.result import PromptResult


def check_measured(
    results: list[PromptResult], source: str, drop: Callable[[list[list[int]]], int] | None = None
) -> list[str]:
    """Prompts whose replay made no verify step measured nothing: all of them is an error (exit 2, the
    run ends FAILED) and `drop(prompt ids)` removes those refused references from the cache (-> how many
    were there), so the next run asks again; some is a warning naming them. -> the warnings."""
    empty = [r for r in results if r.counters.steps == 0]
    if not empty:
        return []
    named = ", ".join(
        f"{r.prompt.id} ({len(r.reference)} new token{'' if len(r.reference) == 1 else 's'})" for r in empty[:5]
    )
    what = (
        f"{len(empty)} of {len(results)} prompts had no verify step: {named}{', ...' if len(empty) > 5 else ''} (the "
        f"first new token "
        "comes from the prefill: a reference of one token leaves nothing to draft; it stopped at once)"
    )
    if len(empty) == len(results):
        dropped = drop([r.prompt_ids for r in results]) if drop is not None else 0
        gone = f"; their {dropped} cached references were removed, so the next run asks again" if dropped else ""
        raise ReferenceError(
            f"nothing was measured: {what}{gone}. Check the references (references={source}: does the server stop at "
            f"once, "
            "e.g. a stop token or a chat template of its own?) or raise prompts.max_new_tokens"
        )
    log.warning("%s; they count in no ratio", what)
    return [f"{what}; they count in no ratio"]


def prompt_format(t: TemplateConfig) -> str:
    """target.template in words, as the summary prints it: the thinking mode is explicit (docs/family.md §3, §7)."""
    if not t.use_chat_template:
        return "no chat template" + (", system prompt set" if t.system_prompt else "")
    return f"chat template, thinking {'on' if t.enable_thinking else 'off'}" + (
        ", system prompt set" if t.system_prompt else ""
    )


def window_warning(dc: DrafterConfig, mode: str, longest: int) -> list[str]:
    """A warning when sequences outgrow the drafter's sliding window: there SGLang (window applied) and z-lab's
    sdpa / eager loop (window ignored) draft differently, and the τ measured follows drafter.sliding_window
    (docs/family.md §6)."""
    w = dc.sliding_window
    if w is None or "sliding_attention" not in dc.layer_types or longest <= w:
        return []
    how = (
        "applies it, as SGLang serves the drafter" if mode == "apply" else "ignores it, as z-lab sdpa / eager loop does"
    )
    other = "ignore" if mode == "apply" else "apply"
    msg = (
        f"sequences reach {longest} tokens, past the drafter's sliding window of {w}: drafter.sliding_window={mode} "
        f"{how}; with drafter.sliding_window={other} τ differs on these sequences (docs/family.md §6)"
    )
    log.warning(msg)
    return [msg]


PUBLIC_NO_THINKING = (
    "qwen3-4b-dflash",
    "qwen3-8b-dflash",
)  # z-lab trained these without thinking traces (docs/family.md §7)


def thinking_warning(cfg: EvalConfig) -> list[str]:
    """A warning when a Qwen3-4B/8B public drafter is evaluated with target.template.enable_thinking=true."""
    d = cfg.drafter
    names = " ".join(str(x).lower() for x in (d.name, d.path, d.run_dir) if x)
    if not cfg.target.template.enable_thinking or not any(n in names for n in PUBLIC_NO_THINKING):
        return []
    w = (
        "target.template.enable_thinking=true with a Qwen3-4B/8B public DFlash drafter: z-lab trained these without "
        "thinking traces and "
        "publishes their τ with thinking off; this τ is not comparable (set target.template.enable_thinking=false)"
    )
    log.warning(w)
    return [w]


def convention_warning(dc: DrafterConfig, check: ConventionCheck | None, z_min: float) -> list[str]:
    """The slot-convention trap (docs/dspark.md): the drafter read in the other convention reaches a τ at least z_min
    paired SEs above the served one -> a warning naming the key and value that make a server read it that way."""
    if check is None or check.z is None or check.z < z_min:
        return []
    figures = (
        f"read in the other slot convention it reaches τ {check.other_tau:.3f} against {check.tau:.3f} as read "
        f"(+{check.gain:.3f} ± {check.gain_se:.3f}, z = {check.z:.1f}, paired over prompts)"
    )
    if dc.dspark is not None:
        now, want = ("true", "false") if dc.dspark.sample_from_anchor else ("false", "true")
        return [
            f"slot convention: {figures}. SGLang reads the slot convention from the top-level key sample_from_anchor "
            f"only (read here as {now}; absent means true): the drafter looks trained with sample_from_anchor: {want}, "
            f"and a server reading it as it is would accept about one token per step. If that is how it was trained, "
            f"set sample_from_anchor: {want} at the top level of config.json"
        ]
    return [
        f"slot convention: {figures}. The drafter looks trained in the anchor convention (every block row a "
        "proposal: sample_from_anchor: true, as DeepSpec's DFlash drafters are), while a DFlash server (SGLang's "
        "DFLASH) reads it in DFlash's convention whatever its config says. Readers with sample_from_anchor: true "
        "(speculators' config field, sglang-jax's --speculative-sample-from-anchor) read it the other way; check "
        "how it was trained"
    ]
