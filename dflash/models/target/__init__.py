"""The target: `model` (inspect without weights, load), `forward` (the one place that knows transformers' forward and
cache API; the tapped forward), `weights` (files, identity, GGUF conversion), `kernels` (a hybrid target's Gated
DeltaNet kernels), `sampling` (the target's token at temperature T, position-keyed)."""
