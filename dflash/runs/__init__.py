"""Training runs on disk, as the evaluator follows them: which step folders are ready to read (`watch`, over
dflash.models.drafter.layouts, which the loader reads too), and the trainer's own metrics read beside τ
(`trainlog`: metrics.jsonl, TensorBoard, MLflow; a restarted trainer's logs stitched)."""
