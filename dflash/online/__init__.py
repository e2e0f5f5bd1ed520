"""The online draft-verify loop (`speculative`, greedy, batch 1, on the static-cache engine): what the offline
replay reproduces without running it. Tests hold the two equal step by step; the bench times it against
target-only decoding (dflash/bench/speed.py)."""
