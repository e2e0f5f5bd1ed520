"""The static-cache decoding engine: `decode` (prefill, one-token steps, B-token verify, rollback; CUDA graphs),
`generator` (prompts decoded in batches on it: local references, target-only decoding), `gqa` (its attention)."""
