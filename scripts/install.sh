#!/usr/bin/env bash
# Everything SpecPilot needs on a fresh machine, from the project's own files. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first: a CPU build where the machine offers one (the pinned file here), any torch >= 2.4 otherwise.
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0 || "$PY" -m pip install -q "torch>=2.4"
"$PY" -m pip install -q -e ".[test]"
"$PY" -m pip install -q --no-deps dflash==0.1.0  # z-lab's reference implementation, for parity tests
