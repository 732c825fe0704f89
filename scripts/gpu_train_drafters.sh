#!/bin/bash
# Train the shipped DFlash drafters on one GPU: both targets at once (two processes share it), each within
# LIMIT seconds (regeneration + training, the LR schedule fitted to the time left), then export each in int4
# storage to $OUT/<name>/ (shards <= 15 MB) and pack the logs in $OUT/train_logs.tgz.
# ATTN=1 adds --attention-kernel (once gpu_engine_check.py has passed with it).
# Needs /tmp/models/q15 and /tmp/models/q05 (converted GGUFs) and the carried .whl/ and .data/.
set -u
source scripts/gpu_env.sh || exit 1
LIMIT=${LIMIT:-480}
COMMON="--device cuda --dtype bfloat16 --data sharegpt=0.7,mbpp=0.3 --num-prompts ${PROMPTS:-12000} --val-prompts 32
 --val-tau-prompts 8 --regen-max-new-tokens 384 --regen-batch-size 256 --max-seq-len 1280 --block-size 16
 --draft-layers 2 --target-layers 3 --draft-intermediate-size 2048 --steps 4000 --batch-size 16 --anchors-per-seq 32
 --lr 6e-4 --warmup-steps 50 --val-every 200 --save-every 0 --time-limit-s $LIMIT --fit-steps-to-time --no-progress --regen-budget-s ${REGEN_S:-150} ${ATTN:+--attention-kernel}"
for m in q15 q05; do
  python3 -m specpilot.cli train-drafter --target /tmp/models/$m --out /tmp/runs/$m $COMMON > /tmp/runs/$m.log 2>&1 &
done
wait
declare -A NAME=([q15]=dflash-qwen2.5-coder-1.5b [q05]=dflash-qwen2.5-coder-0.5b)
for m in q15 q05; do
  tail -3 /tmp/runs/$m.log
  python3 -m specpilot.cli export-drafter /tmp/runs/$m/best /tmp/ship/${NAME[$m]} --storage int4 --group-size 64 \
    --max-shard-mb 15 && cp -r /tmp/ship/${NAME[$m]} $OUT/
done
tar czf $OUT/train_logs.tgz -C /tmp/runs q15.log q05.log q15/log.jsonl q05/log.jsonl q15/result.json q05/result.json \
  q15/train_config.json q05/train_config.json 2>/dev/null
timeout ${TAU_S:-60} python3 scripts/gpu_storage_tau.py || true   # trained vs shipped int4 tau (stdout)
ls -la $OUT $OUT/*
