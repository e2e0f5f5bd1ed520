"""The models: the drafter (`drafter/`: its config read as the serving engines read it, or refused; the DFlash and
DFlash2 modules; checkpoint files and loading), the target (`target/`: inspect without weights, load, the tapped
forward and KV-cache glue, weight files and GGUF conversion, position-keyed sampling) and the static-cache decoding
engine (`engine/`: local references on GPU, the online loop's target)."""
