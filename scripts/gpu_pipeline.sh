#!/bin/bash
# One H200 session's work after staging and `SMOKE=0 bash scripts/gpu_convert.sh`, on a 2-GPU machine
# (nvidia-h200-x2), started in the background so that it outlives the call that starts it (scripts/GPU_SESSION.md):
#     setsid nohup bash scripts/gpu_pipeline.sh > /tmp/pipeline.log 2>&1 < /dev/null &
# and watched by `bash scripts/gpu_collect.sh SECONDS` calls, each of which brings back what is finished so far.
#
# MODE=ddp (default): phase 1 trains the 1.5B drafter on both GPUs (torchrun, one rank per GPU: each regenerates
#   half of the data, gradients averaged) for L15 seconds; if that run fails it retrains on GPU 0 alone. Phase 2:
#   lane 0 benches the new drafter on the five benchmarks; lane 1 runs the engine's GPU parity check, AR step times
#   vs the floor, the cost model's predicted-vs-measured profile (issue 3) and the loop with its yardsticks on the
#   shipped 1.5B drafter (issue 5).
# MODE=single (one H200, session 17): train on the one GPU for L15 seconds (regeneration R15 of them), ship, then
#   bench the new drafter (ar,specpilot on the five benchmarks; the committed one when nothing beat the warm start),
#   the cost model's DFlash profile (predicted vs measured), and stock (z-lab's dflash) on STOCK_BENCH.
# MODE=lanes (session 8's layout): lane 0 trains on GPU 0 (lane 1 regenerates half of the data first), then benches;
#   lane 1 runs the checks, timings and the loop beside it, plus the loop's memory transfer to the 0.5B target.
# Results: /tmp/results (lane logs, bench JSON, optimize folders, step timings), drafters: /tmp/ship, runs: /tmp/runs.
# Lane 1's timings run beside lane 0's on another GPU of the same host (32 cores): noted with the figures.
# Knobs (environment): MODE, L15 / R15 (training / regeneration seconds), PROMPTS, DATA, REGEN_ORDER / REGEN_SEED
# (which prompts a budget-cut regeneration reaches: random by the clock by default; `long` = those the shipped
# drafter's shortest-first sessions never reached), REGEN_ATTN=1 (the split-KV attention kernel in the batched
# regeneration steps: scripts/gpu_regen_speed.py's `_attnkernel` variants say whether it pays), REGEN_KV_BUCKET
# (--regen-kv-bucket; both chosen from /tmp/regen_speed.json when unset and it exists), PACK=0 (MODE=single packs
# the regeneration cache right after training unless set), EARLY=1 (MODE=single: after the bench, SpecPilot again
# with --no-early-draft on EARLY_BENCH, default humaneval,mt_bench: EngineConfig.early_draft's A/B), KD (--kd-weight:
# that share of the loss against the target's own distributions), WARM_LR_SCALE (--warm-lr-scale: a warm start's
# carried parameters at LR x this, grown layers at LR), REGEN_BS (regeneration batch, default 256), CHECKS_BG
# (MODE=single: these gpu_engine_check.py sections in the background while training; BENCH=0 then skips the bench of
# an unchanged drafter), VAL_PROMPTS / VAL_TAU (validation split and the prompts its
# tau is decoded on: 32 / 24 gave ~2k tokens, too few to see a 0.03 change), DRAFT_LAYERS (a warm
# start grows to it: new layers start as no-ops, train/dflash_init.py grow_layers), ANCHORS (per sequence,
# default 64: the target pass is most of a step, more anchors reuse it), INIT15 (warm start; empty = new drafter),
# LR (peak; 3e-4 on a warm start; L15=0: no training, the loop and the checks start at once), BENCH=1 (with
# nothing shipped: bench the committed drafter on GPU 0, the checks and the loop on GPU 1; ARBENCH=1 then adds the
# 0.5B-drafter and n-gram benches on GPU 0 after the bench (MODE=single: after the profiles; ARBENCH_S seconds each,
# the slow peers on BASE prompts a benchmark); FULLCHECKS=1 adds the split-K GEMV and DFlash-step
# diagnostics to the checks), W15 (loop wall seconds), TRANSFER=1 (the 0.5B loops), COMPILE=1 (compiled step timings), STEP_S, PROFILES.
set -u
# Each device call copies the checkout over this one again, unchanged files included: an import or a script read
# while that copy runs fails (session 21: the n-gram profile died on `from specpilot.train import ...` while a
# collect call's copy was under way). So the pipeline runs from its own snapshot of the tree (staged pieces and git
# history left out).
if [ -z "${PIPELINE_SNAPSHOT:-}" ]; then
  rm -rf /tmp/pipeline-tree && mkdir -p /tmp/pipeline-tree || exit 1
  tar -C . --exclude=./.git --exclude='./.s[0-9][0-9]' --exclude='./.c[0-9][0-9]' -cf - . \
    | tar -C /tmp/pipeline-tree -xf - || exit 1
  cd /tmp/pipeline-tree && PIPELINE_SNAPSHOT=1 exec bash scripts/gpu_pipeline.sh "$@"
