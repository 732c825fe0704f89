"""Carry a training run's regeneration cache between GPU sessions (scripts/GPU_SESSION.md).

    python3 scripts/regen_cache.py pack /tmp/runs/q15/regen $OUT/regen-q15      # -> regen-q15.NN.jsonl.gz
    python3 scripts/regen_cache.py unpack /tmp/runs/q15/regen .regen/regen-q15.*.jsonl.gz
"""

import argparse

from specpilot.train.regenerate import pack, unpack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("pack", "unpack"))
    ap.add_argument("folder", help="the cache folder (train-drafter's --regen-dir)")
    ap.add_argument("files", nargs="+", help="pack: the output prefix; unpack: the parts")
    a = ap.parse_args()
    if a.action == "pack":
        for path in pack(a.folder, a.files[0]):
            print(path)
    else:
        print(f"{unpack(a.files, a.folder)} records -> {a.folder}")


if __name__ == "__main__":
    main()
