#!/bin/bash
# A/B of engine configurations on the real Qwen2.5-Coder-1.5B with the shipped DFlash drafter, on one GPU:
# `specpilot bench --systems ar,specpilot` once per variant, on the same prompts, token forcing on every output.
# Why: session 14's bench found SpecPilot slower than our fused AR on 3 of 4 benchmarks (a speculative step cost
# 2.2-2.8 AR steps; each prompt 35-135 ms outside its decode steps); the fixes since (padded eager shapes, the draft
# attention / act / add-norm kernels on by default, fused multi-token verify) need real-weight figures, quickly.
# After staging q15 (33 pieces) and `MODELS=q15 SMOKE=0 bash scripts/gpu_convert.sh`:
#     OUT=$OUT bash scripts/gpu_ab.sh [num_prompts] [benchmarks]
# KIND=ngram (or model, with DRAFTER=/tmp/models/q05) for the other drafter kinds, K tokens drafted a step (default
# 15 for dflash, 4 otherwise); a variant may appear twice (name it twice: off= on=... off2= on2=...) to see the
# run-to-run spread and the order's effect (session 25: our AR varied +-3% between runs of one config).
# VARIANTS: space-separated name=flags pairs (flags joined by commas), default below. Writes $OUT/ab_<name>.json and
# prints one line per variant and benchmark: our AR tok/s, SpecPilot tok/s (tau), speedup, prefill ms a prompt,
# stage ms a step, forcing.
set -u
source scripts/gpu_env.sh || exit 1
N=${1:-10}
BENCHES=${2:-humaneval,mt_bench,gsm8k}
VARIANTS=${VARIANTS:-"default= fusedverify=--fused-verify nopad=--no-pad-shapes"}
KIND=${KIND:-dflash}
case $KIND in
  dflash) drafter="--drafter ${DRAFTER:-dflash-qwen2.5-coder-1.5b} --num-draft-tokens ${K:-15}" ;;
  model) drafter="--drafter ${DRAFTER:-/tmp/models/q05} --num-draft-tokens ${K:-4}" ;;
  *) drafter="--num-draft-tokens ${K:-4}" ;;
esac
for v in $VARIANTS; do
  name=${v%%=*}; flags=${v#*=}
  echo "[$(date +%T)] variant $name: ${flags//,/ }"
  timeout ${AB_S:-240} python3 -m specpilot.cli bench --target /tmp/models/q15 --drafter-kind $KIND $drafter \
    --systems ar,specpilot --benchmarks $BENCHES --num-prompts $N \
    --max-new-tokens 256 --max-seq-len 2048 --device cuda --dtype bfloat16 ${flags//,/ } \
    --out $OUT/ab_$name.json > /tmp/ab_$name.log 2>&1 || { echo "  failed:"; tail -5 /tmp/ab_$name.log; continue; }
  python3 - "$OUT/ab_$name.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
for b, r in s["benchmarks"].items():
    ar, sp = r["systems"]["ar"], r["systems"]["specpilot"]
    print(f"  {b:10s} AR {ar['tokens_per_s']:7.1f}  SpecPilot {sp['tokens_per_s']:7.1f} (tau {sp.get('tau', 1):.2f}) "
          f"x{sp['speedup_vs_ar']:.3f}  prefill ms AR {ar.get('prefill_ms_per_prompt')} / spec "
          f"{sp.get('prefill_ms_per_prompt')}  stage ms {sp.get('stage_ms_per_step')}  plain "
          f"{sp.get('plain_step_share', 0)} (spec-step tau {sp.get('tau_speculative_steps', '-')})  forcing "
          f"{ar['forcing_passed'] and sp['forcing_passed']}")
print(f"  pooled: AR {s['ar_tokens_per_s']} SpecPilot {s['spec_tokens_per_s']} x{s['speedup']}")
EOF
done
