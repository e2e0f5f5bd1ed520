"""Log training runs whose metrics were written without MLflow (the GPU machine has no MLflow) to
the local store: one MLflow run per run folder (metrics.jsonl, params.json, summary.json).

    PYTHONPATH=. python scripts/import_train_metrics.py checkpoints/fixed checkpoints/noisy_labels ...
"""

import os
import sys

from dflash.train import import_metrics

uri = os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
for d in sys.argv[1:]:
    print(d, "->", import_metrics(d, uri=uri))