fi
source scripts/gpu_env.sh || exit 1
R=/tmp/results
mkdir -p $R
MODE=${MODE:-ddp}
P=${PROMPTS:-40000}
L15=${L15:-$([ $MODE = ddp ] && echo 480 || echo 720)}; R15=${R15:-240}; L05=${L05:-380}; R05=${R05:-130}
declare -A NAME=([q15]=dflash-qwen2.5-coder-1.5b [q05]=dflash-qwen2.5-coder-0.5b)
# the 1.5B drafter keeps training from the shipped one (INIT15= starts a new one)
INIT15=${INIT15-${NAME[q15]}}; WARM15=${INIT15:+--init-from $INIT15}
# a warm start continues at half the peak LR (session 10: 6e-4 re-warmed v1 and a short run ended below it)
LR=${LR:-$([ -n "$INIT15" ] && echo 3e-4 || echo 6e-4)}
# REGEN_ATTN / REGEN_KV_BUCKET / REGEN_BS unset and a call before staging left /tmp/regen_speed*.json
# (scripts/gpu_regen_speed.py's JSON line, one file per --batch tried): the fastest variant that ran sets them (its
# KV bucket, the split-KV kernel or not, its batch)
if [ -z "${REGEN_ATTN+x}${REGEN_KV_BUCKET+x}${REGEN_BS+x}" ] && ls /tmp/regen_speed*.json > /dev/null 2>&1; then
  read -r REGEN_KV_BUCKET REGEN_BS REGEN_ATTN < <(python3 scripts/regen_choice.py /tmp/regen_speed*.json)
  echo "regeneration step from /tmp/regen_speed*.json: kv bucket ${REGEN_KV_BUCKET:-default}, batch ${REGEN_BS:-256}, kernel ${REGEN_ATTN:-off}" >> $R/regen_choice.log
fi
COMMON="--device cuda --dtype bfloat16 --data ${DATA:-sharegpt=1,sharegpt_turns=1,mbpp=1} --num-prompts $P
 --regen-order ${REGEN_ORDER:-random} --regen-seed ${REGEN_SEED:-$(date +%s)} ${REGEN_ATTN:+--attention-kernel}
 ${REGEN_KV_BUCKET:+--regen-kv-bucket $REGEN_KV_BUCKET} ${KD:+--kd-weight $KD} ${WARM_LR_SCALE:+--warm-lr-scale $WARM_LR_SCALE}
 --val-prompts ${VAL_PROMPTS:-32} --val-tau-prompts ${VAL_TAU:-24} --regen-max-new-tokens 384 --regen-batch-size ${REGEN_BS:-256} --max-seq-len 1280
 --block-size 16 --draft-layers ${DRAFT_LAYERS:-2} --target-layers 3 --draft-intermediate-size 2048 --steps 20000 --batch-size 16
 --anchors-per-seq ${ANCHORS:-64} --length-buckets 32 --lr $LR --warmup-steps 100 --val-every 500 --save-every 0
 --fit-steps-to-time --no-progress"

ship() {  # the best checkpoint of run $1, int4, shards <= 15 MB; not when a warm start was never beaten
  local at; at=$(python3 -c "import json; print(json.load(open('/tmp/runs/$1/result.json')).get('best_step'))")
  if [ "$at" = 0 ]; then echo "not shipped: no checkpoint beat the warm start's validation tau"; return 1; fi
  python3 -m specpilot.cli export-drafter /tmp/runs/$1/best /tmp/ship/${NAME[$1]} --storage int4 --group-size 64 \
    --max-shard-mb 15 && echo "shipped ${NAME[$1]}"
}

pack_regen() {  # the grown regeneration cache, for the next session (gpu_collect.sh brings the parts back)
  [ "${PACK:-1}" = 1 ] && [ -d /tmp/runs/q15/regen ] && [ ! -e /tmp/regen-pack/DONE ] || return 0
  mkdir -p /tmp/regen-pack && python3 scripts/regen_cache.py pack /tmp/runs/q15/regen /tmp/regen-pack/regen-q15 \
    && touch /tmp/regen-pack/DONE && echo "[$(date +%T)] regeneration cache packed: $(ls /tmp/regen-pack | tr '\n' ' ')"
}

