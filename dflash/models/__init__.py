"""The models, loaded: the target (`target`: inspect without weights, load, KV-cache glue, tapped forward;
`weights`: files, identity, GGUF conversion, finite check) and the drafter (`drafter_config`: config.json read as
transformers / SGLang read it, or refused; `drafter`: the DFlash drafter; `checkpoint`: finding, reading, checking,
fitting and saving checkpoints)."""
