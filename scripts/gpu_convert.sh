#!/bin/bash
# After the staging calls (GGUF pieces appended to /tmp/m/q15.gguf and /tmp/m/q05.gguf): check the sha256 of both
# and convert them to HF folders in /tmp/models/{q15,q05}; then a short GPU smoke run of train-drafter.
# MODELS="q15": only the 1.5B was staged (a single-GPU session's 33 pieces; SMOKE=0 then, the smoke run needs q05).
set -u
source scripts/gpu_env.sh || exit 1
MODELS=${MODELS:-q15 q05}
declare -A SUM=([q15]=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
                [q05]=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32)
: > /tmp/m/sums
for m in $MODELS; do echo "${SUM[$m]}  /tmp/m/$m.gguf" >> /tmp/m/sums; done
sha256sum -c /tmp/m/sums || exit 1
# one process per model, side by side (16 cores there; ~120 s one after the other in session 20; on this CPU the
# 1.5B alone took 88 s: GGUF metadata parsed twice 37 s, dequantization 32 s, tokenizer 31 s, all single-threaded)
pids=()
for m in $MODELS; do
  python3 -c "
from pathlib import Path
from specpilot.hub import convert_gguf
convert_gguf(Path('/tmp/m/$m.gguf'), Path('/tmp/models/$m'))
print('$m', 'converted', flush=True)
" & pids+=($!)
done
for p in "${pids[@]}"; do wait $p || exit 1; done
rm -f /tmp/m/*.gguf
[ "${SMOKE:-1}" = 1 ] && timeout 120 python3 -m specpilot.cli train-drafter --target /tmp/models/q05 --out /tmp/runs/smoke \
  --device cuda --num-prompts 64 --val-prompts 4 --val-tau-prompts 2 --regen-max-new-tokens 64 --regen-batch-size 32 \
  --max-seq-len 512 --draft-layers 2 --target-layers 3 --draft-intermediate-size 2048 --steps 30 --batch-size 16 \
  --anchors-per-seq 32 --val-every 15 --save-every 0 --time-limit-s 100 --no-progress 2>&1 | tail -12
nvidia-smi --query-gpu=memory.used --format=csv
