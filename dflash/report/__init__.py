"""What a person reads: the console summary and run descriptions (`console`), PNG plots (`plots`), the sample
generations (`samples`), two runs paired prompt by prompt (`compare`), a sweep's table of its children (`sweep`).
Plain functions over results and per-prompt rows; no MLflow here."""
