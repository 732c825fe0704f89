#!/usr/bin/env python
"""Why one CUDA graph capture fails: session 47's fused_decode n-gram engine (fp32 check model, norm + RoPE kernels,
fused decode without rope_in_qkv, buckets 1 and 5) lost its T=1 capture to cudaErrorStreamCaptureInvalidated, while
the AR engine on the same model captured T=1 fine. The tokens stayed equal (the bucket ran eagerly); the cause was
unknown. Session 48 (a fresh H100): no case here failed, and neither did the check itself, plain or with these
hooks (BENCHMARKS.md session 48); kept for the next time a capture fails.

This builds that engine in a few orders and settings and, around every capture, records what usually breaks one:
a Triton kernel whose module is first loaded while the stream is capturing (cuModuleLoad is not a stream operation,
and a global-mode capture is invalidated by it), and host syncs (torch's sync debug mode). On a failed capture it
prints the traceback of the op that reported it. Cases: ngram_fresh (a fresh model copy, n-gram engine alone),
after_ar (the check's order: AR engine, then n-gram on the same model), ngram_relaxed (the n-gram engine with
captures in relaxed error mode: passing there points at an unsafe API call rather than a sync), ar_twice (two AR
engines on one model: a second engine alone), ngram_no_kernels (fused decode without the norm and RoPE kernels).
Session 49 found the likely cause (engine/graphs.py's docstring): a CUDA graph destroyed while another records,
by a cyclic garbage collection that ran mid-capture. Three torch-only cases test that: graph_freed_in_capture (an
earlier graph's last reference dropped inside a capture: does that invalidate it?), gc_cycle_raw (an earlier graph
in a reference cycle, the collector made eager, a plain torch.cuda.graph capture) and gc_cycle_guarded (the same
through engine/graphs.capture, which keeps the collector off while recording).
`python scripts/gpu_capture_probe.py [case,...]`. Last stdout line: one JSON object.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import traceback
import warnings

import torch

import specpilot.engine.runner as runner_mod
from specpilot.config import EngineConfig
from specpilot.costmodel import synthetic_config
from specpilot.engine import Engine, build_drafter
from specpilot.engine.graphs import capture
from specpilot.models import random_model

LOADS: list = []  # (kernel name, capturing) for every Triton module load
MODE = {"capture_error_mode": "global", "phase": ""}


def _hook_triton_loads() -> None:
    from triton.compiler.compiler import CompiledKernel

    orig = CompiledKernel._init_handles

    def init_handles(self):
        if self.module is None:
            capturing = torch.cuda.is_current_stream_capturing()
            LOADS.append((MODE["phase"], self.name, capturing))
            if capturing:
                print(f"  module load DURING capture: {self.name} ({MODE['phase']})", flush=True)
        return orig(self)

    CompiledKernel._init_handles = init_handles


def probing_capture(fn, *, warmup: int = 2, pool=None):
    """engine/graphs.capture in the error mode chosen here, syncs reported inside the capture only (the warm-ups may
    sync), and a traceback on failure."""
    def fn_checked():
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            return fn()
        finally:
            if capturing:
                torch.cuda.set_sync_debug_mode(0)

    try:
        return capture(fn_checked, warmup=warmup, pool=pool, capture_error_mode=MODE["capture_error_mode"])
    except RuntimeError:
        print(f"  capture FAILED ({MODE['phase']}):", flush=True)
        traceback.print_exc()
        raise


CASES = ("ngram_fresh", "after_ar", "ngram_relaxed", "ar_twice", "ngram_no_kernels", "graph_freed_in_capture",
         "gc_cycle_raw", "gc_cycle_guarded")


def graph_case(name: str) -> dict:
    """One of the torch-only cases (module docstring) -> {"captured": bool, "error": first line or ""}."""
    import gc

    x = torch.randn(64, 64, device="cuda")

    def small_graph():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            x.mul_(1.0)
        return g

    holder = {"old": small_graph()}
    if name != "graph_freed_in_capture":  # the old graph only in a cycle: a collection destroys it
        cycle = {"graph": holder.pop("old")}
        cycle["me"] = cycle
        del cycle
    thresholds = gc.get_threshold()

    def body():  # (the collector made eager only here, inside the capture: earlier it would free the cycle first)
        gc.set_threshold(1, 1, 1)
        holder.pop("old", None)  # graph_freed_in_capture: the last reference goes here
        for _ in range(200):  # Python allocations: with the eager collector, collections run here
            [[]]
        return x * 2

    try:
        if name == "gc_cycle_guarded":
            capture(body, warmup=0)
        else:
            torch.cuda.synchronize()
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                body()
        return {"captured": True, "error": ""}
    except RuntimeError as e:
        return {"captured": False, "error": str(e).splitlines()[0][:160]}
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()
        torch.cuda.synchronize()


def main() -> int:
    only = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CASES)
    unknown = [c for c in only if c not in CASES]
    if unknown or len(sys.argv) > 2:
        print(f"gpu_capture_probe.py [case,...]: unknown case(s) {unknown or sys.argv[2:]}; cases: {', '.join(CASES)}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():  # a GPU script: one clear line, not a traceback from the first CUDA tensor
        print("gpu_capture_probe.py needs a CUDA GPU (it captures CUDA graphs); none here", file=sys.stderr)
        return 2
    result = {}
    for name in [c for c in only if c.startswith(("graph_", "gc_"))]:  # first: they build no engine
        result[name] = graph_case(name)
        print(name, result[name], flush=True)
    only = [c for c in only if c not in result]
    if not only:
        print(json.dumps(result))
        return 0
    _hook_triton_loads()
    runner_mod.capture = probing_capture
    cfg = dataclasses.replace(synthetic_config("qwen2.5-0.5b"), num_hidden_layers=4)
    target = random_model(cfg, dtype=torch.float32, seed=0)
    base = EngineConfig(drafter_kind="none", device="cuda", max_new_tokens=48, max_seq_len=256, ignore_eos=True,
                        num_draft_tokens=4)
    ngram = base.with_(drafter_kind="ngram")
    g = torch.Generator().manual_seed(0)
    prompt = (torch.randint(0, 1000, (7,), generator=g).tolist() * 4)[:20]

    def fast():
        return copy.deepcopy(target).use_norm_kernel().use_rope_kernel().use_fused_decode()

    def case(name, steps, mode="global"):
        MODE["capture_error_mode"] = mode
        fails = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for label, model, c in steps:
                MODE["phase"] = f"{name}/{label}"
                print(f"{MODE['phase']}: building", flush=True)
                eng = Engine(model, c, build_drafter(c, None, model))
                eng.generate(prompt)
        for w in caught:
            msg = str(w.message)
            if "capture failed" in msg:
                fails.append(msg[:160])
            elif "sync" in msg.lower():
                print(f"  sync warning: {msg[:200]}", flush=True)
        result[name] = {"capture_failures": fails,
                        "loads_in_capture": [n for p, n, cap in LOADS if cap and p.startswith(name + "/")]}
        print(name, result[name], flush=True)

    cases = {
        "ngram_fresh": lambda: case("ngram_fresh", [("ngram", fast(), ngram)]),
        "after_ar": lambda: (lambda m: case("after_ar", [("ar", m, base), ("ngram", m, ngram)]))(fast()),
        "ngram_relaxed": lambda: case("ngram_relaxed", [("ngram", fast(), ngram)], mode="relaxed"),
        "ar_twice": lambda: (lambda m: case("ar_twice", [("ar1", m, base), ("ar2", m, base)]))(fast()),
        "ngram_no_kernels": lambda: case("ngram_no_kernels", [("ngram", copy.deepcopy(target).use_fused_decode(),
                                                                ngram)]),
    }
    for name, run in cases.items():
        if name in only:
            try:
                run()
            except Exception as e:  # report and go on
                traceback.print_exc()
                result[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
