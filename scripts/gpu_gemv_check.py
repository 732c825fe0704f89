#!/usr/bin/env python
"""GPU check of the Triton GEMV (kernels/gemv.py): parity with the reference, bandwidth vs cuBLAS at real layer
shapes (each row timed as 20 calls captured in one CUDA graph: eager timing at these sizes is launch-bound), and a
CUDA-graphed decode/verify step (T = 1, 16) with and without it (random weights, bf16), then the split-K tl.dot path
(`gemv_split_k`) at M = 16 on the narrow shapes (N <= 2048, where the one-launch path lost to cuBLAS) with SPLIT_K
2, 4, 8 and the automatic choice: "splitk" rows, started only while the whole run is under SPLITK_DEADLINE_S (the
run stays < 150 s; rows not started are listed in "splitk_skipped"). `--splitk-only`: just the narrow M = 16 rows
(cuBLAS, one-launch Triton, split-K; no step timing, no deadline). Last stdout line: JSON."""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

from specpilot.costmodel import forward_cost, load_or_measure, pass_floor_s, synthetic_config
from specpilot.costmodel.hardware import time_median_s
from specpilot.engine.runner import ModelRunner
from specpilot.kernels.gemv import choose_split_k, gemv, gemv_reference, gemv_split_k, sm_count
from specpilot.models import random_model

SHAPES = {  # (N, K) of fused projections
    "0.5b qkv": (1152, 896), "0.5b gate_up": (9728, 896), "0.5b down": (896, 4864),
    "1.5b qkv": (2048, 1536), "1.5b gate_up": (17920, 1536), "1.5b down": (1536, 8960), "1.5b lm_head": (151936, 1536),
    "8b qkv": (6144, 4096), "8b gate_up": (24576, 4096), "8b down": (4096, 12288),
}
# split-K rows, most informative first: the three narrow shapes that lost to cuBLAS at M = 16 (session 11)
SPLITK_SHAPES = ("1.5b down", "0.5b down", "1.5b qkv", "0.5b qkv")
SPLITK_VALUES = (2, 4, 8)
SPLITK_DEADLINE_S = 130.0


