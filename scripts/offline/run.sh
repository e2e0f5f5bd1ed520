#!/usr/bin/env bash
# Runs, on a GPU machine without internet access, what scripts/offline/bundle.sh bundled (docs/offline-gpu.md).
# From the unpacked bundle (or anywhere: it finds its folder):
#   bash run.sh check       every file against SHA256SUMS
#   bash run.sh setup       check, then a venv ($VENV, default ./venv) that sees the machine's CUDA torch
#                           (--system-site-packages), this project and its dependencies installed from wheels/ only
#   bash run.sh train       the training recipe (docs/training.md): `dflash-train` on the bundled GGUF and prompts
#   bash run.sh bench       `dflash-bench` on the GPU (the bundled drafter, or the newest export of BENCH_VARIANT)
#   bash run.sh tests       the suite's CUDA cases (tests/unit/test_cuda.py and every test skipped without CUDA)
#   bash run.sh pack        logs, the trainer's metrics and the newest export of each variant into $OUT, in archives
#                           of at most PART_MB MiB (pack.py), for the way back
# Everything is written under $WORK (default ./work): logs/, runs/ (checkpoints, metrics), ckpt/ (exports), cache/.
# Env for train: STEPS (schedule length, default 3200), MAX_MIN (stop and export after this many minutes, default
#   60), VARIANTS (default "[fixed]"), GEN_MIN (minutes of response generation, default 4), LR (default 1e-3),
#   OFFSET (data.prompt_offset), EXPORTS ("[1000,2000]": steps exported beside the last), INIT_FROM (an export folder
#   to warm-start from), INIT_VARIANT (the variant all start from), TRAIN_ARGS (more key=value overrides).
# Env for bench: BENCH_DRAFTER (a run folder of step_<N>/ exports), BENCH_VARIANT, BENCH_ARGS (e.g. "--online 12",
#   or "--scale qwen3_6_27b --scale-tokenizer tokenizer"). For tests: any arguments go to pytest.
# Env for pack: OUT (default ./out), PART_MB (default 15), EXTRA (a regex of more step folders to bring back).
set -euo pipefail
BUNDLE=$(cd "$(dirname "$0")" && pwd)
cd "$BUNDLE"
VENV=${VENV:-$BUNDLE/venv}
WORK=${WORK:-$BUNDLE/work}
OUT=${OUT:-$BUNDLE/out}
GGUF=$(ls "$BUNDLE"/model/*.gguf 2>/dev/null | head -1 || true)
export DFLASH_CACHE_DIR=$WORK/cache PYTHONUNBUFFERED=1
mkdir -p "$WORK/logs"
bin() { echo "$VENV/bin/$1"; }
need_setup() { [ -x "$(bin dflash-eval)" ] || { echo "run 'bash run.sh setup' first" >&2; exit 2; }; }
need_gguf() { [ -n "$GGUF" ] || { echo "no model/*.gguf in $BUNDLE" >&2; exit 2; }; }

check() { sha256sum --quiet -c SHA256SUMS && echo "bundle: every file matches SHA256SUMS"; }

setup() {
  check
  python3 -m venv --system-site-packages "$VENV"
  "$(bin pip)" install -q --no-index --find-links wheels dflash-eval
  ls wheels | grep -q '^pytest-' && "$(bin pip)" install -q --no-index --find-links wheels pytest  # for `tests`
  ls wheels | grep -q '^fla_core' && "$(bin pip)" install -q --no-index --find-links wheels "dflash-eval[gpu]"
  "$(bin python)" -c "import sys, torch, dflash; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.cuda.is_available(), 'dflash from', dflash.__file__)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
}

train() {
  need_setup && need_gguf
  [ -f prompts.jsonl ] || { echo "no prompts.jsonl in the bundle (bundle.sh PROMPTS=0)" >&2; exit 2; }
  local init=()
  [ -n "${INIT_FROM:-}" ] && init+=("init_from=$INIT_FROM")
  [ -n "${INIT_VARIANT:-}" ] && init+=("init_variant=$INIT_VARIANT")
  # the recipe's settings (docs/training.md); the rest are dflash/conf/train.yaml's defaults
  "$(bin dflash-train)" target.path="$GGUF" "variants=${VARIANTS:-[fixed]}" \
    optim.steps="${STEPS:-3200}" optim.warmup_steps=150 optim.noise_std=0.3 optim.attention=sdpa \
    optim.target_dtype=bfloat16 optim.max_seq_len=576 optim.lr="${LR:-1e-3}" drafter.selector_rank=16 \
    data.prompts_path="$BUNDLE/prompts.jsonl" data.num_prompts=100000 data.gen_batch_size=1024 data.shard_size=2048 \
    data.max_gen_minutes="${GEN_MIN:-4}" data.chat_prompt_tokens=384 data.prompt_offset="${OFFSET:-0}" \
    tracking.enabled=false out_dir="$WORK/runs" export_dir="$WORK/ckpt" "export_steps=${EXPORTS:-[]}" \
    save_every=100000 cache_dir="$WORK/cache" max_minutes="${MAX_MIN:-60}" "${init[@]}" ${TRAIN_ARGS:-} \
    2>&1 | tee "$WORK/logs/train.log"
}

bench() {
  need_setup && need_gguf
  local d=${BENCH_DRAFTER:-}
  if [ -z "$d" ] && [ -n "${BENCH_VARIANT:-}" ]; then d=$WORK/ckpt/$BENCH_VARIANT; fi
  [ -n "$d" ] || d=$(ls -d drafters/* 2>/dev/null | head -1)
  [ -d "$d" ] || { echo "no drafter to bench: set BENCH_DRAFTER or BENCH_VARIANT" >&2; exit 2; }
  (cd "$WORK" && "$(bin dflash-bench)" ${BENCH_ARGS:-} target.path="$GGUF" drafter.run_dir="$(cd "$BUNDLE" && realpath "$d")" \
    device=cuda tracking.enabled=false cache_dir="$WORK/cache") 2>&1 | tee "$WORK/logs/bench.log"
}

tests() {
  need_setup
  local log=$WORK/logs/gpu_tests.log
  # skipped CUDA cases would pass silently: refuse to run without a GPU
  "$(bin python)" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" \
    2>&1 | tee "$log"
  # the CUDA-only tests elsewhere in the suite (grep 'needs CUDA' tests/); test_cuda.py first: its fp32 flex cases
  # compile before any other test has run flex under other settings
  "$(bin python)" -m pytest -q -rs -p no:cacheprovider -o faulthandler_timeout=240 --durations=12 \
    tests/unit/test_cuda.py \
    tests/unit/test_decode.py::test_cuda_graphs_equal_eager \
    tests/unit/test_drafter.py::test_flex_agrees_with_sdpa \
    tests/unit/test_train.py::test_flex_and_dense_masks_give_the_same_loss \
    "$@" 2>&1 | tee -a "$log"
}

pack() {
  mkdir -p "$OUT"
  cd "$WORK"
  local sel=(logs)
  for f in runs/*/metrics.jsonl runs/*/summary.json; do [ -f "$f" ] && sel+=("$f"); done
  for v in ckpt/*; do
    [ -d "$v" ] || continue
    sel+=("$(ls -d "$v"/step_* | sort -V | tail -1)")
    if [ -n "${EXTRA:-}" ]; then while read -r d; do sel+=("$d"); done < <(ls -d "$v"/step_* | grep -E "$EXTRA" || true); fi
  done
  "$(command -v python3)" "$BUNDLE/pack.py" "$OUT" "$WORK" $(printf '%s\n' "${sel[@]}" | sort -u) --max-mb "${PART_MB:-15}"
}

case ${1:-} in
check) check ;;
setup) setup ;;
train) train ;;
bench) bench ;;
tests) shift; tests "$@" ;;
pack) pack ;;
*) sed -n '2,20p' "$0" >&2; exit 2 ;;
esac