checks() {  # the engine's GPU parity check, the cost model's profiles, AR step times, the GEMV kernel (issue 3)
  timeout 300 python3 scripts/gpu_engine_check.py > $R/engine_check.log 2>&1
  tail -1 $R/engine_check.log
  echo "[$(date +%T)] fused-decode kernels: parity stress and per-launch times; a small drafter's step with them"
  timeout 200 python3 scripts/gpu_fused_check.py --only=gemv12,rope > $R/fused_check.log 2>&1  # (attention, 16-bit gemv: sessions 12-13)
  tail -1 $R/fused_check.log | cut -c1-300
  timeout 150 python3 scripts/gpu_model_draft_step.py --fused-decode > $R/model_draft_step.log 2>&1
  tail -1 $R/model_draft_step.log | cut -c1-300
  echo "[$(date +%T)] cost model: predicted vs measured (1.5B + n-gram, + the 0.5B drafter, + DFlash; PROFILES)"
  for k in ${PROFILES:-ngram model dflash}; do OUT=$R timeout 120 bash scripts/gpu_bench_ar_drafters.sh profile-$k 4 > $R/profile_$k.log 2>&1; done
  echo "[$(date +%T)] AR step timing (SDPA and the attention kernel; COMPILE=1 adds compiled steps, ~6 min)"
  timeout ${STEP_S:-120} python3 scripts/gpu_step_timing.py qwen2.5-1.5b qwen3-8b ${STEP_FLAGS:-$([ "${COMPILE:-0}" = 1 ] || echo --no-compile --variants=fuseddecode,fuseddecode_pdl,fuseddecode12,fuseddecode12pre)} \
    > $R/step_timing.log 2>&1
  tail -1 $R/step_timing.log
  [ "${FULLCHECKS:-0}" = 1 ] || return 0  # the rest was measured in session 11 (~330 s)
  echo "[$(date +%T)] Triton GEMV: split-K at M = 16 for narrow N vs cuBLAS and the one-launch kernel"
  timeout 180 python3 scripts/gpu_gemv_check.py --splitk-only > $R/gemv_check.log 2>&1  # (session 11 measured the rest)
  tail -1 $R/gemv_check.log | cut -c1-300
  echo "[$(date +%T)] DFlash step breakdown (draft graph vs host work, random weights at the 1.5B shapes)"
  timeout 150 python3 scripts/gpu_dflash_step.py > $R/dflash_step.log 2>&1
  tail -1 $R/dflash_step.log
}

loop_runs() {  # the loop with yardsticks on the shipped drafters (issue 5); TRANSFER=1 adds the 0.5B from memory / empty
  echo "[$(date +%T)] optimize q15"  # on this session's drafter once it is shipped, else the committed one
  local d15=${NAME[q15]}; [ $MODE = ddp ] && [ -e /tmp/ship/$d15/config.json ] && d15=/tmp/ship/$d15
  OUT=$R WALL_S=${W15:-360} bash scripts/gpu_optimize.sh q15 dflash $d15
  if [ "${TRANSFER:-$([ $MODE = lanes ] && echo 1 || echo 0)}" = 1 ]; then
    echo "[$(date +%T)] optimize q05 (memory of the q15 run)"
    OUT=$R WALL_S=${W05:-150} bash scripts/gpu_optimize.sh q05 dflash ${NAME[q05]}
    echo "[$(date +%T)] optimize q05 (empty memory)"
    OUT=$R WALL_S=${W05:-150} bash scripts/gpu_optimize.sh q05-empty dflash ${NAME[q05]}
  fi
}

ar_benches() {  # ARBENCH=1: issue 3's rows, the 0.5B drafter and n-grams vs our AR, transformers' AR and stock
  for k in model ngram; do
    echo "[$(date +%T)] bench 1.5B + $k (20 prompts x 3 benchmarks)"
    OUT=$R timeout ${ARBENCH_S:-420} bash scripts/gpu_bench_ar_drafters.sh $k 20 > $R/bench_$k.log 2>&1
    tail -3 $R/bench_$k.log | cut -c1-300
  done
}

bench15() {  # this session's drafter once shipped; BENCH=1 without one: the committed drafter (new engine defaults)
  echo "[$(date +%T)] bench q15"
  if [ -e /tmp/ship/${NAME[q15]}/config.json ]; then OUT=$R bash scripts/gpu_bench_dflash.sh q15 20
  elif [ "${BENCH:-0}" = 1 ]; then DRAFTER=${NAME[q15]} OUT=$R bash scripts/gpu_bench_dflash.sh q15 20; fi
}

