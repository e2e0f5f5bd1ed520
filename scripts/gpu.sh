#!/usr/bin/env bash
# On the lent GPU machine (the device tool), from the repo root: install the carried wheels once, keep
# the carried parts of the SmolLM2 GGUF, join them once all are there (checked against its sha256),
# then run a command with $GGUF set and the repo on PYTHONPATH.
#
# Here, once: .gpu/whl holds the wheels the machine lacks (hydra-core, omegaconf, antlr4 built with
# `pip wheel`, gguf), .gpu/tok SmolLM2's tokenizer (for `--scale`), and .gguf/p1..pN the GGUF in parts
# small enough that the tree (~41 MB) plus one part stay under a call's 64 MiB. Each call carries one
# part (`carry: [".gpu/whl", ".gguf/p1"]`); the machine keeps them between the calls of one lease (it
# goes back 30 s after a call).
#   bash scripts/gpu.sh python3 -m dflash.bench device=cuda target.path='$GGUF' ...
set -euo pipefail
G=/root/g; export GGUF=$G/SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DFLASH_CACHE_DIR=/root/cache
mkdir -p $G /root/cache
for f in .gguf/p?; do [ -f "$f" ] && cp "$f" $G/; done
if [ ! -f $GGUF ] && ls $G/p? >/dev/null 2>&1 && [ "$(cat $G/p? | sha256sum | cut -d' ' -f1)" = "$SHA" ]; then
  cat $G/p? > $GGUF && rm $G/p?
fi
echo "gguf: $(ls $G)"
eval "$@"
