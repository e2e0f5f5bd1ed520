#!/usr/bin/env bash
# How the shipped drafters were trained: the lent H200 (device tool, README "Training"), in phases,
# one per device call, since one call carries at most 64 MiB and runs at most 10 minutes.
#   setup  install the carried wheels (.whl) and keep the first GGUF part (.gguf/p_aa)
#   train  join the GGUF parts, check them, train (or resume) all variants in lockstep until
#          MAX_MIN minutes, then pack the exported weights and metrics into $OUT
#   eval   evaluate every exported drafter on the GPU (evaluate.py device=cuda), reports to $OUT;
#          drafters carried in .gpu/ck*/<variant>/step_<N> join /root/ckpt first; BENCH=1 adds
#          python -m dflash.bench device=cuda (stage times and the online speedup)
# Env: STEPS (schedule length), MAX_MIN, EXPORTS ("[1000,3000]"), KEEP (step folders to bring back:
# "last" or a regex of folder paths, e.g. "fixed/step_(2000|4000)$|step_6000$"; ~9 fit in one call),
# VARIANTS ("[noisy_labels]": retrain some; batches and noise depend on (seed, step) only, so a variant
# trained alone sees what it saw in lockstep), STOP_AFTER (stop and export at this step, the schedule
# still spanning STEPS: how noisy_labels was retrained to 5037 after its first export was lost).
set -euo pipefail
PHASE=$1
G=/root/g; GGUF=$G/SmolLM2-135M-Instruct.Q4_1.gguf; SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p $G
case $PHASE in
setup)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  cp .gguf/p_aa $G/ ; for c in .gpu/ck*; do [ -d $c ] && mkdir -p /root/ckpt && cp -r $c/* /root/ckpt/; done
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv ;;
train)
  if [ ! -f $GGUF ]; then cp .gguf/p_ab $G/; cat $G/p_aa $G/p_ab > $GGUF; rm $G/p_a?; fi
  echo "$SHA  $GGUF" | sha256sum -c
  python3 -m dflash.train target.path=$GGUF "variants=${VARIANTS:-[fixed,noisy_labels,final_layer,loss_dilution]}" \
    optim.steps=${STEPS} optim.warmup_steps=150 optim.noise_std=0.3 optim.attention=sdpa \
    data.prompts_path=.gpu/train_prompts.jsonl data.gen_batch_size=${GEN_BS:-1024} \
    tracking.enabled=false out_dir=/root/runs export_dir=/root/ckpt "export_steps=${EXPORTS:-[]}" \
    save_every=100000 cache_dir=/root/cache max_minutes=${MAX_MIN} stop_after=${STOP_AFTER:-null} 2>&1 | tee $OUT/train.log
  cd /root
  if [ "${KEEP:-last}" = last ]; then sel=$(for v in ckpt/*; do ls -d $v/step_* | sort -t_ -k2 -n | tail -1; done)
  else sel=$(ls -d ckpt/*/step_* 2>/dev/null | grep -E "${KEEP}" || true); fi
  # one archive per step folder, metrics first, so a file the device tool leaves out (it brings back
  # about 64 MiB a call) costs that folder only; folders past the limit are named, not packed
  tar czf $OUT/metrics.tgz runs/*/metrics.jsonl runs/*/params.json $(ls runs/*/summary.json 2>/dev/null)
  for d in $sel; do
    f=$OUT/$(echo $d | tr / _).tgz; tar czf $f $d
    if [ $(du -cm $OUT/*.tgz | tail -1 | cut -f1) -gt 60 ]; then rm $f; echo "NOT BROUGHT BACK (over 60 MiB): $d"; fi
  done
  ls -la $OUT ;;
eval)
  if [ ! -f $GGUF ]; then cp .gguf/p_ab $G/; cat $G/p_aa $G/p_ab > $GGUF; rm $G/p_a?; fi
  echo "$SHA  $GGUF" | sha256sum -c
  for c in .gpu/ck*; do [ -d $c ] && mkdir -p /root/ckpt && cp -r $c/* /root/ckpt/; done
  for v in fixed noisy_labels final_layer loss_dilution; do
    python3 evaluate.py target.path=$GGUF drafter=$v drafter.run_dir=/root/ckpt/$v device=cuda \
      tracking.enabled=false cache_dir=/root/cache leak_probe=${LEAK:-false} 2>&1 | tee $OUT/eval_$v.log | tail -25
  done
  if [ "${BENCH:-0}" = 1 ]; then
    python3 -m dflash.bench --online 4 target.path=$GGUF drafter.run_dir=/root/ckpt/fixed device=cuda \
      tracking.enabled=false cache_dir=/root/cache 2>&1 | tee $OUT/bench.log | tail -30
  fi ;;
esac