if ls /tmp/regen-parts/regen-q15.*.jsonl.gz > /dev/null 2>&1; then  # carried from an earlier session
  python3 scripts/regen_cache.py unpack /tmp/runs/q15/regen /tmp/regen-parts/regen-q15.*.jsonl.gz > $R/regen_seed.log 2>&1
fi
if [ $MODE = single ]; then
  export CUDA_VISIBLE_DEVICES=0
  if [ -n "${CHECKS_BG:-}" ]; then  # engine-check sections beside the training (small fp32 models: exactness only)
    (timeout 400 python3 scripts/gpu_engine_check.py --only=$CHECKS_BG > $R/engine_check.log 2>&1) &
    CHECKS_PID=$!
  fi
  if [ "$L15" = 0 ]; then  # no training: the committed drafter's bench, profile and stock at once
    echo "[$(date +%T)] no training (L15=0)" > $R/lane0.log
  else
    echo "[$(date +%T)] train q15 on 1 GPU $(cat $R/regen_seed.log 2>/dev/null)" > $R/lane0.log
    timeout $((L15 + 90)) python3 -m specpilot.cli train-drafter --target /tmp/models/q15 --out /tmp/runs/q15 $COMMON \
      --time-limit-s $L15 --regen-budget-s $R15 $WARM15 > /tmp/runs/q15.log 2>&1
    tail -2 /tmp/runs/q15.log >> $R/lane0.log
    ship q15 >> $R/lane0.log 2>&1
    pack_regen >> $R/lane0.log 2>&1
  fi
  d=/tmp/ship/${NAME[q15]}; [ -e $d/config.json ] || d=${NAME[q15]}
  [ -n "${CHECKS_PID:-}" ] && wait $CHECKS_PID  # nothing else on the GPU while the timings below run
  {
    if [ "${BENCH:-1}" = 1 ] || [ "$d" != "${NAME[q15]}" ]; then  # BENCH=0: only a newly shipped drafter
      echo "[$(date +%T)] bench q15 ($d): ar,specpilot"
      DRAFTER=$d SYSTEMS=ar,specpilot TAG=spec OUT=$R bash scripts/gpu_bench_dflash.sh q15 20
    fi
    if [ "${EARLY:-0}" = 1 ]; then  # EngineConfig.early_draft A/B (on by default since session 19): the same prompts without it
      echo "[$(date +%T)] bench q15 ($d): ar,specpilot --no-early-draft on ${EARLY_BENCH:=humaneval,mt_bench}"
      DRAFTER=$d SYSTEMS=ar,specpilot TAG=noearly EXTRA=--no-early-draft OUT=$R bash scripts/gpu_bench_dflash.sh q15 20 $EARLY_BENCH
    fi
    for k in ${PROFILES:-dflash}; do  # PROFILES="dflash ngram model": issue 3's three (model needs q05 staged)
      echo "[$(date +%T)] cost model: $k profile"
      # (the 0.5B drafter's profile ran past 150 s in session 19: its own graphs are captured too)
      DFLASH=$d OUT=$R timeout $([ $k = model ] && echo 300 || echo 150) bash scripts/gpu_bench_ar_drafters.sh profile-$k 4 > $R/profile_$k.log 2>&1
      grep "predicted/measured" $R/profile_$k.log | cut -c1-300
    done
    [ "${ARBENCH:-0}" = 1 ] && ar_benches  # issue 3's rows: the 0.5B drafter and n-grams vs AR, hf-ar and stock
    if [ "${STOCK_BENCH:=humaneval,mt_bench}" != none ]; then
      echo "[$(date +%T)] stock on $STOCK_BENCH"
      DRAFTER=$d SYSTEMS=stock TAG=stock OUT=$R bash scripts/gpu_bench_dflash.sh q15 20 $STOCK_BENCH
    fi
    echo "[$(date +%T)] done"
  } >> $R/lane0.log 2>&1
  date > $R/DONE
  exit 0
fi
if [ $MODE = ddp ] && [ "$L15" = 0 ]; then  # no training (a short session): the loop beside the checks at once
  echo "[$(date +%T)] no training (L15=0)" > $R/lane0.log
