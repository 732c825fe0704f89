"""Compile the traced kernels (kernels/trace.py) for sm_90 with TRACE off and on (no GPU needed) and report where the
timer reads land in PTX.

Run as a script, without TRITON_INTERPRET (tests/test_trace.py starts it in a subprocess, as tests/pdl_ptx.py).
Prints one JSON object: case -> for TRACE off and on, the PTX line numbers of every %globaltimer read, of the PDL
wait, and the counts of %clock64 / %smid reads and of 64-bit global stores (the kernels store none of their own:
their outputs, partials and counters are 16- and 32-bit).
"""

from __future__ import annotations

import json
import os
import re
import sys

from pdl_ptx import sm90_source, with_defaults


def _cases():
    from specpilot.kernels import decode_attention as da
    from specpilot.kernels import gemv_fused as gf
    from specpilot.kernels import qkv_rope as qr

    def gemv_types(n):
        return "*i64" if n == "tr_ptr" else "*i32" if n == "ocnt_ptr" else "*bf16" if n.endswith("_ptr") \
            else "fp32" if n in ("eps", "out_eps") else "i32"

    def qkv_types(n):
        return {"tr_ptr": "*i64", "pos_ptr": "*i64", "cnt_ptr": "*i32"}.get(n) or (
            "*bf16" if n.endswith("_ptr") else "fp32" if n in ("eps", "qk_eps") else "i32")

    def attn_types(n):
        ptr = {"tr_ptr": "*i64", "pos_ptr": "*i64", "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32",
               "cnt_ptr": "*i32"}
        return ptr.get(n, "*bf16") if n.endswith("_ptr") else "fp32" if n == "scale" else "i32"

    gemv = dict(HAS_BIAS=False, HAS_NORM=True, HAS_RES=False, SILU_MUL=True, ON_GPU=True, K_P2=2048, BLOCK_N=4,
                BLOCK_K=256, PAIRED=False, NORM_OUT=False, OUT_P2=1, PREFETCH=False, PDL_LATE=True, L2_PF=False,
                L2_PART=64, NX_PF=False, PIPE=False, USE_PDL=True)
    yield "gemv_norm_silu_mul_late", gf._gemv_fused_kernel, gemv, gemv_types
    yield "gemv_residual_l2_next_late", gf._gemv_fused_kernel, {**gemv, "HAS_NORM": False, "K_P2": 1,
                                                                "SILU_MUL": False, "HAS_RES": True, "L2_PF": True,
                                                                "NX_PF": True}, gemv_types
    qkv = dict(HAS_BIAS=True, HAS_NORM=True, ON_GPU=True, K_P2=2048, D=128, BLOCK_P=8, BLOCK_K=256, QK_NORM=False,
               USE_PDL=True, PDL_LATE=True, L2_PF=False, L2_PART=64)
    yield "qkv_rope_late", qr._qkv_rope_kernel, qkv, qkv_types
    yield "qkv_rope_qk_norm_late", qr._qkv_rope_kernel, {**qkv, "HAS_BIAS": False, "QK_NORM": True}, qkv_types
    attn = dict(D=128, BLOCK_R=16, BLOCK_S=64, PREC="tf32", UPCAST=False, SPLITS_P2=32, USE_PDL=True, KV_L2=False,
                MERGE_CH=0, MERGE_R=16, EARLY_POS=True, PRELOAD=False, PRE_NB=1)
    yield "attention_one_launch_early_pos", da._split_merge_kernel, attn, attn_types


def report() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    def compile_ptx(fn, consts, types) -> str:
        src = sm90_source(fn, consts, types)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": True}).asm["ptx"]

    out = {}
    for name, fn, consts, types in _cases():
        out[name] = {}
        for trace in (False, True):
            ptx = compile_ptx(fn, with_defaults(fn, {**consts, "TRACE": trace}), types)
            lines = ptx.splitlines()
            out[name]["on" if trace else "off"] = {
                "globaltimer": [i for i, line in enumerate(lines) if "%globaltimer" in line],
                "wait": next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None),
                "clock64": sum("%clock64" in line for line in lines),
                "smid": sum("%smid" in line for line in lines),
                "stores_b64": sum(bool(re.search(r"\bst\.global(\.\w+)*\.b64\b", line)) for line in lines),
            }
    return out


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("trace_ptx.py compiles kernels: run it without TRITON_INTERPRET")
    print(json.dumps(report()))
