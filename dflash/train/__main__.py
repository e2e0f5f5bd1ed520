"""Entry point: `python -m dflash.train [group=choice] [key=value]` (Hydra, dflash/conf/train.yaml).

Trains every variant of the config and prints each one's summary as JSON. Under the evaluation's
exit policy (dflash/cli/app.py): bad input (a config value, a missing file or package) exits 2 with a
message that says what to fix, Ctrl-C / SIGTERM 130 / 143, a bug 1 with its traceback.
"""

from __future__ import annotations

import json
from typing import Any

import hydra
from omegaconf import DictConfig

from dflash.cli import app as entry
from dflash.config.train import TrainSchema
from dflash.train import register, train
from dflash.util.progress import configure

register()


def _train(cfg: DictConfig, ctx: entry.JobContext) -> None:
    configure()
    out: dict[str, dict[str, Any]] = train(cfg)
    print(
        json.dumps(
            {k: {kk: vv for kk, vv in v.items() if not kk.startswith("acc_clean_")} for k, v in out.items()}, indent=1
        )
    )


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    entry.run_job(_train, cfg)


def cli() -> None:
    """The console script `dflash-train`."""
    entry.main(main, TrainSchema)


if __name__ == "__main__":
    cli()