fi
if [ $MODE = ddp ] && [ "$L15" != 0 ]; then
  echo "[$(date +%T)] train q15 on 2 GPUs $(cat $R/regen_seed.log 2>/dev/null)" > $R/lane0.log
  timeout $((L15 + 60)) python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m specpilot.cli train-drafter \
    --target /tmp/models/q15 --out /tmp/runs/q15 $COMMON --time-limit-s $L15 --regen-budget-s $R15 $WARM15 \
    > /tmp/runs/q15.log 2>&1
  if ! grep -q '"stage": "train"' /tmp/runs/q15/result.json 2>/dev/null; then  # fall back: one GPU, the time left
    echo "[$(date +%T)] data-parallel run failed (tail below); retraining on GPU 0" >> $R/lane0.log
    tail -20 /tmp/runs/q15.log >> $R/lane0.log
    mv /tmp/runs/q15 /tmp/runs/q15-ddp-failed; mv /tmp/runs/q15.log /tmp/runs/q15-ddp-failed.log
    CUDA_VISIBLE_DEVICES=0 python3 -m specpilot.cli train-drafter --target /tmp/models/q15 --out /tmp/runs/q15 \
      $COMMON --time-limit-s ${L15_FALLBACK:-420} --regen-budget-s 150 $WARM15 \
      --regen-dir /tmp/runs/q15-ddp-failed/regen > /tmp/runs/q15.log 2>&1  # what was regenerated is kept
  fi
  tail -2 /tmp/runs/q15.log >> $R/lane0.log
  ship q15 >> $R/lane0.log 2>&1
fi
if [ $MODE = ddp ]; then
  if [ -e /tmp/ship/${NAME[q15]}/config.json ]; then  # a new drafter: bench it on GPU 0, the rest on GPU 1
    (export CUDA_VISIBLE_DEVICES=0; bench15; echo "[$(date +%T)] done") >> $R/lane0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1; checks; loop_runs; echo "[$(date +%T)] done") > $R/lane1.log 2>&1 &
  elif [ "${BENCH:-0}" = 1 ]; then  # nothing shipped, BENCH=1: bench the committed drafter, checks then the loop
    (export CUDA_VISIBLE_DEVICES=0; bench15; [ "${ARBENCH:-0}" = 1 ] && ar_benches
     echo "[$(date +%T)] done") >> $R/lane0.log 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1; checks; loop_runs; echo "[$(date +%T)] done") > $R/lane1.log 2>&1 &
  else  # nothing shipped: the loop (on the committed drafter) on GPU 0 beside the checks on GPU 1
    (export CUDA_VISIBLE_DEVICES=0; loop_runs; echo "[$(date +%T)] done") >> $R/lane0.log 2>&1 &
    # GPU 1 has time for the compiled steps with the kernel (issue 3's AR-step bars: the best the engine runs)
    # (Inductor's compile workers limited: the loop times runs on GPU 0 of the same host meanwhile)
    (export CUDA_VISIBLE_DEVICES=1 STEP_S=${STEP_S:-300} STEP_FLAGS=${STEP_FLAGS:---compiled-kernel-only} \
       TORCHINDUCTOR_COMPILE_THREADS=8; checks
     echo "[$(date +%T)] done") > $R/lane1.log 2>&1 &
  fi
  wait
else
  lane0() {
    export CUDA_VISIBLE_DEVICES=0
    echo "[$(date +%T)] train q15"
    python3 -m specpilot.cli train-drafter --target /tmp/models/q15 --out /tmp/runs/q15 $COMMON \
      --time-limit-s $L15 --regen-budget-s $R15 --regen-shard 0/2 $WARM15 > /tmp/runs/q15.log 2>&1
    tail -2 /tmp/runs/q15.log
    ship q15
    bench15
    echo "[$(date +%T)] done"
  }
  lane1() {
    export CUDA_VISIBLE_DEVICES=1
    echo "[$(date +%T)] regen q15 shard 1/2"
    python3 -m specpilot.cli train-drafter --target /tmp/models/q15 --out /tmp/runs/q15-helper $COMMON \
      --regen-dir /tmp/runs/q15/regen --regen-shard 1/2 --regen-only --regen-budget-s $((R15 - 10)) \
      > /tmp/runs/q15-helper.log 2>&1
    checks
    loop_runs
    if [ "${TRAIN05:-0}" = 1 ]; then
      echo "[$(date +%T)] train q05"
      python3 -m specpilot.cli train-drafter --target /tmp/models/q05 --out /tmp/runs/q05 $COMMON \
        --time-limit-s $L05 --regen-budget-s $R05 > /tmp/runs/q05.log 2>&1
      tail -2 /tmp/runs/q05.log
      ship q05
    fi
    echo "[$(date +%T)] done"
  }
  lane0 > $R/lane0.log 2>&1 &
  lane1 > $R/lane1.log 2>&1 &
  wait
fi
date > $R/DONE
