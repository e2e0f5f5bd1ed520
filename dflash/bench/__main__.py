"""`python -m dflash.bench ...` (also `dflash-bench`): every cost ratio of the evaluator, measured in one run
(dflash/bench/suite.py)."""

from dflash.bench.suite import cli

cli()
