"""`python -m dflash [group=choice] [key=value]`: the evaluation, as `dflash-eval` runs it (dflash/cli/evaluate.py)."""

from dflash.cli.evaluate import cli

cli()
