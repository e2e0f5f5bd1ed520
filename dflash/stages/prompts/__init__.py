"""The prompts stage: prompt sets and rendering (`sets`) and the field's benchmarks worded as published
(`benchmarks`)."""
