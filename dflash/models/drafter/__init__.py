"""The drafter: `config` (a config.json read as transformers / SGLang read it, or refused), `formats` (vLLM and
speculators configs translated first), `rope`, the modules (`model`: DFlash; `dflash2`, `dflash2_config`: DFlash2's
block convolutions and candidate selector), `layouts` (a training run's folder: which layout, which steps, which are
complete), `files` (a step's files: reading and writing the formats), `specforge` (SpecForge's unified payload and
its training contract over the launch JSON) and
`checkpoint` (read, fit to the target, build: three phases, so a drafter that cannot work fails before the target
loads)."""
