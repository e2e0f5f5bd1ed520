"""Entry point: `python -m dflash.train [group=choice] [key=value]` (Hydra, conf/train.yaml).

Trains every variant of the config and prints each one's summary as JSON. Bad input (a config
value, a missing file or package) exits with status 2 and a message that says what to fix.
"""

from __future__ import annotations

import json
import sys

import hydra
from omegaconf import DictConfig

from dflash.errors import UserError, exit_code, install_signal_handlers, verbose
from dflash.progress import configure
from dflash.train import register, train

register()


@hydra.main(version_base="1.3", config_path="../../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    configure()
    install_signal_handlers()
    try:
        out = train(cfg)
    except UserError as e:
        if verbose():
            raise
        print(f"dflash-train: error: {e}", file=sys.stderr)
        sys.exit(exit_code(e))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if not kk.startswith("acc_clean_")} for k, v in out.items()}, indent=1))


if __name__ == "__main__":
    main()
