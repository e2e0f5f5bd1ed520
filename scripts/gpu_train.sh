#!/usr/bin/env bash
# The shipped drafter set's training on the lent GPU (device tool; docs/training.md), in calls of one lease.
# Each call sends /work/main's tree plus what it carries (64 MiB in all). Build what they carry, here,
# once per checkout: `bash scripts/gpu_prep.sh` (.gpu/whl the wheels, .gpu/p0, p1 the SmolLM2 GGUF in two xz parts,
# .gpu/q0..q1 the training prompts in two parts, .gpu/tok.tar.xz SmolLM2's tokenizer), and move the tree's checkpoints/,
# docs/ and scripts/results/ out for the lease (the tree then weighs ~1.4 MB). Then, each call within 30 s of the last
# (the machine goes back after 30 s idle), every call copying the tree's code to the machine:
#   1 `bash scripts/gpu_train.sh stage`  carry [.gpu/whl, .gpu/p0, .gpu/q0, .gpu/q1]
#   2 `VARIANTS=... STEPS=... GEN_MIN=... MAX_MIN=... bash scripts/gpu_train.sh train` carry [.gpu/p1] (and a warm start's
#     export, .gpu/init/<variant>, up to 24 MB): joins and
#     checks the GGUF and the prompts, regenerates the data (data.max_gen_minutes), trains every variant in lockstep
#     until MAX_MIN, packs the last export of each variant (scripts/pack_out.py: archives of <= 15 MiB, a larger
#     export in parts) and the metrics and training log (metrics.tgz) into $OUT
#   3 `GEN_MIN=0.01 ... train` (no carry, same machine): resumes from the checkpoints on the machine's disk (the
#     trainer resumes by itself), data from its cache
# A bench without training: `stage` as in 1, then `PACK='^$' BENCH=1 BENCH_VARIANT=<name> BENCH_SKIP=replay,generation,scale
# BENCH_ARGS="--online-eager --sweep-profile" bash scripts/gpu_train.sh post` carrying [.gpu/p1, .gpu/bench/<name>] (an export
# folder <name>/step_<N>/, e.g. from `make drafters`).
# Here: `cat packN.tgz.* | tar xz` joins an export that came back in parts.
# Rounds (their logs in scripts/results/): train_h100_2026-12-06.log (one layer, the bugs, the DFlash2 twin, a
# two-layer probe); train_h100_2026-12-06b.log: call 4 with VARIANTS="[fixed,fixed-l4,fixed-l4-dflash2]" STEPS=4400
# GEN_MIN=3 MAX_MIN=8.7 EXPORTS="[1000,2000,3000]", call 5 with the same and GEN_MIN=0.01 MAX_MIN=6.6.
# train_h100_2026-12-07.log: a continuation, a warm start (INIT=1: .gpu/init/<variant>/step_<N>/, round b's exports from
# `make drafters`, carried by a call, holds the exports it starts from) on prompts round b did not reach (OFFSET), then
# BENCH=1 on it; staged in two calls with the tree's large folders moved out (docs/training.md).
# train_h100_2026-12-07b.log: the three bugs and their twin, all warm-started from the default's export (INIT_VARIANT), staged
# in one call, trained in one, a `post` call for the other two exports and the bench.
# Env: MAX_MIN (minutes from the process start), STEPS (schedule length), LR, VARIANTS, GEN_MIN, OFFSET (data.prompt_offset),
# INIT, INIT_VARIANT (every variant starts from .gpu/init/<INIT_VARIANT>/: one export carried for all), EXPORTS, EXTRA (a
# regex of step folders to bring back beside each variant's last, e.g. "fixed/step_1000$"), PACK (a regex: only the step folders
# it matches come back, e.g. "^$" none, when four 24 MB exports would overrun one call's 64 MiB; `post` alone brings the rest); after training, BENCH=1 (the
# bench on BENCH_VARIANT's exports, default fixed; BENCH_SKIP its sections skipped, BENCH_ARGS e.g. --online-eager), CURVE=1 (tau by step of CURVE_VARIANTS' exports, default fixed), EVAL2=1 (the
# newest export of EVAL2_VARIANT, default fixed-dflash2, as `drafter=hf`); their logs and outputs come back in logs.tgz.
set -euo pipefail
R=/root/w; GGUF=$R/SmolLM2-135M-Instruct.Q4_1.gguf; SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 DFLASH_CACHE_DIR=$R/cache
mkdir -p $R/cache $R/logs
stage() {
  if [ -d .gpu/whl ] && [ ! -d /tmp/site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl
  fi
  for f in .gpu/p? .gpu/q?; do [ -f "$f" ] && cp "$f" $R/; done
  if [ -d .gpu/init ]; then mkdir -p $R/init && cp -r .gpu/init/* $R/init/; fi  # exports a warm start begins from (INIT=1)
  if [ -d .gpu/bench ]; then mkdir -p $R/ckpt && cp -r .gpu/bench/* $R/ckpt/; fi  # exports benched without training (`post`, BENCH=1)
  if [ ! -f $R/prompts.jsonl ] && [ -f $R/q0 ] && [ -f $R/q1 ]; then
    cat $R/q0 $R/q1 | python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.decompress(sys.stdin.buffer.read()))" > $R/prompts.jsonl && rm $R/q?
  fi
  if [ -d dflash ]; then rm -rf $R/code && mkdir $R/code && cp -r dflash conf scripts evaluate.py pyproject.toml $R/code/; fi  # the tree's code
  if [ -f .gpu/tok.tar.xz ]; then mkdir -p $R/tok && tar xJf .gpu/tok.tar.xz -C $R/tok; fi
  if [ ! -f $GGUF ] && ls $R/p? >/dev/null 2>&1; then  # the parts carried so far: joined once they decompress to the GGUF
    if cat $R/p? | python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.decompress(sys.stdin.buffer.read()))" > $GGUF.part 2>/dev/null \
       && echo "$SHA  $GGUF.part" | sha256sum -c --quiet; then mv $GGUF.part $GGUF && rm $R/p?; else rm -f $GGUF.part; echo "gguf: not all parts yet"; fi
  fi
  ls -la $R; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
}
post() {  # after training: the metrics, the exports (PACK), then BENCH / CURVE / EVAL2
  cd $R
  m=$(ls runs/*/metrics.jsonl runs/*/summary.json runs/train.log 2>/dev/null || true); [ -z "$m" ] || tar czf $OUT/metrics.tgz $m
  sel=$(for v in ckpt/*; do ls -d $v/step_* | sort -V | tail -1; if [ -n "${EXTRA:-}" ]; then ls -d $v/step_* | grep -E "$EXTRA" || true; fi; done | sort -u | grep -E "${PACK:-.}" || true)
  [ -z "$sel" ] || python3 $R/code/scripts/pack_out.py $OUT $R $sel
  ls -la $OUT
  if [ "${BENCH:-0}" = 1 ]; then
    cd $R/code; bv=${BENCH_VARIANT:-fixed}; last=$(ls -d $R/ckpt/$bv/step_* | sort -V | tail -1)
    python3 -m dflash.bench --skip ${BENCH_SKIP:-generation,scale} ${BENCH_ARGS:-} --online ${ONLINE:-12} target.path=$GGUF drafter.run_dir=$R/ckpt/$bv \
      device=cuda tracking.enabled=false cache_dir=$R/cache > $R/logs/bench.log 2>&1 || echo "BENCH FAILED: $?"
    grep -v "it/s\]$" $R/logs/bench.log | tail -40 || true
    echo "bench drafter: $last"
  fi
  if [ "${CURVE:-0}" = 1 ]; then  # tau by training step of every variant's exports, on the GPU (docs/training-runs.md)
    cd $R/code
    for v in ${CURVE_VARIANTS:-fixed}; do
      python3 evaluate.py target.path=$GGUF drafter=training drafter.run_dir=$R/ckpt/$v drafter.step=all device=cuda \
        tracking.enabled=false cache_dir=$R/cache hydra.run.dir=$R/evals/curve_$v > $R/logs/curve_$v.log 2>&1 || echo "CURVE $v FAILED: $?"
      grep -E "tau|step" $R/logs/curve_$v.log | grep -v "it/s\]$" | tail -12 || true
    done
  fi
  if [ "${EVAL2:-0}" = 1 ]; then  # issue 27: a DFlash2 folder evaluated as a user would, on the GPU
    cd $R/code; d2=$(ls -d $R/ckpt/${EVAL2_VARIANT:-fixed-dflash2}/step_* | sort -V | tail -1)
    python3 evaluate.py target.path=$GGUF drafter=hf drafter.path=$d2 device=cuda tracking.enabled=false cache_dir=$R/cache \
      hydra.run.dir=$R/evals/dflash2 > $R/logs/eval_dflash2_cuda.log 2>&1 || echo "EVAL2 FAILED: $?"
    grep -v "it/s\]$" $R/logs/eval_dflash2_cuda.log | tail -40 || true
  fi
  cd $R && tar czf $OUT/logs.tgz logs evals 2>/dev/null || true
}
case $1 in
stage) stage ;;
train)
  stage; cd $R/code
  python3 -m dflash.train target.path=$GGUF "variants=${VARIANTS:-[fixed,noisy_labels,final_layer,loss_dilution,fixed-dflash2,fixed-l2,fixed-t5]}" \
    optim.steps=${STEPS:-3200} optim.warmup_steps=150 optim.noise_std=0.3 optim.attention=sdpa optim.target_dtype=bfloat16 \
    optim.max_seq_len=576 drafter.selector_rank=16 \
    data.prompts_path=$R/prompts.jsonl data.num_prompts=100000 data.gen_batch_size=1024 data.shard_size=2048 \
    data.max_gen_minutes=${GEN_MIN:-4} data.chat_prompt_tokens=384 \
    tracking.enabled=false out_dir=$R/runs export_dir=$R/ckpt "export_steps=${EXPORTS:-[]}" \
    save_every=100000 cache_dir=$R/cache max_minutes=${MAX_MIN} optim.lr=${LR:-1e-3} data.prompt_offset=${OFFSET:-0} \
    $( [ "${INIT:-0}" = 1 ] && echo init_from=$R/init ) $( [ -n "${INIT_VARIANT:-}" ] && echo init_variant=$INIT_VARIANT ) \
    > $OUT/train.log 2>&1 || echo "TRAIN FAILED: $?"
  grep -E "data:|variant |step [0-9]+/|stopping|Error|error" $OUT/train.log | tail -80 || true
  cd $R; cp $OUT/train.log runs/ 2>/dev/null || true; rm -f $OUT/train.log
  post ;;
post) stage; post ;;
esac
