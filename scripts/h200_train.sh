#!/usr/bin/env bash
# How the shipped drafters were trained: the lent H200 (device tool, docs/training.md), in phases,
# one per device call, since one call carries at most 64 MiB and runs at most 10 minutes.
#   setup  install the carried wheels (.whl), keep the GGUF part(s) carried (.gguf/p_aa, p_ab), restore
#          a carried state (.gpu/state/state.tgz: data cache and checkpoint.pt, from PACK_STATE=1)
#   train  join the GGUF parts, check them, train (or resume) all variants in lockstep until
#          MAX_MIN minutes, then pack the exported weights and metrics into $OUT (PACK_STATE=1: also
#          the training data and the last checkpoint.pt of each variant, ~50 MB for one variant)
# A resume on a fresh machine: call 1 setup carrying .whl and .gpu (state.tgz inside), call 2 setup
# carrying .gguf/p_aa, call 3 train carrying .gguf/p_ab and .gpu/train_prompts.jsonl (each call within
# 30 s of the last: the device tool gives the machine back after 30 s idle).
#   eval   evaluate every exported drafter on the GPU (evaluate.py device=cuda), reports to $OUT;
#          drafters carried in .gpu/ck*/<variant>/step_<N> join /root/ckpt first; BENCH=1 adds
#          python -m dflash.bench device=cuda (stage times and the online speedup)
# Env: STEPS (schedule length), NOISE (optim.noise_std, default 0.3; 0.7 for the noise07 pair), MAX_MIN, EXPORTS ("[1000,3000]"), KEEP (step folders to bring back:
# "last" or a regex of folder paths, e.g. "fixed/step_(2000|4000)$|step_6000$"; ~9 fit in one call),
# VARIANTS ("[noisy_labels]": retrain some; batches and noise depend on (seed, step) only, so a variant
# trained alone sees what it saw in lockstep), STOP_AFTER (stop and export at this step, the schedule
# still spanning STEPS: how noisy_labels was retrained to 5037 after its first export was lost).
set -euo pipefail
PHASE=$1
G=/root/g; GGUF=$G/SmolLM2-135M-Instruct.Q4_1.gguf; SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p $G
stage() {  # keep whichever GGUF parts this call carried (join them once both are here), carried drafters
  for f in .gguf/p_a?; do [ -f $f ] && cp $f $G/; done
  if [ ! -f $GGUF ] && [ -f $G/p_aa ] && [ -f $G/p_ab ]; then cat $G/p_aa $G/p_ab > $GGUF && rm $G/p_a?; fi
  for c in .gpu/ck*; do [ -d $c ] && mkdir -p /root/ckpt && cp -r $c/* /root/ckpt/; done
  return 0
}
pack() {  # pack paths into $OUT/$1.tgz unless $OUT would pass 60 MiB (the device tool brings back ~64)
  local f=$OUT/$1.tgz; shift; tar czf $f "$@"
  if [ $(du -cm $OUT/*.tgz | tail -1 | cut -f1) -gt 60 ]; then rm $f; echo "NOT BROUGHT BACK (over 60 MiB): $*"; fi
}
case $PHASE in
setup)
  [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  stage
  for f in .gpu/state/*.tgz; do [ -f $f ] && tar xzf $f -C /root && echo "restored $f"; done
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv ;;
train)
  stage; echo "$SHA  $GGUF" | sha256sum -c
  python3 -m dflash.train target.path=$GGUF "variants=${VARIANTS:-[fixed,noisy_labels,final_layer,loss_dilution]}" \
    optim.steps=${STEPS} optim.warmup_steps=150 optim.noise_std=${NOISE:-0.3} optim.attention=sdpa \
    data.prompts_path=.gpu/train_prompts.jsonl data.gen_batch_size=${GEN_BS:-1024} \
    tracking.enabled=false out_dir=/root/runs export_dir=/root/ckpt "export_steps=${EXPORTS:-[]}" \
    save_every=100000 cache_dir=/root/cache max_minutes=${MAX_MIN} stop_after=${STOP_AFTER:-null} 2>&1 | tee $OUT/train.log
  cd /root
  if [ "${KEEP:-last}" = last ]; then sel=$(for v in ckpt/*; do ls -d $v/step_* | sort -t_ -k2 -n | tail -1; done)
  else sel=$(ls -d ckpt/*/step_* 2>/dev/null | grep -E "${KEEP}" || true); fi
  # one archive per step folder, metrics first, so a file the device tool leaves out (it brings back
  # about 64 MiB a call) costs that folder only; folders past the limit are named, not packed
  pack metrics runs/*/metrics.jsonl runs/*/params.json $(ls runs/*/summary.json 2>/dev/null)
  for d in $sel; do pack $(echo $d | tr / _) $d; done
  if [ "${PACK_STATE:-0}" = 1 ]; then  # what a later machine needs to resume: the data, the last checkpoint.pt
    pack state cache/train_data $(for v in runs/*; do ls -d $v/step_* 2>/dev/null | sort -t_ -k2 -n | tail -1; done)
  fi
  ls -la $OUT ;;
eval)
  stage; echo "$SHA  $GGUF" | sha256sum -c
  for v in fixed noisy_labels final_layer loss_dilution; do
    python3 evaluate.py target.path=$GGUF drafter=$v drafter.run_dir=/root/ckpt/$v device=cuda \
      tracking.enabled=false cache_dir=/root/cache leak_probe=${LEAK:-false} 2>&1 | tee $OUT/eval_$v.log | tail -25
  done
  if [ "${BENCH:-0}" = 1 ]; then
    python3 -m dflash.bench --online 4 target.path=$GGUF drafter.run_dir=/root/ckpt/fixed device=cuda \
      tracking.enabled=false cache_dir=/root/cache 2>&1 | tee $OUT/bench.log | tail -30
  fi ;;
esac
