#!/usr/bin/env python
"""GPU check of the fused MLP (kernels/fused_mlp.py, EngineConfig.fused_mlp) at real shapes, bf16.

  python3 scripts/gpu_fused_mlp_check.py [SHAPE ...]      (default qwen2.5-1.5b qwen3-8b)

1. Kernel: the pending sums against `fused_mlp_reference` (fp32 math over the same bf16 operands), eager and inside
   a CUDA graph launched with PDL, and how far five launches' sums spread (the atomics' order varies on a GPU).
2. Model: a random-weight model of the shape (models.random_model: the same weights every call), laid out by the
   engine (engine._apply_layout: today's defaults) with fused_mlp on and off, a 64-token prefill, then 16
   teacher-forced one-token steps through the graphed runner: the largest logit difference relative to the
   largest logit, and how many steps' argmax agree. Down's summation order is the only difference, so the logits
   should agree to bf16 rounding.
Prints one line a case and, last, one JSON object with the worst errors and a list of problems. GPU only.
"""

from __future__ import annotations

import json
import sys

import torch

from specpilot.config import EngineConfig
from specpilot.costmodel import synthetic_config
from specpilot.engine import _apply_layout, kernel_switches, restore_kernel_switches
from specpilot.engine.runner import ModelRunner
from specpilot.kernels import fused_mlp as fm
from specpilot.kernels import pdl
from specpilot.models import random_model

KERNEL_TOL = 1e-3  # pending sums: relative to the largest |sum| (fp32 sums of bf16 products: ~1e-6 expected)
LOGIT_TOL = 5e-2  # logits of a one-token step: relative to the largest |logit| (bf16 rounding flips propagate)


def _kernel_case(name: str, H: int, I: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    x = (2 * torch.randn(1, H, device=dev, generator=g)).to(bf)
    nw = (1 + 0.1 * torch.randn(H, device=dev, generator=g)).to(bf)
    wgu = (torch.randn(2 * I, H, device=dev, generator=g) / H ** 0.5).to(bf)
    wd = (torch.randn(H, I, device=dev, generator=g) / I ** 0.5).to(bf)
    down_t = wd.t().contiguous()
    want = fm.fused_mlp_reference(x, nw, 1e-6, wgu, wd)[0]
    scale = want.abs().max().item()
    runs = []
    for _ in range(5):
        pending = torch.zeros(H, device=dev)
        fm.fused_mlp(x, nw, 1e-6, wgu, down_t, pending)
        runs.append(pending)
    torch.cuda.synchronize()
    err = max((r - want).abs().max().item() for r in runs) / scale
    spread = max((r - runs[0]).abs().max().item() for r in runs) / scale
    settled_diff = max(int((fm.settle(x, r[None]) != fm.settle(x, runs[0][None])).sum()) for r in runs)
    pdl.set_enabled(True, torch.device(dev), "late", warn=False)
    graphed = torch.zeros(H, device=dev)
    try:
        fm.fused_mlp(x, nw, 1e-6, wgu, down_t, graphed)  # tuned / compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed.zero_()
            fm.fused_mlp(x, nw, 1e-6, wgu, down_t, graphed)
        graph.replay()
        torch.cuda.synchronize()
    finally:
        pdl.set_enabled(False, None, "late", warn=False)
    err_graph = (graphed - want).abs().max().item() / scale
    row = {"shape": name, "H": H, "I": I, "rel_err": err, "rel_err_graphed_pdl": err_graph, "run_spread": spread,
           "settled_elems_differing_between_runs": settled_diff}
    print("kernel", json.dumps(row), flush=True)
    return row


def _model_logits(cfg, on: bool, steps: int, ctx: int) -> list[torch.Tensor]:
    off = kernel_switches()
    try:
        model = random_model(cfg)
        _apply_layout(model, EngineConfig(device="cuda", dtype="bfloat16", fused_mlp=on))
        assert model.fused_mlp == on, "the engine did not lay the fused MLP out as asked"
        runner = ModelRunner(model, model.new_cache(1, 1024), buckets=(1,), cuda_graphs=True)
        g = torch.Generator(device="cuda").manual_seed(1)
        ids = torch.randint(0, cfg.vocab_size, (ctx + steps,), device="cuda", generator=g)
        runner.prefill(ids[:ctx], 0)
        out = [runner.step(ids[ctx + i:ctx + i + 1], ctx + i).clone() for i in range(steps)]
        torch.cuda.synchronize()
        del runner, model
        torch.cuda.empty_cache()
        return out
    finally:
        restore_kernel_switches(off)


def _model_case(name: str, steps: int = 16, ctx: int = 64) -> dict:
    cfg = synthetic_config(name)
    want = _model_logits(cfg, False, steps, ctx)
    got = _model_logits(cfg, True, steps, ctx)
    rel = max((a - b).abs().max().item() / a.abs().max().item() for a, b in zip(want, got))
    agree = sum(int(torch.equal(a.argmax(-1), b.argmax(-1))) for a, b in zip(want, got))
    row = {"shape": name, "steps": steps, "max_rel_logit_diff": rel, "argmax_agree": agree}
    print("model", json.dumps(row), flush=True)
    return row


def main(shapes: list[str]) -> int:
    from specpilot.errors import ConfigError

    for name in shapes:  # a bad shape name: one clear line, before anything else
        try:
            synthetic_config(name)
        except (ConfigError, KeyError, ValueError) as e:
            print(f"gpu_fused_mlp_check.py: {e}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("gpu_fused_mlp_check.py: no CUDA device", file=sys.stderr)
        return 2
    problems, kernels, models = [], [], []
    for name in shapes:
        cfg = synthetic_config(name)
        k = _kernel_case(name, cfg.hidden_size, cfg.intermediate_size)
        kernels.append(k)
        if not max(k["rel_err"], k["rel_err_graphed_pdl"]) <= KERNEL_TOL:
            problems.append(f"{name}: kernel sums off by {max(k['rel_err'], k['rel_err_graphed_pdl']):.2e}")
        m = _model_case(name)
        models.append(m)
        if not m["max_rel_logit_diff"] <= LOGIT_TOL:
            problems.append(f"{name}: logits off by {m['max_rel_logit_diff']:.2e}")
    print(json.dumps({"kernels": kernels, "models": models, "problems": problems}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["qwen2.5-1.5b", "qwen3-8b"]))
