#!/bin/bash
# The loop on the GPU (issue 5's figures): a full run on the 1.5B target, then memory transfer to the 0.5B target,
# started from that memory and from an empty one. Each call stays under the 10-minute command limit: the loop
# stops at --wall-s and `RESUME=<run id>` continues a run (finished trials are not re-run).
# Usage: scripts/gpu_optimize.sh q15|q05|q05-empty [drafter-kind] [drafter-path]
set -u
source scripts/gpu_env.sh || exit 1
m=$1
kind=${2:-model}
drafter=${3:-/tmp/models/q05}
mem=/tmp/runs/loop-memory.sqlite
case $m in
  q15) target=/tmp/models/q15 ;;
  q05) target=/tmp/models/q05 ;;
  q05-empty) target=/tmp/models/q05; mem=/tmp/runs/loop-empty.sqlite ;;
esac
[ "$kind" = ngram ] && drafter_flag="" || drafter_flag="--drafter $drafter"
python3 -m specpilot.cli optimize --target $target --drafter-kind $kind $drafter_flag --device cuda --dtype bfloat16 \
  --rounds ${ROUNDS:-3} --trials ${TRIALS:-24} --num-prompts ${NUM_PROMPTS:-5} --max-new-tokens 256 --repeats 3 \
  --wall-s ${WALL_S:-520} --memory $mem --out $OUT/optimize_$m ${RESUME:+--resume $RESUME} 2>&1 \
  | grep -v "Loading weights" | tail -60
