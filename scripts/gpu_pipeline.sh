#!/bin/bash
# One H200 session's work after staging and `SMOKE=0 bash scripts/gpu_convert.sh`, on a 2-GPU machine
# (nvidia-h200-x2), started in the background so that it outlives the call that starts it (scripts/GPU_SESSION.md):
#     setsid nohup bash scripts/gpu_pipeline.sh > /tmp/pipeline.log 2>&1 < /dev/null &
# and watched by `bash scripts/gpu_collect.sh SECONDS` calls, each of which brings back what is finished so far.
#   lane 0 (GPU 0): train the 1.5B drafter (ShareGPT first and later turns + MBPP, regenerating half of the data:
#                   shard 0/2) -> int4 export -> bench it on the five benchmarks
#   lane 1 (GPU 1): regenerate the other half (shard 1/2) while the engine's GPU parity check runs -> AR step
#                   times vs the floor and the cost model's predicted vs measured step (issue 3) -> the loop (issue 5) on the shipped 1.5B drafter with its
#                   yardsticks (our AR, z-lab's loop), then the 0.5B from that memory and from an empty one
#                   -> (TRAIN05=1) train the 0.5B drafter
# Results: /tmp/results (lane logs, bench JSON, optimize folders, step timings), drafters: /tmp/ship, runs: /tmp/runs.
# Lane 1's timings run beside lane 0's on another GPU of the same host (32 cores): noted with the figures.
set -u
source scripts/gpu_env.sh || exit 1
R=/tmp/results
mkdir -p $R
P=${PROMPTS:-40000}
L15=${L15:-720}; R15=${R15:-240}; L05=${L05:-380}; R05=${R05:-130}
COMMON="--device cuda --dtype bfloat16 --data ${DATA:-sharegpt=1,sharegpt_turns=1,mbpp=1} --num-prompts $P
 --val-prompts 32 --val-tau-prompts 8 --regen-max-new-tokens 384 --regen-batch-size 256 --max-seq-len 1280
 --block-size 16 --draft-layers 2 --target-layers 3 --draft-intermediate-size 2048 --steps 20000 --batch-size 16
 --anchors-per-seq 32 --length-buckets 32 --lr 6e-4 --warmup-steps 100 --val-every 500 --save-every 0
 --fit-steps-to-time --no-progress"
declare -A NAME=([q15]=dflash-qwen2.5-coder-1.5b [q05]=dflash-qwen2.5-coder-0.5b)

ship() {  # the best checkpoint of run $1, int4, shards <= 15 MB
  python3 -m specpilot.cli export-drafter /tmp/runs/$1/best /tmp/ship/${NAME[$1]} --storage int4 --group-size 64 \
    --max-shard-mb 15 && echo "shipped ${NAME[$1]}"
}

lane0() {
  export CUDA_VISIBLE_DEVICES=0
  echo "[lane0 $(date +%T)] train q15"
  python3 -m specpilot.cli train-drafter --target /tmp/models/q15 --out /tmp/runs/q15 $COMMON \
    --time-limit-s $L15 --regen-budget-s $R15 --regen-shard 0/2 > /tmp/runs/q15.log 2>&1
  tail -2 /tmp/runs/q15.log
  ship q15
  echo "[lane0 $(date +%T)] bench q15"
  OUT=$R bash scripts/gpu_bench_dflash.sh q15 20
  echo "[lane0 $(date +%T)] done"
}

lane1() {
  export CUDA_VISIBLE_DEVICES=1
  echo "[lane1 $(date +%T)] regen q15 shard 1/2 + engine check"
  python3 -m specpilot.cli train-drafter --target /tmp/models/q15 --out /tmp/runs/q15-helper $COMMON \
    --regen-dir /tmp/runs/q15/regen --regen-shard 1/2 --regen-only --regen-budget-s $((R15 - 10)) \
    > /tmp/runs/q15-helper.log 2>&1 &
  timeout 300 python3 scripts/gpu_engine_check.py > $R/engine_check.log 2>&1
  wait
  tail -1 $R/engine_check.log
  echo "[lane1 $(date +%T)] AR step timing (SDPA and the attention kernel; COMPILE=1 adds compiled steps, ~6 min)"
  timeout ${STEP_S:-150} python3 scripts/gpu_step_timing.py qwen2.5-1.5b qwen3-8b $([ "${COMPILE:-0}" = 1 ] || echo --no-compile) \
    > $R/step_timing.log 2>&1
  tail -1 $R/step_timing.log
  echo "[lane1 $(date +%T)] cost model: predicted vs measured (1.5B + n-gram; PROFILES='ngram model' for both)"
  for k in ${PROFILES:-ngram}; do OUT=$R timeout 150 bash scripts/gpu_bench_ar_drafters.sh profile-$k 4 > $R/profile_$k.log 2>&1; done
  for m in q15 q05; do
    echo "[lane1 $(date +%T)] optimize $m (memory of earlier runs)"
    OUT=$R WALL_S=$([ $m = q15 ] && echo ${W15:-300} || echo ${W05:-150}) \
      bash scripts/gpu_optimize.sh $m dflash ${NAME[$m]}
  done
  echo "[lane1 $(date +%T)] optimize q05 (empty memory)"
  OUT=$R WALL_S=${W05:-150} bash scripts/gpu_optimize.sh q05-empty dflash ${NAME[q05]}
  if [ "${TRAIN05:-0}" = 1 ]; then
    echo "[lane1 $(date +%T)] train q05"
    python3 -m specpilot.cli train-drafter --target /tmp/models/q05 --out /tmp/runs/q05 $COMMON \
      --time-limit-s $L05 --regen-budget-s $R05 > /tmp/runs/q05.log 2>&1
    tail -2 /tmp/runs/q05.log
    ship q05
  fi
  echo "[lane1 $(date +%T)] done"
}

lane0 > $R/lane0.log 2>&1 &
lane1 > $R/lane1.log 2>&1 &
wait
date > $R/DONE