def graphed_s(fn, calls: int = 20, repeats: int = 20) -> float:
    """Seconds per call of `fn`, from `calls` calls captured in one CUDA graph and replayed (median of `repeats`)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (autotuning happens here, outside capture)
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return sorted(times)[len(times) // 2]


def main(flags=()) -> int:
    t0 = time.perf_counter()
    only_splitk = "--splitk-only" in flags
    out, problems = {"parity": {}, "gemv": {}, "step": {}, "splitk": {}, "splitk_skipped": []}, []
    for M in (1, 2, 5, 16):
        for N, K in ((2048, 1536), (1536, 8960), (300, 4100)):
            x, w = torch.randn(M, K, device="cuda").bfloat16(), torch.randn(N, K, device="cuda").bfloat16()
            y = gemv(x, w).float()
            ref = gemv_reference(x.double(), w.double()).float()
            rel = ((y - ref).norm() / ref.norm()).item()
            out["parity"][f"M{M} {N}x{K}"] = rel
            if not rel < 1e-2 or not torch.isfinite(y).all():
                problems.append(f"parity M{M} {N}x{K}: {rel}")
    for M in (2, 16):  # split-K: 3 slices leave the last one short (K blocks not a multiple of 3)
        for N, K in ((1536, 8960), (300, 4100)):
            x, w = torch.randn(M, K, device="cuda").bfloat16(), torch.randn(N, K, device="cuda").bfloat16()
            b = torch.randn(N, device="cuda").bfloat16()
            y = gemv_split_k(x, w, b, 3)
            ref = gemv_reference(x.double(), w.double(), b.double()).float()
            rel = ((y.float() - ref).norm() / ref.norm()).item()
            out["parity"][f"splitk3 M{M} {N}x{K}"] = rel
            if not rel < 1e-2 or not torch.isfinite(y).all():
                problems.append(f"parity splitk3 M{M} {N}x{K}: {rel}")
            if not torch.equal(y, gemv_split_k(x, w, b, 3)):
                problems.append(f"split-K not deterministic M{M} {N}x{K}")
    print("parity", out["parity"], flush=True)
    shapes = {k: SHAPES[k] for k in SPLITK_SHAPES} if only_splitk else SHAPES
    for name, (N, K) in shapes.items():
        ws = [torch.randn(N, K, device="cuda").bfloat16() for _ in range(4)]  # rotate: more than L2 holds
        for M in ((16,) if only_splitk else (1, 16)):
            x = torch.randn(M, K, device="cuda").bfloat16()
            i = [0]

            def pick():
                i[0] = (i[0] + 1) % len(ws)
                return ws[i[0]]

            t_lib = graphed_s(lambda: F.linear(x, pick()))
            t_tri = graphed_s(lambda: gemv(x, pick()))
            gb = N * K * 2 / 1e9
            row = {"cublas_TBps": round(gb / t_lib / 1e3, 3), "triton_TBps": round(gb / t_tri / 1e3, 3),
                   "cublas_us": round(t_lib * 1e6, 1), "triton_us": round(t_tri * 1e6, 1)}
            out["gemv"][f"{name} M{M}"] = row
            print(name, M, row, flush=True)
    hw = None if only_splitk else load_or_measure("cuda")
    for name in (() if only_splitk else ("qwen2.5-1.5b", "qwen3-8b")):
        cfg = synthetic_config(name)
        model = random_model(cfg)
        model.fuse_projections().eval()
        for variant in ("cublas", "triton"):
            if variant == "triton":
                model.use_gemv_kernel()
            runner = ModelRunner(model, model.new_cache(1, 1024), buckets=(1, 16), cuda_graphs=True)
            runner.prefill(torch.randint(0, cfg.vocab_size, (512,), device="cuda"), 0)
            for T in (1, 16):
                ids = torch.randint(0, cfg.vocab_size, (T,), device="cuda")
                ms = time_median_s(lambda: runner.step(ids, 512), warmup=5, repeats=100) * 1e3
                floor = pass_floor_s(forward_cost(cfg, T, 512), hw) * 1e3
                row = {"ms": round(ms, 4), "over_floor": round(ms / floor, 3)}
                out["step"][f"{name} {variant} T{T}"] = row
                print(name, variant, T, row, flush=True)
            del runner
        del model
        torch.cuda.empty_cache()
    sms = sm_count(torch.device("cuda"))
    for name in SPLITK_SHAPES:
        N, K = SHAPES[name]
        auto = choose_split_k(N, K, sms)
        splits = sorted(set(SPLITK_VALUES) | {auto})
        if not only_splitk and time.perf_counter() - t0 > SPLITK_DEADLINE_S:
            out["splitk_skipped"] += [f"{name} M16 S{s}" for s in splits]
            continue
        ws = [torch.randn(N, K, device="cuda").bfloat16() for _ in range(4)]
        x = torch.randn(16, K, device="cuda").bfloat16()
        i = [0]

        def pick_w():
            i[0] = (i[0] + 1) % len(ws)
            return ws[i[0]]

        base = out["gemv"].get(f"{name} M16", {})
        for split in splits:
            key = f"{name} M16 S{split}"
            if not only_splitk and time.perf_counter() - t0 > SPLITK_DEADLINE_S:
                out["splitk_skipped"].append(key)
                continue
            t = graphed_s(lambda: gemv_split_k(x, pick_w(), None, split))
            gb = N * K * 2 / 1e9
            row = {"split_k": split, "auto": split == auto, "triton_splitk_TBps": round(gb / t / 1e3, 3),
                   "triton_splitk_us": round(t * 1e6, 1), "cublas_TBps": base.get("cublas_TBps"),
                   "triton_TBps": base.get("triton_TBps")}
            out["splitk"][key] = row
            print("split-K", key, row, flush=True)
    out["problems"] = problems
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main([a for a in sys.argv[1:] if a.startswith("--")]))
