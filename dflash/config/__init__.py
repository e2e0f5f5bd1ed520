"""Configuration: the typed, strict schemas of every config group (`schema`: evaluation; `train`: training)
and their registration with Hydra. With dflash/cli/app.py and the entry points, the only code that knows Hydra."""
