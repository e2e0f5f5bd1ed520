"""`python evaluate.py [group=choice] [key=value]` in a clone: the same Hydra app as the installed `dflash-eval`
(dflash/cli/evaluate.py; its config is dflash/conf/)."""

from dflash.cli.evaluate import cli

if __name__ == "__main__":
    cli()
