"""dflash-eval: evaluation harness for DFlash speculative-decoding drafters (see README.md)."""
