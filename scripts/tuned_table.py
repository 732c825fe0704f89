#!/usr/bin/env python
"""Build a pinned-tiles table (kernels/tuned.py) from Triton's cached autotuning results of one GPU model.

  python scripts/tuned_table.py --gpu "NVIDIA H200" .tcache/triton-cache.tgz [more .tgz or cache dirs ...] \
      [-o specpilot/kernels/tuned/nvidia-h200.json]

Each `<hash>/<kernel>.autotune.json` Triton wrote (TRITON_CACHE_AUTOTUNING=1, scripts/gpu_env.sh) holds one tuning
run: the launch's key (the autotuning key's values, then the dtypes of its tensor arguments, x's first) and every
config's timing. A config's timing is the 20th percentile of its repeats (Triton's autotuner records the median, the
20th and the 80th): noise on a busy or drifting machine only ever makes a repeat slower (session 35, machine B: the
1.5B qkv + RoPE's 2 x 1024 tile took 20.5 us at the median and 8.6 at the 20th percentile, where two other runs
measured 8.9-9.1). Runs of the same kernel and key (other machines, other sessions) are merged: each config's timing
is divided by the best of its run, and the pick is the config with the lowest median of those ratios (ties: the
lower mean), so with three runs or more one run on a drifting machine cannot decide alone. Only the fused kernels
kernels/tuned.py pins are read (the one-row and M-row GEMVs, qkv + RoPE), and only picks still among their configs
are kept. A key added to a kernel after a run (PIPE, session 35) reads as off for that run. Prints what it
kept; `-o` writes the table (without it: to stdout).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tarfile
from pathlib import Path


def kernels() -> dict:
    """kernel function name -> (autotuning key names, the kernel's configs as comparable tuples)."""
    from specpilot.kernels import gemm_rows as gr
    from specpilot.kernels import gemv_fused as gf
    from specpilot.kernels import qkv_rope as qr

    def ids(configs):
        return {config_id(c.kwargs, c.num_warps, c.num_stages) for c in configs}

    return {"_gemv_fused_kernel": (gf._KEY, ids(gf._CONFIGS)),
            "_gemm_fused_kernel": (gr._GEMM_KEY, ids(gr._GEMM_CONFIGS)),
            "_qkv_rope_kernel": (qr._KEY, ids(qr._CONFIGS))}


def config_id(kwargs: dict, warps: int, stages: int) -> str:
    return json.dumps([dict(sorted(kwargs.items())), warps, stages])


def read_runs(sources: list[str]):
    """-> [(kernel name, key list, configs_timings)] from .tgz archives and cache directories."""
    runs, seen = [], set()
    for src in sources:
        p = Path(src)
        if p.is_dir():
            files = [(f.name, f.read_text()) for f in sorted(p.rglob("*.autotune.json"))]
        elif p.is_file() and tarfile.is_tarfile(p):
            with tarfile.open(p) as tar:
                files = [(Path(m.name).name, tar.extractfile(m).read().decode()) for m in tar.getmembers()
                         if m.isfile() and m.name.endswith(".autotune.json")]
        else:
            raise SystemExit(f"tuned_table: {src} is neither a cache directory nor a .tgz archive")
        for name, text in files:
            if (name, text) in seen:  # the same run carried in two archives
                continue
            seen.add((name, text))
            data = json.load(io.StringIO(text))
            runs.append((name.removesuffix(".autotune.json"), data["key"], data["configs_timings"]))
    return runs


def named_key(values: list, names: list[str]) -> dict | None:
    """A run's key list -> {name: value, ..., "dtype": x's dtype}, or None where it does not fit the names."""
    n = next((i for i, v in enumerate(values) if isinstance(v, str) and v.startswith("torch.")), len(values))
    head = list(values[:n])
    if n == len(values) or len(head) > len(names):
        return None
    head += [False] * (len(names) - len(head))  # keys added since the run (PIPE): off then
    key = dict(zip(names, head))
    key["dtype"] = values[n].removeprefix("torch.")
    return key


def build(runs, known: dict) -> list[dict]:
    groups: dict = {}
    for kernel, values, timings in runs:
        if kernel not in known:
            continue
        key = named_key(values, known[kernel][0])
        if key is None:
            continue
        run = {}
        for cfg, t in timings:
            t = t[1] if isinstance(t, list) and len(t) > 1 else t[0] if isinstance(t, list) else t  # (q20, below)
            if t and t > 0:
                run[config_id(cfg["kwargs"], cfg["num_warps"], cfg["num_stages"])] = float(t)
        if run:
            groups.setdefault((kernel, json.dumps(key, sort_keys=True)), []).append(run)
    entries = []
    for (kernel, key), group in sorted(groups.items()):
        ratios: dict = {}
        for run in group:
            best = min(run.values())
            for cid, t in run.items():
                ratios.setdefault(cid, []).append((t / best, t))
        valid = {cid: r for cid, r in ratios.items() if cid in known[kernel][1]}
        if not valid:
            continue
        cid = min(valid, key=lambda c: (statistics.median(r for r, _ in valid[c]),
                                        statistics.mean(r for r, _ in valid[c])))
        kwargs, warps, stages = json.loads(cid)
        entries.append({"kernel": kernel, "key": json.loads(key), "runs": len(group),
                        "config": {"kwargs": kwargs, "num_warps": warps, "num_stages": stages},
                        "us": round(statistics.mean(t for _, t in valid[cid]) * 1000, 2)})
    return entries


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", nargs="+", help="Triton cache directories or .tgz archives (scripts/triton_cache.sh)")
    ap.add_argument("--gpu", required=True, help="the device name they were tuned on (torch.cuda.get_device_name)")
    ap.add_argument("-o", "--output", help="the table to write (default: stdout)")
    args = ap.parse_args(argv)
    entries = build(read_runs(args.sources), kernels())
    if not entries:
        print("tuned_table: no autotuning results of the pinned kernels found", file=sys.stderr)
        return 1
    for e in entries:
        print(f"{e['kernel']} {e['key']} -> {e['config']} ({e['runs']} runs, {e['us']} us)", file=sys.stderr)
    text = json.dumps({"gpu": args.gpu, "entries": entries}, indent=1) + "\n"
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
