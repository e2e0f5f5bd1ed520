"""The yardstick's MLflow names: prompt lookup's τ beside the drafter's (dflash/stages/prompt_lookup.py).

Logged with a run's metrics (undefined values are not logged): `prompt_lookup/acceptance_length` (± `_se`,
over prompts) and `prompt_lookup/gain`, the drafter's τ minus it over the same prompts (± `gain_se`, paired).
Its settings are the run's params `prompt_lookup.*`. A sweep reads the τ back (`PROMPT_LOOKUP_TAU`).
"""

from __future__ import annotations

from typing import Optional

from dflash.stages.prompt_lookup import PromptLookup

PROMPT_LOOKUP_TAU = "prompt_lookup/acceptance_length"
PROMPT_LOOKUP_TAU_SE = "prompt_lookup/acceptance_length_se"
PROMPT_LOOKUP_GAIN = "prompt_lookup/gain"
PROMPT_LOOKUP_GAIN_SE = "prompt_lookup/gain_se"


def prompt_lookup_metrics(p: Optional[PromptLookup]) -> dict[str, float | None]:
    """The yardstick as metrics (empty when it was not computed)."""
    if p is None:
        return {}
    return {PROMPT_LOOKUP_TAU: p.tau, PROMPT_LOOKUP_TAU_SE: p.tau_se, PROMPT_LOOKUP_GAIN: p.gain, PROMPT_LOOKUP_GAIN_SE: p.gain_se}
