"""What a person reads: the console summary and run descriptions (`console`), PNG plots (`plots`), the sample
generations (`samples`), two runs paired prompt by prompt (`pairs`), a sweep's table of its children (`sweep`),
a training run evaluated step by step, in words (`training_run`).
Plain functions over results and per-prompt rows; no MLflow here."""
