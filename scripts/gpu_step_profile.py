#!/usr/bin/env python
"""Where a graphed T-token step's time goes, by kernel name: the engine's own layout, random bf16 weights.

Why: the one-token step has a per-program trace (gpu_step_trace.py) and a per-position table (gpu_step_kernels.py),
but a speculative step is mostly its verify pass (16 tokens for a DFlash block), which runs another path (the fused
layer at T rows: M-row GEMVs, separate RMSNorm launches, the split-KV attention and its merge) and had no breakdown
under today's defaults. On an H100 (session 50) the real 1.5B's verify stage took 2.07 ms a step against 1.48 ms
for a whole AR token, so that is where a speculative step's time now goes.

Per shape and T: the step is laid out and captured as `specpilot` runs it (engine._apply_layout for
`EngineConfig(device="cuda", dtype="bfloat16", **fields)`, ModelRunner with CUDA graphs), after CONTEXT tokens of
prefill; its replay time (median of 100, CUDA events); then REPLAYS replays under torch.profiler. Kernels are grouped
by name: per step, how many launches and the summed time (us), largest first; the gaps (a step's span minus its
kernel time; negative where PDL overlaps launches) and the floor of the step's bytes at the measured HBM rate.

Run: python3 scripts/gpu_step_profile.py [qwen2.5-1.5b ...] [--tokens=1,16] [--replays=10] [--context=512]
[--config=field=value,...]   (default: qwen2.5-1.5b, tokens 1 and 16, the engine's defaults)
Last stdout line: one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def group(steps: list[list[tuple[str, float, float]]]) -> dict:
    """steps: per replay, its kernels as (name, start_us, end_us) -> per kernel name the launches a step and the
    median over replays of their summed time, largest first; with the step's kernel time, span and gaps."""
    per: dict[str, list[float]] = {}
    count: dict[str, int] = {}
    for step in steps:
        sums: dict[str, float] = {}
        for name, s, e in step:
            sums[name] = sums.get(name, 0.0) + (e - s)
        for name, t in sums.items():
            per.setdefault(name, []).append(t)
    for name, _, _ in steps[0]:
        count[name] = count.get(name, 0) + 1
    rows = sorted(((n, round(statistics.median(ts), 2), count.get(n, 0)) for n, ts in per.items()),
                  key=lambda r: -r[1])
    kernel_us = statistics.median(sum(e - s for _, s, e in step) for step in steps)
    span_us = statistics.median(max(e for _, _, e in step) - min(s for _, s, _ in step) for step in steps)
    return {"kernels": [{"name": n[:70], "us": t, "launches": c} for n, t, c in rows],
            "kernel_us": round(kernel_us, 1), "span_us": round(span_us, 1), "gaps_us": round(span_us - kernel_us, 1)}


def parse(argv: list[str]) -> dict:
    """The command line -> options; ValueError with a clear message on a bad argument."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # (its neighbours, however it was loaded)
    from gpu_step_timing import configs

    opts = {"shapes": [], "tokens": [1, 16], "replays": 10, "context": 512, "fields": {}}
    for a in argv:
        key, _, val = a.partition("=")
        if key == "--tokens":
            if not val or not all(t.isdigit() and 1 <= int(t) <= 16 for t in val.split(",")):
                raise ValueError(f"--tokens takes integers 1-16, e.g. --tokens=1,16; got {val!r}")
            opts["tokens"] = [int(t) for t in val.split(",")]
        elif key in ("--replays", "--context"):
            if not val.isdigit() or int(val) < 1:
                raise ValueError(f"{key} takes a positive integer, got {val!r}")
            opts[key[2:]] = int(val)
        elif key == "--config":  # gpu_step_timing.py's fields, parsed and checked as there
            opts["fields"] = configs([f"--config=profile:{val}"])[0][1]
        elif a.startswith("--"):
            raise ValueError(f"unexpected argument {a!r} (see --help)")
        else:
            opts["shapes"].append(a)
    opts["shapes"] = opts["shapes"] or ["qwen2.5-1.5b"]
    return opts


def measure(name: str, opts: dict) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from specpilot.config import EngineConfig
    from specpilot.costmodel import forward_cost, load_or_measure, pass_floor_s, synthetic_config
    from specpilot.costmodel.hardware import time_median_s
    from specpilot.engine import _apply_layout, kernel_switches, restore_kernel_switches
    from specpilot.engine.runner import ModelRunner
    from specpilot.models import random_model

    from gpu_step_kernels import replay_kernels

    hw = load_or_measure("cuda")
    cfg = synthetic_config(name)
    off = kernel_switches()
    ecfg = EngineConfig(device="cuda", dtype="bfloat16", **opts["fields"])
    model = random_model(cfg)
    _apply_layout(model, ecfg)
    ctx, tokens = opts["context"], opts["tokens"]
    runner = ModelRunner(model.eval(), model.new_cache(1, 4096), buckets=tuple(tokens), cuda_graphs=True,
                         compile=False)
    runner.prefill(torch.randint(0, cfg.vocab_size, (ctx,), device="cuda"), 0)
    res = {}
    for T in tokens:
        ids = torch.randint(0, cfg.vocab_size, (T,), device="cuda")
        step = lambda: runner.step(ids, ctx)  # noqa: E731
        ms = time_median_s(step, warmup=5, repeats=100) * 1e3
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(opts["replays"]):
                step()
                torch.cuda.synchronize()
        steps = replay_kernels(prof, opts["replays"])
        floor = pass_floor_s(forward_cost(cfg, T, ctx), hw) * 1e3
        row = {"step_ms": round(ms, 4), "floor_ms": round(floor, 4), "over_floor": round(ms / floor, 3)}
        row.update({"error": steps} if isinstance(steps, str) else group(steps))
        res[f"T{T}"] = row
        print(name, f"T={T}", {k: row.get(k) for k in ("step_ms", "over_floor", "kernel_us", "span_us", "gaps_us",
                                                          "error")}, flush=True)
        for k in row.get("kernels", [])[:16]:
            print(f"  {k['us']:9.1f} us  x{k['launches']:<4d} {k['name']}", flush=True)
    del runner, model
    restore_kernel_switches(off)
    return res


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        return 0
    from specpilot.errors import ConfigError

    try:
        opts = parse(argv)
    except (ValueError, ConfigError) as e:  # (ConfigError: a value EngineConfig's own checks refuse)
        print(f"gpu_step_profile.py: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("gpu_step_profile.py needs CUDA", file=sys.stderr)
        return 2
    out = {name: measure(name, opts) for name in opts["shapes"]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
