"""The evaluation's stages, in data-flow order: `prompts` (prompt sets, chat-template rendering) ->
`references` (the target's completions, local or from a `server`, cached) -> `features` (the tapped hidden
states, cached) -> `replay` (DFlash's draft-verify loop replayed offline) -> `metrics` (raw counters and every
ratio derived from them). Each stage takes and returns typed data; dflash/pipeline.py runs them in order."""
