"""Training runs on disk, as the evaluator follows them: which step folders a run holds and which are complete
(`watch`), and the trainer's own metrics read beside τ (`trainlog`: metrics.jsonl, TensorBoard, MLflow)."""
