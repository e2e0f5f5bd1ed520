#!/usr/bin/env bash
# On the lent H200 (the device tool): install the carried wheels, keep the carried part of the
# SmolLM2 GGUF, then run a command. One call carries the tree (~40 MB) and one 21 MiB part
# (`split -b 21M <gguf> .gguf/part_`: part_aa .. part_ae, `carry: [".whl", ".gguf/part_aX"]`); the
# parts wait in /root/g and are joined, and checked against the GGUF's sha256, once all five are
# there (calls of one lease: the machine goes back 30 s after a call). $GGUF is the joined file.
#   bash scripts/gpu.sh python3 -m dflash.bench device=cuda target.path='$GGUF' ...
set -euo pipefail
G=/root/g; export GGUF=$G/SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p $G
for f in .gguf/part_a?; do [ -f "$f" ] && cp "$f" $G/; done
if [ ! -f $GGUF ] && [ "$(ls $G/part_a? 2>/dev/null | wc -l)" = 5 ]; then
  cat $G/part_a? > $GGUF && rm $G/part_a? && echo "$SHA  $GGUF" | sha256sum -c
fi
echo "gguf parts here: $(ls $G)"
eval "$@"
