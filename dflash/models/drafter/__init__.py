"""The drafter: `config` (a config.json read as transformers / SGLang read it, or refused), `formats` (vLLM and
speculators configs translated first), `rope`, the modules (`model`: DFlash; `dflash2`, `dflash2_config`: DFlash2's
block convolutions and candidate selector), `files` (where a step lives, reading and writing the formats) and
`checkpoint` (read, fit to the target, build: three phases, so a drafter that cannot work fails before the target
loads)."""
