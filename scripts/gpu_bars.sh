#!/bin/bash
# Issue 3's AR-step bars in one device call: the graphed one-token step against its bytes floor at the 1.5B and
# Qwen3-8B shapes (random bf16 weights, scripts/gpu_step_timing.py), the defaults (with the shipped tiles) beside any
# extra configs, interleaved, with timeouts sized by the carried Triton cache.
#   OUT=$OUT bash scripts/gpu_bars.sh [CONTEXT ...]    # contexts in tokens, default 512; Qwen3-8B at the first only
# CONFIGS: extra configs, space-separated name:field=value,... (on top of tuned_tiles=true), e.g.
#   CONFIGS="w8:attn_kv_preload=true,attn_warps=8 pre:attn_kv_preload=true"
# (Qwen3-8B takes the first two: an 80 GB card holds three of its random models.) ROUNDS15 / ROUNDS8: rounds (4 / 3).
# TRACE=1: then the per-program trace of the defaults at both shapes (scripts/gpu_step_trace.py).
# INGRAPH=1: first the in-graph tile tuner (scripts/gpu_tune_in_graph.py, 1.5B and Qwen3-8B, ~80 + ~100 s with
# compiling on an H100) into OUT/ingraph-table.json, then that table timed as config "ig" (tuned_table) beside
# the shipped table (tt) at both shapes; the table comes back with OUT.
# DRY=1: print the commands with their timeouts, run nothing (the tests').
# Why the timeouts follow the cache: session 40's first call ran every command past its timeout, because the
# carried .tcache was packed for older kernel sources (scripts/kernel_stamp.py) and each process re-tuned every GEMV
# shape, ~100-140 s a shape. Where the seeded cache's stamp differs from the kernels', each process gets STALE_S
# (150) seconds more; a device command has 600 s, so with a stale cache time one context, without TRACE.
# Where the cache holds no compiled kernel (a fresh machine seeded from an archive of results only), the FIRST process
# compiles every kernel: COMPILE_S (120) seconds more for it (session 41: the first 1.5B timing ran past 105 s on a
# fresh H100 with a fresh stamp; the same command took ~25 s in the next call).
set -u
cd "$(dirname "$0")/.."
if [ -z "${DRY:-}" ]; then
  source scripts/gpu_env.sh || exit 1
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
fi
contexts=${*:-512}
for c in $contexts; do
  case $c in ''|*[!0-9]*) echo "gpu_bars.sh: a context is a whole number of tokens, got '$c'" >&2; exit 2 ;; esac
done
configs=()
for c in ${CONFIGS:-}; do
  case $c in
    *:*=*) configs+=("--config=${c%%:*}:tuned_tiles=true,${c#*:}") ;;
    *) echo "gpu_bars.sh: CONFIGS takes name:field=value,..., got '$c'" >&2; exit 2 ;;
  esac
done
extra=0
if ! TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache} bash scripts/triton_cache.sh seeded > /dev/null; then
  extra=${STALE_S:-150}
  echo "gpu_bars.sh: the Triton cache is stale or unstamped: $extra s more a process"
fi
first_extra=0
if [ -z "$(find "${TRITON_CACHE_DIR:-/tmp/triton-cache}" -name '*.cubin' -print -quit 2>/dev/null)" ]; then
  first_extra=${COMPILE_S:-120}
  echo "gpu_bars.sh: no compiled kernel in the Triton cache: $first_extra s more for the first process"
fi
OUT=${OUT:-/tmp/bars}
mkdir -p "$OUT"
run() {  # run SECONDS LOG command... (the first run gets first_extra more)
  local s=$(($1 + first_extra)) log=$2; shift 2
  first_extra=0
  if [ -n "${DRY:-}" ]; then echo "timeout $s $* > $log"; return; fi
  local rc=0
  timeout "$s" "$@" > "$log" 2>&1 || rc=$?
  grep -h "summary\|att_merge_us" "$log" | cut -c1-300 || echo "gpu_bars.sh: nothing from $log (rc $rc)"
}
if [ -n "${INGRAPH:-}" ]; then
  table=$OUT/ingraph-table.json
  if [ -n "${DRY:-}" ]; then
    echo "timeout $((200 + extra)) python3 scripts/gpu_tune_in_graph.py qwen2.5-1.5b qwen3-8b --into=$table"
  else
    timeout $((200 + extra)) python3 scripts/gpu_tune_in_graph.py qwen2.5-1.5b qwen3-8b --into="$table" \
      > "$OUT/ingraph.log" 2>&1 || echo "gpu_bars.sh: the in-graph tuner stopped (rc $?): what it timed is kept"
    grep -h " best " "$OUT/ingraph.log" | cut -c1-200
  fi
  if [ -n "${DRY:-}" ] || [ -s "$table" ]; then
    configs=("--config=ig:tuned_tiles=true,tuned_table=$table" "${configs[@]}")
  fi
fi
base=(--no-compile --tokens=1 --config=tt:tuned_tiles=true)
for c in $contexts; do
  run $((60 + 15 * ${#configs[@]} + extra)) "$OUT/bars15_c$c.log" python3 scripts/gpu_step_timing.py qwen2.5-1.5b \
    "${base[@]}" --rounds="${ROUNDS15:-4}" --context="$c" "${configs[@]}" --config=tt2:tuned_tiles=true
done
first=${contexts%% *}
eight=("${configs[@]:0:2}")
run $((90 + 30 * ${#eight[@]} + extra)) "$OUT/bars8_c$first.log" python3 scripts/gpu_step_timing.py qwen3-8b \
  "${base[@]}" --rounds="${ROUNDS8:-3}" --context="$first" "${eight[@]}"
if [ -n "${TRACE:-}" ]; then
  run $((60 + extra)) "$OUT/trace15.log" python3 scripts/gpu_step_trace.py qwen2.5-1.5b --config=tuned_tiles=true
  run $((80 + extra)) "$OUT/trace8.log" python3 scripts/gpu_step_trace.py qwen3-8b --config=tuned_tiles=true
fi
