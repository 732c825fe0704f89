#!/bin/bash
# Issue 3's figures on the GPU: Qwen2.5-Coder-1.5B with the 0.5B AR drafter and with n-grams, against our AR,
# transformers' AR (static cache) and the stock systems (assisted generation / prompt lookup), 20 prompts each of
# HumanEval, MT-Bench and GSM8K, 256 new tokens, greedy, bs 1, with token forcing; then the cost model's profile.
# Usage: scripts/gpu_bench_ar_drafters.sh model|ngram|profile-model|profile-ngram|profile-dflash [num_prompts]
# (BENCHMARKS / SYSTEMS: other lists, e.g. BENCHMARKS=gsm8k for the rows a time limit cut; BUDGET=S: start no
#  prompt after S seconds and write the JSON after every prompt, so a call's limit never loses the whole run;
#  SKIP=N: leave out the first N prompts, the rest of a cut run, pooled with it by `specpilot bench-merge`)
set -u
source scripts/gpu_env.sh || exit 1
kind=${1#profile-}
case $kind in
  model) drafter="--drafter /tmp/models/q05 --num-draft-tokens ${K:-4}" ;;
  dflash) drafter="--drafter ${DFLASH:-dflash-qwen2.5-coder-1.5b} --num-draft-tokens ${K:-15}" ;;  # profile only
  *) drafter="--num-draft-tokens ${K:-4}" ;;
esac
common="--target /tmp/models/q15 --drafter-kind $kind $drafter --device cuda --dtype bfloat16 --max-new-tokens 256
  --max-seq-len 2048 ${ATTN:+--attention-kernel} ${COMPILE:+--compile} ${EXTRA:-}"  # EXTRA: any engine flags
if [ "${1%%-*}" = profile ]; then
  python3 -m specpilot.cli profile $common --benchmarks humaneval --num-prompts ${2:-4} 2>&1 | grep -v "Loading weights" | tail -40
else
  # the slow peers (transformers' AR and stock: 14-45 tok/s) on the first BASE prompts of each benchmark (vs stock
  # is then taken on those same prompts): 20 prompts x 3 benchmarks of them alone would take ~15 min
  python3 -m specpilot.cli bench $common --systems ${SYSTEMS:-ar,hf-ar,stock,specpilot} --benchmarks ${BENCHMARKS:-humaneval,mt_bench,gsm8k} \
    --num-prompts ${2:-20} --baseline-prompts ${BASE:-3} ${BUDGET:+--time-budget $BUDGET} ${SKIP:+--skip-prompts $SKIP} --out $OUT/bench_${kind}.json 2>&1 | grep -v "Loading weights" | tail -40
fi
