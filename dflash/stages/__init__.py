"""The evaluation's stages, in data-flow order: `prompts/` (prompt sets, the field's benchmarks, chat-template
rendering, multi-turn rounds) -> `references/` (the target's completions: local, or from an SGLang / OpenAI-compatible
server, cached) -> `features` (the tapped hidden states, cached) -> `replay/` (DFlash's draft-verify loop replayed
offline: `loop`, the drafter's side `drafts`, the prompt-lookup yardstick) -> `metrics` (raw counters and every ratio
derived from them). Each stage takes and returns typed data; dflash/evaluation/pipeline.py runs them in order."""
