"""GPU timing before the real run: a random SmolLM2-shaped target (no weights needed), the four
lockstep variants, a few training steps; and batched greedy generation speed.

    PYTHONPATH=. python3 scripts/bench_train.py [steps] [batch] [blocks]
"""

import sys
import time

import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from dflash import train as T
from dflash.models.target.model import Target
from dflash.stages.references.collect import greedy_generate
from dflash.train.data import TrainSeq
from dflash.util.progress import configure

configure()  # the trainer's progress lines on stderr
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
bs = int(sys.argv[2]) if len(sys.argv) > 2 else 32
nb = int(sys.argv[3]) if len(sys.argv) > 3 else 32
c = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    eos_token_id=2,
    pad_token_id=2,
)
torch.manual_seed(0)
m = LlamaForCausalLM(c).cuda().eval().requires_grad_(False)
torch.backends.cuda.matmul.allow_tf32 = True
tgt = Target(model=m, tokenizer=None, identity="bench", source="bench", max_context=8192)
g = torch.Generator().manual_seed(0)
seqs = [
    TrainSeq(
        ids=torch.randint(3, 49152, (int(torch.randint(200, 512, (1,), generator=g)),), generator=g).tolist(),
        prompt_len=60,
    )
    for _ in range(bs * 8)
]
cfg = OmegaConf.merge(
    OmegaConf.structured(T.TrainConfig),
    {
        "target": {
            "name": "bench",
            "kind": "hf",
            "path": "-",
            "mask_token_id": 16,
            "default_taps": None,
            "template": {},
        },
        "device": {"name": "cuda", "threads": None},
        "tracking": {"enabled": False},
        "optim": {"steps": steps, "batch_size": bs, "blocks_per_seq": nb, "noise_std": 0.3, "warmup_steps": 2},
        "variants": ["fixed", "noisy_labels", "final_layer", "loss_dilution"],
        "out_dir": "/tmp/bench",
        "save_every": 10**6,
        "log_every": 5,
        "metrics_every": 5,
    },
)
t0 = time.time()
out = T.train(cfg, target=tgt, seqs=seqs)
print(f"BENCH train: {steps} steps x 4 variants in {time.time() - t0:.1f}s (compile included)")
for k, v in out.items():
    print("BENCH", k, f"tok/s {v['tokens_per_s']:.0f} wall {v['wall_time_s']:.1f}s")
print("BENCH peak mem GB", torch.cuda.max_memory_allocated() / 1e9)
for B in (256, 512):
    prompts = [
        torch.randint(3, 49152, (int(torch.randint(40, 120, (1,), generator=g)),), generator=g).tolist()
        for _ in range(B)
    ]
    torch.cuda.synchronize()
    t0 = time.time()
    outs = greedy_generate(tgt, prompts, 48, B)
    torch.cuda.synchronize()
    dt = time.time() - t0
    n = sum(len(o) for o in outs)
    print(f"BENCH generate batch {B}: {n} tokens in {dt:.1f}s = {n / dt:.0f} tok/s, {dt / 48 * 1000:.0f} ms/step")
