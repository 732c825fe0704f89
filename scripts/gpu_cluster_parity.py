#!/usr/bin/env python
"""GPU parity of the cluster attention (kernels/cluster_attention.py) at real decode shapes, bf16.

For each shape (Qwen2.5-1.5B: 12 / 2 heads of 128; Qwen3-8B: 32 / 8 heads of 128), cluster size (4, 8, 16) and
position (one cluster, several, the pool's last slot), the one-token attention through the cluster kernel against
`decode_attention_reference` (fp32 math) and against the one-launch kernel (decode_attention's), eager and inside
a CUDA graph launched with PDL. Prints one line a case and, last, one JSON object: the worst errors and a list of
problems (an error over the tolerance, a non-finite output). GPU only (sm_90+).
"""

from __future__ import annotations

import json
import sys

import torch

from specpilot.kernels import cluster_attention as ca
from specpilot.kernels import decode_attention as da
from specpilot.kernels import pdl

SHAPES = {"qwen2.5-1.5b": (12, 2, 128), "qwen3-8b": (32, 8, 128)}
POSITIONS = (0, 1, 63, 64, 127, 128, 511, 700, 1023, 1024, 2047, 2048, 3000, 4095)
# (cluster size, mode, keys a tile): the fixed 128-key slices at each size, the even split (cluster_attention.EVEN),
# the partials pushed (PUSH, the default since session 49) and both (what the loop's attn_cluster_even runs now)
CASES = ((4, "", 128), (8, "", 128), (16, "", 128), (8, "even", 128), (8, "even", 64), (16, "even", 64),
         (4, "push", 128), (8, "push", 128), (16, "push", 128), (8, "even+push", 128), (16, "even+push", 64))


TOL = 2e-2  # bf16 output: ~3 ulp at |x| ~ 1


def _set(C: int, mode: str) -> None:
    """The cluster kernel's process-wide switches for one case."""
    ca.CLUSTER, ca.EVEN, ca.PUSH = C, "even" in mode, "push" in mode


def _key(shape: str, C: int, mode: str, blk: int) -> str:
    """One case's label in the printed lines and the JSON."""
    return f"{shape} C={C}{' ' + mode if mode else ''} tile={blk}"


def main() -> int:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    S, problems, worst = 4096, [], {}
    for shape, (H, Hkv, D) in SHAPES.items():
        q = torch.randn(1, H, 1, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, Hkv, S, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, Hkv, S, D, device=dev, dtype=torch.bfloat16)
        for C, mode, blk in CASES:
            _set(0, mode)
            for p in POSITIONS:
                pos = torch.tensor([[p]], device=dev, dtype=torch.int64)
                ref = da.decode_attention_reference(q, k, v, pos).float()
                ca.CLUSTER = 0
                base = da.decode_attention(q, k, v, pos, split_s=128, block_s=blk, one_launch=True).float()
                ca.CLUSTER = C
                got = da.decode_attention(q, k, v, pos, split_s=128, block_s=blk, one_launch=True).float()
                ca.CLUSTER = 0
                e_ref = (got - ref).abs().max().item()
                e_base = (got - base).abs().max().item()
                key = _key(shape, C, mode, blk)
                worst[key] = max(worst.get(key, 0.0), e_ref)
                print(f"{key} p={p}: vs reference {e_ref:.3e}, vs one-launch {e_base:.3e}", flush=True)
                if not torch.isfinite(got).all() or e_ref > TOL:
                    problems.append(f"{key} p={p}: {e_ref:.3e}")
        # inside a CUDA graph, launched with PDL, the position moved between replays (as a decode step does)
        pdl.set_enabled(True, dev, "late", warn=False)
        try:
            for C, mode, blk in CASES:
                _set(C, mode)
                pos = torch.zeros(1, 1, device=dev, dtype=torch.int64)
                out = da.decode_attention(q, k, v, pos, split_s=128, block_s=blk, one_launch=True)  # compile, warm
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = da.decode_attention(q, k, v, pos, split_s=128, block_s=blk, one_launch=True)
                for p in (5, 600, 2100, 4095):
                    pos.fill_(p)
                    graph.replay()
                    torch.cuda.synchronize()
                    e = (out.float() - da.decode_attention_reference(q, k, v, pos).float()).abs().max().item()
                    key = _key(shape, C, mode, blk)
                    print(f"{key} graph+PDL p={p}: vs reference {e:.3e}", flush=True)
                    if not torch.isfinite(out).all() or e > TOL:
                        problems.append(f"{key} graph p={p}: {e:.3e}")
        finally:
            _set(0, "")
            pdl.set_enabled(False, None, "late", warn=False)
    print(json.dumps({"worst_vs_reference": worst, "problems": problems}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
