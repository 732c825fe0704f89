#!/usr/bin/env python
"""Registers, occupancy and waves of the fused one-row GEMV's tiles at a model's shapes, compiled here for sm_90.

  python scripts/gemv_occupancy.py [qwen2.5-1.5b|qwen3-8b ...] [--pipe]

No GPU needed: each tile is compiled by Triton for sm_90 (PDL on, the late trigger, each layer GEMV's norm /
residual / SiLU x up flags; not its L2 warming, a few bulk prefetches before the wait) and assembled by the ptxas
Triton bundles (`ptxas -v`: registers, spills), with the pointers, N, K and the row stride given 16-divisibility as
Triton's JIT specialises them (without it the loads come out as scalar 16-bit ones and the register counts double).
Occupancy: 64 K registers, 64 warps and 228 KB of shared memory an SM (sm_90), registers allocated per warp in 256s;
waves = programs / (programs resident an SM x 132 SMs).
The tile of each GEMV is the H200 table's pick (kernels/tuned/nvidia-h200.json) where it has one, else 4 x 256 with
4 warps. Prints one line a GEMV and a JSON list last. Why: what a tile costs an SM (registers, so programs
resident) and how its launch spreads over the SMs, which the autotuner's timings do not show (BENCHMARKS.md, session
35: the 1.5B gate/up pick is 2.12 programs an SM, three on some SMs, yet balanced tiles were no faster).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SMS, REGS_PER_SM, WARPS_PER_SM, SMEM_PER_SM = 132, 65536, 64, 228 * 1024


def resident(regs: int, warps: int, smem: int) -> int:
    """Programs of `warps` warps, `regs` registers a thread and `smem` bytes of shared memory one sm_90 SM holds."""
    per_warp = math.ceil(regs * 32 / 256) * 256
    by_regs = REGS_PER_SM // (per_warp * warps)
    by_smem = SMEM_PER_SM // smem if smem else 32
    return min(by_regs, WARPS_PER_SM // warps, by_smem, 32)


def layer_gemvs(cfg) -> list[tuple[str, int, int, dict]]:
    """(name, output columns, K, flags) of a dense layer's one-row GEMVs as the fused one-token path launches them
    (qkv goes through kernels/qkv_rope.py, not this kernel) and the LM head."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return [("gate_up", inter, h, dict(HAS_NORM=True, SILU_MUL=True)), ("down", h, inter, dict(HAS_RES=True)),
            ("o_proj", h, cfg.num_attention_heads * cfg.head_dim, dict(HAS_RES=True)),
            ("lm_head", cfg.vocab_size, h, {})]


def pick(n: int, k: int, flags: dict, pipe: bool) -> tuple[dict, int, int]:
    from specpilot.kernels import gemv_fused as gf
    from specpilot.kernels import tuned

    key = {name: False for name in gf._KEY}
    key.update(N=n, K=k, PIPE=pipe, dtype="bfloat16", **flags)
    got = tuned.load("NVIDIA H200").get(("_gemv_fused_kernel", tuned._key(key)))
    return got or ({"BLOCK_N": 4, "BLOCK_K": 256}, 4, 1)


def compile_tile(n: int, k: int, flags: dict, kwargs: dict, warps: int, stages: int, pipe: bool) -> dict:
    """-> registers, spilled bytes and shared memory of the one-row kernel for this tile, compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from specpilot.kernels import gemv_fused as gf

    fn = gf._gemv_fused_kernel
    consts = dict(HAS_BIAS=False, HAS_NORM=False, HAS_RES=False, SILU_MUL=False, ON_GPU=True, K_P2=1, PAIRED=False,
                  NORM_OUT=False, OUT_P2=1, PREFETCH=False, PDL_LATE=True, L2_PF=False, NX_PF=False, USE_PDL=True,
                  PIPE=pipe)
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}  # the rest off
    consts.update(flags)
    consts.update(kwargs)
    if consts["HAS_NORM"]:
        consts["K_P2"] = triton.next_power_of_2(k)

    def types(name):
        return "*i32" if name == "ocnt_ptr" else "*bf16" if name.endswith("_ptr") else \
            "fp32" if name in ("eps", "out_eps") else "i32"

    sig = {name: "constexpr" if name in consts else types(name) for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig[name] != "constexpr" and (name.endswith("_ptr") or name in ("N", "K", "stride_wn"))}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages, "launch_pdl": True})
    ptxas = get_ptxas(90)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        out = subprocess.run([getattr(ptxas, "path", ptxas), "-v", "--gpu-name=sm_90a", str(ptx), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True, check=True).stderr
    return {"registers": int(re.search(r"Used (\d+) registers", out).group(1)),
            "spill_bytes": int(re.search(r"(\d+) bytes spill stores", out).group(1)),
            "shared_bytes": compiled.metadata.shared}


def report(shape: str, pipe: bool = False) -> list[dict]:
    from specpilot.costmodel import synthetic_config

    rows = []
    for name, n, k, flags in layer_gemvs(synthetic_config(shape)):
        kwargs, warps, stages = pick(n, k, flags, pipe)
        got = compile_tile(n, k, flags, kwargs, warps, stages, pipe)
        per_sm = resident(got["registers"], warps, got["shared_bytes"])
        programs = math.ceil(n / kwargs["BLOCK_N"])
        rows.append({"shape": shape, "gemv": name, "N": n, "K": k, "tile": kwargs, "num_warps": warps,
                     "num_stages": stages, **got, "resident_per_sm": per_sm, "programs": programs,
                     "waves": round(programs / (per_sm * SMS), 2)})
    return rows


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    shapes = [a for a in argv if not a.startswith("--")] or ["qwen2.5-1.5b", "qwen3-8b"]
    bad = [a for a in argv if a.startswith("--") and a != "--pipe"]
    if bad:
        print(f"gemv_occupancy: unknown option {bad[0]} (takes SHAPE ... [--pipe])", file=sys.stderr)
        return 2
    import os

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("gemv_occupancy: compiles kernels; run it without TRITON_INTERPRET", file=sys.stderr)
        return 2
    rows = []
    for shape in shapes:
        for r in report(shape, "--pipe" in argv):
            rows.append(r)
            print(f"{r['shape']} {r['gemv']:8s} {r['N']}x{r['K']} tile {r['tile']} w{r['num_warps']}: "
                  f"{r['registers']} registers, {r['spill_bytes']} B spilled, {r['resident_per_sm']} programs an SM, "
                  f"{r['programs']} programs = {r['waves']} waves", flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
