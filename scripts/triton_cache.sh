#!/bin/bash
# Triton's on-disk cache (compiled kernels, autotuning results) carried from one GPU session to the next.
# Why: the device machine keeps nothing between leases, and a session's first process re-times every config of
# every autotuned kernel at each new shape: ~100 s of the 1,800 s budget (session 25: bench setup 119 s on a fresh
# machine, 12-19 s in later processes; a step-timing variant's setup 118 s). The tuning keys include Triton's
# version, the GPU target and each kernel's source, so an entry of changed code or another GPU is never used.
#   bash scripts/triton_cache.sh pack DIR   # on the GPU machine, last call: DIR/triton-cache.tgz (autotuning results
#                                           # always; the compiled kernels too while the archive stays <= MAX_MB)
#   bash scripts/triton_cache.sh seed       # scripts/gpu_env.sh: unpack .tcache/triton-cache.tgz (carried) once,
#                                           # keeping any file this session wrote already; says STALE where the
#                                           # kernels changed since the pack
#   bash scripts/triton_cache.sh seeded     # exit 0 if the cache at TRITON_CACHE_DIR was packed for the kernels as
#                                           # they are now (seed and scripts/gpu_bars.sh ask), else STALE, exit 1
#   bash scripts/triton_cache.sh check      # locally, before a GPU session: exit 0 if .tcache/ was packed for the
#                                           # kernels as they are now, 1 if not (or unstamped, or missing)
# MAX_MB (15): a returned file may be at most 16 MiB (device README) and a call carries 64 MiB with the ~33 MB tracked
# tree; with the compiled kernels a fresh machine's first process skips compiling them (session 41: without, it ran
# past a 105 s limit that the next call's met in ~25 s). Pack after the step timings and before the engine check:
# its fp32 kernels took session 42's archive to 17.3 MB, which did not come back.
# Locally, between sessions: copy the packed file from the device's files into .tcache/ (ignored) and carry it.
# The stamp (scripts/kernel_stamp.py: the jitted sources) goes into the archive as .kernel-stamp: a stale cache costs
# the first process on a fresh machine ~100-140 s a shape of re-tuning (session 40 lost a call to it), so size the
# first call's timeouts by `check`, or re-pack after the kernels change.
set -eu
cd "$(dirname "$0")/.."
CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
case ${1:-} in
  pack)
    out=${2:?pack needs an output folder}; mkdir -p "$out"; list=$(mktemp)
    [ -d "$CACHE" ] || { echo "triton_cache: no cache at $CACHE" >&2; exit 2; }
    python3 scripts/kernel_stamp.py > "$CACHE/.kernel-stamp" || rm -f "$CACHE/.kernel-stamp"
    (cd "$CACHE" && find . -type f ! -name .seeded | sort) > "$list"
    tar czf "$out/triton-cache.tgz" -C "$CACHE" -T "$list"
    if [ $(stat -c %s "$out/triton-cache.tgz") -gt $(( ${MAX_MB:-15} << 20 )) ]; then  # too big to carry: results only
      grep -E '\.autotune\.json$|^\./\.kernel-stamp$' "$list" > "$list.json" || true
      tar czf "$out/triton-cache.tgz" -C "$CACHE" -T "$list.json"
    fi
    echo "triton_cache: $(tar tzf "$out/triton-cache.tgz" | grep -c '\.autotune\.json$') autotuning results," \
         "$(tar tzf "$out/triton-cache.tgz" | wc -l) files, $(stat -c %s "$out/triton-cache.tgz") bytes"
    rm -f "$list" "$list.json"
    ;;
  seed)
    if [ -f .tcache/triton-cache.tgz ] && [ ! -e "$CACHE/.seeded" ]; then
      mkdir -p "$CACHE" && tar xzf .tcache/triton-cache.tgz --skip-old-files -C "$CACHE" && touch "$CACHE/.seeded"
      echo "triton_cache: seeded $CACHE ($(find "$CACHE" -name '*.autotune.json' | wc -l) autotuning results)"
      bash scripts/triton_cache.sh seeded || true
    fi
    ;;
  seeded)
    if [ "$(cat "$CACHE/.kernel-stamp" 2>/dev/null)" != "$(python3 scripts/kernel_stamp.py 2>/dev/null)" ]; then
      echo "triton_cache: STALE: $CACHE holds tuning for other kernel sources: ~100-140 s of re-tuning a shape"
      exit 1
    fi
    ;;
  check)
    [ -f .tcache/triton-cache.tgz ] || { echo "triton_cache: no .tcache/triton-cache.tgz"; exit 1; }
    packed=$(tar xzf .tcache/triton-cache.tgz -O ./.kernel-stamp 2>/dev/null || true)
    now=$(python3 scripts/kernel_stamp.py)
    if [ -z "$packed" ]; then
      echo "triton_cache: unstamped (packed before stamps): treat as stale"; exit 1
    elif [ "$packed" != "$now" ]; then
      echo "triton_cache: STALE: packed for kernels $packed, they are $now now: re-tuning ~100-140 s a shape"; exit 1
    fi
    echo "triton_cache: fresh (kernels $now)"
    ;;
  *)
    sed -n '2,20p' "$0" >&2; exit 2
    ;;
esac
