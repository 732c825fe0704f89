#!/bin/bash
# Watch scripts/gpu_pipeline.sh for up to $1 seconds (it returns early once the pipeline is done), print where each
# lane stands, and pack what exists into $OUT: results.tgz (bench JSON, optimize reports,
# lane logs), train_logs.tgz (training logs and results), each shipped drafter's files in $OUT/<name>/, and once the
# pipeline is done the packed regeneration cache (regen-q15.NN.jsonl.gz, ~2 parts; <= 8 files come back in all;
# PACK=0 skips it).
set -u
R=/tmp/results
if [ ! -d $R ]; then  # a fresh machine: the lease was lost and the pipeline's files with it (session 14 waited
  echo "NO PIPELINE HERE: $R is missing (the machine was given back and this is a fresh one); nothing to collect"
  exit 3              # out a whole 520 s call on one): stop at once rather than spend the device time waiting
fi
end=$(( $(date +%s) + ${1:-60} ))
while [ "$(date +%s)" -lt $end ] && [ ! -e $R/DONE ]; do sleep 5; done
for f in $R/lane0.log $R/lane1.log /tmp/runs/q15.log /tmp/runs/q15-helper.log /tmp/runs/q05.log; do
  [ -e $f ] && { echo "== $f"; grep -v "^\s*$" $f | tail -${TAIL:-8}; }
done
nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader
for d in $([ "${SHIP:-1}" = 1 ] && ls -d /tmp/ship/*/ 2>/dev/null); do  # SHIP=0: not the drafter (room for regen parts)  # drafter shards one by one: an archive of both drafters is over the 16 MiB file limit
  [ -e "$d/config.json" ] && mkdir -p $OUT/$(basename $d) && cp $d/* $OUT/$(basename $d)/
done
if [ "${PACK:-1}" = 1 ] && [ -e $R/DONE ] && [ -d /tmp/runs/q15/regen ]; then  # the responses, for the next session (GPU_SESSION.md)
  [ -e /tmp/regen-pack/DONE ] || { mkdir -p /tmp/regen-pack && python3 scripts/regen_cache.py pack \
    /tmp/runs/q15/regen /tmp/regen-pack/regen-q15 && touch /tmp/regen-pack/DONE; }
fi
# packed already (MODE=single packs right after training): the parts come back even while the pipeline runs on
[ "${PACK:-1}" = 1 ] && [ -e /tmp/regen-pack/DONE ] && cp /tmp/regen-pack/*.jsonl.gz $OUT/ 2>/dev/null
# the measured ceilings (the cost model's inputs; cached per GPU model), next to the results they explain
cp ${SPECPILOT_CACHE:-/tmp/specpilot-cache}/hardware/*.json $R/ 2>/dev/null  # (scripts/gpu_env.sh sets it)
tar czf $OUT/results.tgz -C /tmp results 2>/dev/null
(cd /tmp/runs && tar czf $OUT/train_logs.tgz $(ls -d *.log */log.jsonl */result.json */train_config.json 2>/dev/null))
ls -la $OUT
[ -e $R/DONE ] && echo "PIPELINE DONE"
