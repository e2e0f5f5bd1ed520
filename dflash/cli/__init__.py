"""The commands: `dflash-eval` (`evaluate`: the Hydra app; `python -m dflash`, `python evaluate.py` in a clone),
`dflash-compare` (`compare`: two runs paired prompt by prompt) and what every Hydra entry point shares (`app`: the
job's context, `-m` sweeps and their MLflow parent, the exit policy). `dflash-train` and `dflash-bench` live with
their code (dflash/train/__main__.py, dflash/bench/)."""
