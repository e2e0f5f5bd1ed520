"""Shared fixtures: tiny random targets built from transformers config classes (no hub access).

- `qwen3_dir` / `qwen3_target`: a 6-layer Qwen3 causal LM (hidden 64, vocab 256) saved with
  `save_pretrained` plus a tiny WordLevel tokenizer with a chat template, loaded through
  `dflash.models.target.model.load_target('hf', ...)`.
- `vl_dir` / `vl_full` / `vl_target`: a tiny Qwen3.5 vision-language checkpoint
  (`Qwen3_5ForConditionalGeneration`), loaded through `load_target('vlm_text', ...)`.
- `make_drafter`: a factory for a tiny `DFlashDrafter` shaped for a target via
  `dflash.models.drafter.checkpoint.init_config`.

Everything heavy is session-scoped: each model is built and saved once. Tests live in `unit/` (one part, tiny
random models) and `e2e/` (a whole run through a command, or the real SmolLM2 target); a test file may take another's
fixtures and helpers by name, whichever folder it is in, so both folders are on the import path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path[:0] = [str(Path(__file__).parent / d) for d in ("unit", "e2e")]

VOCAB = 256
MASK_ID = 250  # a valid row of the tiny targets' embedding, used as the drafter's mask token

# Tokens "t0".."t255" map to ids 0..255. t3/t4 wrap a message; t5 is the generation prompt; t6 is
# appended after it when thinking is off (standing in for Qwen3's empty <think></think>).
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}t9 {% else %}t3 {% endif %}{{ m['content'] }} t4 {% endfor %}"
    "{% if add_generation_prompt %}t5 {% if not enable_thinking %}t6 {% endif %}{% endif %}"
)
GEN_PROMPT_THINKING_OFF = [5, 6]
GEN_PROMPT_THINKING_ON = [5]


def make_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t0")
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )


def qwen3_5_vl_config():
    from transformers import Qwen3_5Config

    text = dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=4,
        num_position_embeddings=16,
    )
    return Qwen3_5Config(text_config=text, vision_config=vision)


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> Path:
    from transformers import Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("qwen3_tiny")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(qwen3_config()).eval()
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def qwen3_target(qwen3_dir):
    from dflash.models.target.model import load_target

    return load_target("hf", str(qwen3_dir), dtype="float32", device="cpu", attn="sdpa")


@pytest.fixture(scope="session")
def vl_full_and_dir(tmp_path_factory):
    from transformers import Qwen3_5ForConditionalGeneration

    folder = tmp_path_factory.mktemp("qwen3_5_vl_tiny")
    torch.manual_seed(1)
    model = Qwen3_5ForConditionalGeneration(qwen3_5_vl_config()).eval()
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="session")
def vl_dir(vl_full_and_dir) -> Path:
    return vl_full_and_dir[1]


@pytest.fixture(scope="session")
def vl_full(vl_full_and_dir):
    return vl_full_and_dir[0]


@pytest.fixture(scope="session")
def vl_target(vl_dir):
    from dflash.models.target.model import load_target

    return load_target("vlm_text", str(vl_dir))


@pytest.fixture(scope="session")
def make_drafter():
    """make_drafter(target, num_layers=2, num_taps=3, block_size=4, seed=0, std=0.02, **init_config kwargs)."""
    from dflash.models.drafter.checkpoint import init_config
    from dflash.models.drafter.model import DFlashDrafter

    def make(
        target,
        num_layers: int = 2,
        num_taps: int = 3,
        block_size: int = 4,
        seed: int = 0,
        std: float = 0.02,
        mask_token_id: int = MASK_ID,
        target_layer_ids=None,
    ):
        cfg = init_config(target, num_layers, num_taps, mask_token_id, block_size, target_layer_ids)
        return DFlashDrafter(cfg).init_weights(seed, std=std).eval()

    return make


def loop_counters(c):  # every counter the draft-verify loop keeps (the teacher-forced ones are the replay's own)
    return (
        c.steps,
        c.drafted,
        c.accepted,
        c.committed,
        c.committed_uncapped,
        c.new_tokens,
        c.accepted_at_pos,
        c.commit_hist,
    )
