#!/bin/bash
# One H200 session's work after staging and `SMOKE=0 bash scripts/gpu_convert.sh`, on a 2-GPU machine
# (nvidia-h200-x2), started in the background so that it outlives the call that starts it:
#     setsid nohup bash scripts/gpu_pipeline.sh > /tmp/pipeline.log 2>&1 < /dev/null &
# and watched by `bash scripts/gpu_collect.sh SECONDS` calls, each of which brings back what is finished so far.
#   lane 0 (GPU 0): train the 1.5B drafter, regenerating half of its data (shard 0/2) -> int4 export -> bench it on
#                   the five benchmarks -> bench the 0.5B drafter
#   lane 1 (GPU 1): regenerate the other half of the 1.5B data (shard 1/2) while the engine's GPU parity check runs
#                   -> train the 0.5B drafter -> int4 export -> the loop (issue 5): optimize the 1.5B with its DFlash
#                   drafter, then the 0.5B started from that memory and from an empty one
# Results: /tmp/results (lane logs, bench JSON, optimize folders), drafters: /tmp/ship, training runs: /tmp/runs.
# Lane 1's timings run beside lane 0's on another GPU of the same host (32 cores): noted with the figures.
set -u
source scripts/gpu_env.sh || exit 1
R=/tmp/results
mkdir -p $R
P=${PROMPTS:-15000}
L15=${L15:-560}; R15=${R15:-190}; L05=${L05:-380}; R05=${R05:-130}
COMMON="--device cuda --dtype bfloat16 --data sharegpt=0.7,mbpp=0.3 --num-prompts $P --val-prompts 32
 --val-tau-prompts 8 --regen-max-new-tokens 384 --regen-batch-size 256 --max-seq-len 1280 --block-size 16
 --draft-layers 2 --target-layers 3 --draft-intermediate-size 2048 --steps 8000 --batch-size 16 --anchors-per-seq 32
 --lr 6e-4 --warmup-steps 50 --val-every 250 --save-every 0 --fit-steps-to-time --no-progress"
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
  echo "[lane0 $(date +%T)] bench q05"
  OUT=$R bash scripts/gpu_bench_dflash.sh q05 20
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
  echo "[lane1 $(date +%T)] train q05"
  python3 -m specpilot.cli train-drafter --target /tmp/models/q05 --out /tmp/runs/q05 $COMMON \
    --time-limit-s $L05 --regen-budget-s $R05 > /tmp/runs/q05.log 2>&1
  tail -2 /tmp/runs/q05.log
  ship q05
  for i in $(seq 60); do [ -e /tmp/ship/${NAME[q15]}/config.json ] && break; sleep 5; done
  echo "[lane1 $(date +%T)] optimize q15"
  OUT=$R WALL_S=${W15:-300} bash scripts/gpu_optimize.sh q15 dflash /tmp/ship/${NAME[q15]}
  echo "[lane1 $(date +%T)] optimize q05 (memory of q15)"
  OUT=$R WALL_S=${W05:-150} bash scripts/gpu_optimize.sh q05 dflash /tmp/ship/${NAME[q05]}
  echo "[lane1 $(date +%T)] optimize q05 (empty memory)"
  OUT=$R WALL_S=${W05:-150} bash scripts/gpu_optimize.sh q05-empty dflash /tmp/ship/${NAME[q05]}
  echo "[lane1 $(date +%T)] done"
}

lane0 > $R/lane0.log 2>&1 &
lane1 > $R/lane1.log 2>&1 &
wait
date > $R/DONE
