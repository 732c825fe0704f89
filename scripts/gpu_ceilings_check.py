#!/usr/bin/env python
"""GPU check of the roofline cost model v1 (specpilot.costmodel): are its floors and predictions believable?

1. Measures this GPU's ceilings (`measure_ceilings`), caches them (`save_ceilings`) and prints them.
2. For qwen2.5-1.5b and qwen3-8b shapes: prints forward_cost, the floor and the predictions at T=1 and T=16
   (context 512), builds a random-weight bf16 DenseLM of that shape on the GPU, prefills 512 random tokens and
   times CUDA-graphed steps (`ModelRunner.step`, median of 50 replays via CUDA events) and eager steps (median of
   10), then prints measured / floor and measured / predicted. Also profiles one eager T=1 step to count its
   CUDA kernels against the cost model's estimate.

Floor and eager prediction use the real span (512 cached keys + T); the graphed prediction uses the whole KV pool
(1024 keys), because graphed steps attend over the full pool (engine/runner.py).

Output: human-readable lines, then, as the LAST stdout line, one JSON object with every number.
Exit status: 0 if all is well; 1 if a check failed (listed on stderr and under "problems": a non-finite or
non-positive time, a graphed step faster than 0.8 x its floor, which is physically impossible and would mean a
bug in the model or the measurement, or a model whose measurement raised: its traceback goes to stderr and the
other model still runs); an exception while measuring the ceilings propagates (traceback, exit 1); 2 without CUDA.
Budget: well under 3 minutes on one H200 (~150 GB of HBM is plenty: the 8B peaks near 35 GB while being cast).
"""

from __future__ import annotations

import gc
import json
import math
import sys
import time
import traceback

import torch

from specpilot.costmodel.hardware import time_median_s
from specpilot.costmodel import (
    forward_cost,
    measure_ceilings,
    param_count,
    pass_floor_s,
    pass_predicted_s,
    save_ceilings,
    synthetic_config,
)
from specpilot.engine.runner import ModelRunner
from specpilot.models import random_model
from specpilot.models.dense import DenseLM

MODELS = ("qwen2.5-1.5b", "qwen3-8b")
TOKENS = (1, 16)
CONTEXT = 512  # tokens prefilled before the timed steps
POOL = 1024  # KV cache slots
GRAPHED_REPEATS, EAGER_REPEATS = 50, 10
FLOOR_SANITY = 0.8  # a measured step below this fraction of its floor is impossible: flagged as a problem

problems: list[str] = []
warnings: list[str] = []


def _finite(x):
    """JSON-safe number: non-finite floats become None (and are reported as problems by the caller)."""
    return x if x is None or not isinstance(x, float) or math.isfinite(x) else None


