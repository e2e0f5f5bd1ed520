#!/usr/bin/env bash
# On the lent H200 (the device tool), from /work/main with `carry: [".gpu"]`: .gpu/src holds the code
# (dflash/, conf/), .gpu/whl the wheels the machine lacks (hydra-core, omegaconf, antlr4), .gpu/fla
# flash-linear-attention's (fla-core, flash-linear-attention), .gpu/tok SmolLM2's tokenizer.
#   bash .gpu/src/scripts/gpu_scale.sh [fla] -- <bench arguments>
# The 27B folder is built under /root/cache/bench on the first call of a lease and reused after.
set -euo pipefail
G=$PWD/.gpu
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $G/whl/*.whl
[ -d /tmp/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla $G/fla/*.whl
P=/tmp/site
if [ "${1:-}" = fla ]; then P=/tmp/fla:$P; fi
shift; [ "${1:-}" = -- ] && shift
export PYTHONPATH=$G/src:$P PYTHONUNBUFFERED=1 DFLASH_CACHE_DIR=/root/cache
mkdir -p /root/cache
cd $G/src
python3 -m dflash.bench --skip sweep,online,generation --scale qwen3_6_27b --scale-tokenizer $G/tok tracking.enabled=false "$@"
