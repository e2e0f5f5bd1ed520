"""Reference DFlash trainer, with the three training bugs of docs/family.md §4 as switches (off by default).

    dflash-train [target=...] [device=...] [key=value ...]      (or python -m dflash.train; dflash/conf/train.yaml)

Per step, for S sequences (prompt + the target's greedy response):
- one target pass taps every layer the variants need (`hidden_states[L + 1]` for tap L);
- N anchors per sequence are sampled inside the response; each block is `[anchor, mask, ..., mask]`
  at positions p .. p+B-1 and sees the context features of positions t < p and its own block,
  bidirectionally (drafter.visibility_mask on CPU, the same mask as a flex_attention BlockMask on CUDA);
- labels of slot k >= 1 are the target's greedy tokens at p + k (the regenerated sequence);
- loss: cross-entropy weighted by exp(-(k-1)/gamma), normalised by the weight sum over valid slots;
- AdamW, linear warm-up then cosine decay, gradient clipping, bf16 autocast on CUDA; optional
  Gaussian noise (relative to each position's RMS) on the fc inputs only.
`drafter.arch=dflash2` adds DFlash2's convolutions and selector (its CE beside the loss); `drafter.arch=dspark`
trains DSpark as SpecForge does (docs/training.md, "DSpark"): gamma rows each a proposal, row j labelled with
the token at p + j + 1, the Markov bias teacher-forced, CE + L1 to the target's distribution + the confidence
head's BCE toward 1 - TV.

The config's schema (dflash/conf/train.yaml), registered with Hydra, and its field checks live in
dflash/config/train.py. Files here, in the order data flows:
    prompts.py      training prompts (corpus.py's word lists), none overlapping an evaluation prompt
    data.py         the target regenerates every response; token cache
    variants.py     the bug switches: which variant has which bug, bug 2's taps
    arch.py         the drafter built: taps, DrafterConfig, initial weights
    batch.py        batches and anchors, functions of (seed, step)
    taps.py         the one entry to the target's hidden states (dflash.models.target.forward.tapped_forward)
    labels.py       greedy labels, augmentation noise, bug 1's labels
    loss.py         the weighted loss and bug 3's diluted one
    step.py         one optimizer step of one variant, its counters
    metrics.py      ratios of summed counters; metrics.jsonl and MLflow (through dflash.tracking)
    checkpoints.py  resumable checkpoints, weights-only exports
    loop.py         the loop: variants in lockstep, one target pass per step
    __main__.py     the Hydra entry point
"""

from dflash.config.train import TrainConfig, register
from dflash.train.loop import train
from dflash.train.metrics import import_metrics

__all__ = ["TrainConfig", "import_metrics", "register", "train"]
