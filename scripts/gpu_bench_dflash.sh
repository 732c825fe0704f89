#!/bin/bash
# Benchmark a trained DFlash drafter on the GPU: our AR, z-lab's dflash package (stock, same checkpoint) and
# SpecPilot on the five benchmarks, 20 prompts each, 256 new tokens, greedy, bs 1, with token forcing.
# Usage: scripts/gpu_bench_dflash.sh q15|q05 [num_prompts] [benchmarks]
# The graphed steps attend over the whole KV pool (MAX_SEQ slots; default 2048, 4096 with Spec-Bench): with SDPA that costs ~0.1 ms per
# layer at 4096 slots on the H200; the split-KV attention kernel (default on CUDA since session 8) skips the unused slots.
set -u
source scripts/gpu_env.sh || exit 1
m=$1
benches=${3:-humaneval,mbpp,gsm8k,mt_bench,spec_bench}
case $benches in *spec_bench*) pool=4096 ;; *) pool=2048 ;; esac  # Spec-Bench has long (RAG, summary) prompts
declare -A NAME=([q15]=dflash-qwen2.5-coder-1.5b [q05]=dflash-qwen2.5-coder-0.5b)
# EXTRA: more engine flags (e.g. --early-draft); SYSTEMS: a subset (default all three); TAG: a suffix for the JSON's name; DRAFTER: another checkpoint or a shipped name (default: this session's, /tmp/ship); K: the draft length
python3 -m specpilot.cli bench --target /tmp/models/$m --drafter ${DRAFTER:-/tmp/ship/${NAME[$m]}} --drafter-kind dflash \
  --num-draft-tokens ${K:-15} --systems ${SYSTEMS:-ar,stock,specpilot} --benchmarks $benches \
  --num-prompts ${2:-20} --max-new-tokens 256 --max-seq-len ${MAX_SEQ:-$pool} --device cuda --dtype bfloat16 \
  ${ATTN:+--attention-kernel} ${EXTRA:-} \
  --out $OUT/bench_dflash_$m${TAG:+_$TAG}.json 2>&1 | grep -v "^\s*$" | tail -60
