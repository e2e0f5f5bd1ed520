"""The Hydra presets of every config group (target, drafter, prompts, attention, device, references, suite) and the
trainer's train.yaml; their schemas: dflash/config/schema.py. A package, so an installed copy finds them."""
