#!/usr/bin/env python
"""The regeneration step train-drafter should run, from scripts/gpu_regen_speed.py's JSON lines (one file per
`--batch` tried): prints "KV_BUCKET BATCH KERNEL" for the fastest variant that ran (KERNEL "1" for the split-KV
attention kernel, "" without), for scripts/gpu_pipeline.sh to read into REGEN_KV_BUCKET / REGEN_BS / REGEN_ATTN.
Files that are missing or not JSON, and variants that failed (no `tok_s`), are skipped; with none left it prints
the defaults "0 256 " (the whole-pool step, batch 256, no kernel).

  python3 scripts/regen_choice.py /tmp/regen_speed_256.json /tmp/regen_speed_512.json
"""

from __future__ import annotations

import json
import sys


def choose(paths: list[str]) -> tuple[int, int, bool]:
    """-> (kv_bucket, batch, attention_kernel) of the fastest variant in these files."""
    runs = []
    for path in paths:
        try:
            with open(path) as fh:
                d = json.load(fh)
        except (OSError, ValueError):
            continue
        if not isinstance(d, dict):
            continue
        for r in (d.get("variants") or {}).values():
            if isinstance(r, dict) and "tok_s" in r:
                runs.append((r["tok_s"], int(r.get("kv_bucket", 0)), int(d.get("batch", 256)),
                             bool(r.get("attention_kernel", False))))
    if not runs:
        return 0, 256, False
    _, bucket, batch, kernel = max(runs, key=lambda r: r[0])
    return bucket, batch, kernel


def main(argv: list[str]) -> int:
    bucket, batch, kernel = choose(argv)
    print(bucket, batch, "1" if kernel else "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
