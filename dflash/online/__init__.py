"""Online decoding, for what the offline replay cannot measure: the static-cache decode engine (`decode`: CUDA
graphs, local references on GPU), the online draft-verify loop (`speculative`: losslessness tests, speed-up) and
speed measurements (`speed`, used by dflash/bench.py)."""