def time_calls(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of fn() on the current stream, each call bracketed by its own CUDA events."""
    return time_median_s(fn, warmup=warmup, repeats=repeats)


def build_model(cfg, device: str = "cuda") -> DenseLM:
    """Random-weight DenseLM of cfg's shape on the GPU in bf16."""
    return random_model(cfg, dtype=torch.bfloat16, device=device)


def count_kernels(fn) -> int:
    """CUDA kernels (and memcpy/memset) launched by one call of fn, from the profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    n = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
    if n == 0:
        raise RuntimeError("the profiler saw no CUDA kernels (CUPTI unavailable?)")
    return n


def analytic(cfg, hw, T: int) -> dict:
    floor_cost = forward_cost(cfg, T, CONTEXT)
    graphed_cost = forward_cost(cfg, T, POOL - T)  # graphed steps read the whole pool
    floor = pass_floor_s(floor_cost, hw)
    return {
        "weight_bytes": floor_cost.weight_bytes, "kv_bytes": floor_cost.kv_bytes,
        "activation_bytes": floor_cost.activation_bytes, "flops": floor_cost.flops,
        "num_kernels_estimate": floor_cost.num_kernels,
        "bound": "bandwidth" if floor_cost.total_bytes / hw.hbm_bytes_per_s >= floor_cost.flops / hw.bf16_flops_per_s
        else "compute",
        "floor_s": floor,
        "predicted_graphed_s": pass_predicted_s(graphed_cost, hw, graphed=True),
        "predicted_eager_s": pass_predicted_s(floor_cost, hw, graphed=False),
    }


def measure_model(name: str, cfg, rows: dict[int, dict]) -> dict:
    t0 = time.monotonic()
    model = build_model(cfg)
    cache = model.new_cache(1, POOL)
    runner = ModelRunner(model, cache, buckets=TOKENS, cuda_graphs=True)
    if sorted(runner.graphs) != sorted(TOKENS):
        raise RuntimeError(f"{name}: ModelRunner captured graphs for {sorted(runner.graphs)}, expected {TOKENS}")
    eager = ModelRunner(model, cache)  # same weights and cache, no graphs
    runner.prefill(torch.randint(0, cfg.vocab_size, (CONTEXT,), device="cuda"), 0)
    built_s = time.monotonic() - t0
    out: dict = {"build_and_capture_s": built_s}
    for T in TOKENS:
        ids = torch.randint(0, cfg.vocab_size, (T,), device="cuda")
        row = rows[T]
        row["measured_graphed_s"] = time_calls(lambda: runner.step(ids, CONTEXT), GRAPHED_REPEATS)
        row["logits_finite"] = bool(torch.isfinite(runner.step(ids, CONTEXT)).all())
        row["measured_eager_s"] = time_calls(lambda: eager.step(ids, CONTEXT), EAGER_REPEATS, warmup=2)
        row["measured_over_floor"] = row["measured_graphed_s"] / row["floor_s"]
        row["measured_over_predicted"] = row["measured_graphed_s"] / row["predicted_graphed_s"]
        row["eager_over_predicted"] = row["measured_eager_s"] / row["predicted_eager_s"]
        row["achieved_weight_bytes_per_s"] = row["weight_bytes"] / row["measured_graphed_s"]
        check_row(f"{name} T={T}", row)
    ids1 = torch.randint(0, cfg.vocab_size, (1,), device="cuda")
    try:
        with torch.inference_mode():
            out["kernels_profiled_eager_T1"] = count_kernels(lambda: eager.step(ids1, CONTEXT))
    except Exception as e:  # auxiliary number: report loudly, keep the main results
        traceback.print_exc()
        warnings.append(f"{name}: kernel count failed: {type(e).__name__}: {e}")
        out["kernels_profiled_eager_T1"] = None
    del runner, eager, cache, model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def check_row(label: str, row: dict) -> None:
    for key in ("measured_graphed_s", "measured_eager_s", "floor_s", "predicted_graphed_s"):
        v = row[key]
        if not (isinstance(v, float) and math.isfinite(v) and v > 0):
            problems.append(f"{label}: {key} = {v!r} is not a positive finite time")
    if row["measured_graphed_s"] < FLOOR_SANITY * row["floor_s"]:
        problems.append(f"{label}: graphed step {row['measured_graphed_s'] * 1e3:.3f} ms is below "
                        f"{FLOOR_SANITY} x its floor {row['floor_s'] * 1e3:.3f} ms: impossible")
    if not row["logits_finite"]:
        warnings.append(f"{label}: random-weight logits are not all finite (timing is still valid)")


def check_ceilings(hw) -> None:
    for key in ("hbm_bytes_per_s", "bf16_flops_per_s", "launch_s", "graph_kernel_s", "gemv_bytes_per_s"):
        v = getattr(hw, key)
        if not (math.isfinite(v) and v > 0):
            problems.append(f"ceiling {key} = {v!r} is not positive and finite")


def print_ceilings(hw, seconds: float) -> None:
    print(f"== ceilings of {hw.name} (measured in {seconds:.1f} s)")
    print(f"   HBM copy bandwidth   {hw.hbm_bytes_per_s / 1e12:8.3f} TB/s (read + write)")
    print(f"   bf16 matmul          {hw.bf16_flops_per_s / 1e12:8.1f} TFLOP/s (8192^3)")
    print(f"   eager launch         {hw.launch_s * 1e6:8.2f} us / kernel")
    print(f"   graphed kernel       {hw.graph_kernel_s * 1e6:8.2f} us / kernel")
    print(f"   graphed GEMV chain   {hw.gemv_bytes_per_s / 1e12:8.3f} TB/s of weights (1.5B-like, M=1)")


def print_row(name: str, T: int, row: dict) -> None:
    total = row["weight_bytes"] + row["kv_bytes"] + row["activation_bytes"]
    print(f"   {name} T={T:<2} bytes {total / 1e9:6.2f} GB  flops {row['flops'] / 1e12:6.3f} T"
          f"  kernels~{row['num_kernels_estimate']}  [{row['bound']}-bound]")
    print(f"      floor {_ms(row['floor_s'])}  predicted graphed {_ms(row['predicted_graphed_s'])}"
          f"  eager {_ms(row['predicted_eager_s'])}")


def print_measured(name: str, T: int, row: dict) -> None:
    print(f"   {name} T={T:<2} measured graphed {_ms(row['measured_graphed_s'])}  measured/floor "
          f"{row['measured_over_floor']:.3f}  measured/predicted {row['measured_over_predicted']:.3f}"
          f"  | eager {_ms(row['measured_eager_s'])}  eager/predicted {row['eager_over_predicted']:.3f}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f} ms"


def main() -> int:
    if not torch.cuda.is_available():
        print("error: CUDA is not available; this script needs an NVIDIA GPU", file=sys.stderr)
        return 2
    started = time.monotonic()
    hw = measure_ceilings("cuda")
    measure_s = time.monotonic() - started
    check_ceilings(hw)
    try:
        cached_at = str(save_ceilings(hw))
    except OSError as e:  # the numbers matter more than the cache: say so and go on
        warnings.append(f"could not cache the ceilings: {e}")
        cached_at = None
    print_ceilings(hw, measure_s)
    result = {"hardware": hw.to_dict(), "measure_s": measure_s, "cached_at": cached_at, "context_len": CONTEXT,
              "kv_pool": POOL, "torch": torch.__version__, "cuda": torch.version.cuda, "models": {}}
    for name in MODELS:
        cfg = synthetic_config(name)
        rows = {T: analytic(cfg, hw, T) for T in TOKENS}
        entry = result["models"][name] = {"params": param_count(cfg), **{f"T{T}": rows[T] for T in TOKENS}}
        print(f"== {name}: {param_count(cfg) / 1e9:.3f} B params")
        for T in TOKENS:
            print_row(name, T, rows[T])
        try:
            entry.update(measure_model(name, cfg, rows))
        except Exception as e:  # keep the other model's numbers, but fail the run
            traceback.print_exc()
            problems.append(f"{name}: measurement failed: {type(e).__name__}: {e}")
            gc.collect()
            torch.cuda.empty_cache()
            continue
        for T in TOKENS:
            print_measured(name, T, rows[T])
        print(f"   kernels per eager T=1 step: estimate {rows[1]['num_kernels_estimate']}, "
              f"profiled {entry['kernels_profiled_eager_T1']}")
    result["total_s"] = time.monotonic() - started
    result["warnings"], result["problems"] = warnings, problems
    for msg in warnings:
        print(f"WARNING: {msg}", file=sys.stderr)
    for msg in problems:
        print(f"PROBLEM: {msg}", file=sys.stderr)
    print(json.dumps(_json_safe(result)), flush=True)
    return 1 if problems else 0


def _json_safe(obj):
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return _finite(obj)


if __name__ == "__main__":
    sys.exit(main())
