#!/bin/bash
# One device call that does useful work whichever card it lands on: issue 3's AR-step bars where the card is an
# H200 (they must be met there), else OTHER (a command line for an H100: an engine check, a step timing, ...).
# Why: since session 36 nearly every `nvidia-h200` call got an H100 or was refused, and a refusal costs 90-180 s of
# the 1,800 s budget; sessions 37-52 each wrote this branch by hand ("the probe form"). A call naming nvidia-h200
# without needs_h200 gets whichever card comes, so the call must choose its work after it starts.
#   OUT=$OUT OTHER="timeout 300 python3 scripts/gpu_engine_check.py --only=norm_handoff" bash scripts/gpu_probe.sh
# BARS: the H200 branch's command (default: gpu_bars.sh at 512 tokens with the push default against it off).
# OTHER empty: the other branch only names the card (a call that ran nothing costs ~30-40 s).
# GPU_NAME: the card's name instead of nvidia-smi's (the tests'); DRY=1: print the chosen command, run nothing.
set -u
cd "$(dirname "$0")/.."
name=${GPU_NAME:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)}
if [ -z "$name" ]; then
  echo "gpu_probe.sh: no GPU here (nvidia-smi named no card)" >&2
  exit 2
fi
echo "gpu_probe.sh: card: $name"
bars=${BARS:-"STALE_S=20 CONFIGS=nopush:attn_cluster_push=false OUT=${OUT:-/tmp/bars} timeout 540 bash scripts/gpu_bars.sh 512"}
env=scripts/gpu_env.sh
case $name in
  *H200*) cmd=$bars; env= ;;  # gpu_bars.sh sets its environment up itself
  *) cmd=${OTHER:-} ;;
esac
if [ -z "$cmd" ]; then
  echo "gpu_probe.sh: nothing to run on this card (OTHER is empty)"
  exit 0
fi
echo "gpu_probe.sh: running: $cmd"
[ -n "${DRY:-}" ] && exit 0
if [ -n "$env" ]; then
  source "$env" || exit 1
fi
bash -c "$cmd"
