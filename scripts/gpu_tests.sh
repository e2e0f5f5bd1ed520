#!/usr/bin/env bash
# The suite's CUDA cases on the lent GPU machine, in one call of the device tool, from the repo root:
#   run(command="bash scripts/gpu_tests.sh", carry=[".gpu/whl"])
# .gpu/whl: the wheels the machine lacks (hydra-core, omegaconf, antlr4, gguf, flash-linear-attention;
# scripts/gpu.sh says how they were built). Installs them into /tmp/site once, then runs tests/unit/test_cuda.py
# (device agreement, docs/tests.md) and every other test skipped without CUDA, log in $OUT/gpu_tests.log.
# Needs no mlflow (nothing these tests import reaches it) and no GGUF. Extra pytest arguments pass through
# (e.g. `bash scripts/gpu_tests.sh -k flex`).
set -euo pipefail
OUT=${OUT:-/tmp/out} PY=${PY:-python3} SITE=${SITE:-/tmp/site}  # PY, SITE: only to try the script elsewhere
mkdir -p "$OUT"
LOG=$OUT/gpu_tests.log
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$LOG"
[ -d "$SITE" ] || $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .gpu/whl/*.whl
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
$PY -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$LOG"
# skipped CUDA cases would pass silently: refuse to run without a GPU
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" 2>&1 | tee -a "$LOG"
# the CUDA-only tests elsewhere in the suite (grep 'needs CUDA' tests/): node ids
OTHERS=(
  tests/unit/test_decode.py::test_cuda_graphs_equal_eager
  tests/unit/test_drafter.py::test_flex_agrees_with_sdpa
  tests/unit/test_train.py::test_flex_and_dense_masks_give_the_same_loss
)
# test_cuda.py first: its fp32 flex cases compile before any other test has run flex under other settings
timeout 560 $PY -m pytest -q -rs -p no:cacheprovider -o faulthandler_timeout=240 --durations=12 \
  tests/unit/test_cuda.py "${OTHERS[@]}" "$@" 2>&1 | tee -a "$LOG"
