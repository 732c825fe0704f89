"""Compile the verify path's split-KV attention kernel for sm_90 (no GPU needed), with and without WARM
(kernels/decode_attention.py VERIFY_WARM_MAX_BYTES), and report where its bulk L2 prefetches land in PTX.

Run as a script, without TRITON_INTERPRET (tests/test_verify_warm.py starts it in a subprocess, as tests/pdl_ptx.py).
Prints one JSON object: "off" / "on" -> the number of `cp.async.bulk.prefetch.L2` instructions, the PTX line of the
first one, of the first global load and of the first global store.
"""

from __future__ import annotations

import json
import os
import re
import sys

from pdl_ptx import _first, sm90_source


def report() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    from specpilot.kernels import decode_attention as da

    def types(n):
        ptr = {"pos_ptr": "*i64", "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "warm_ptr": "*i8"}
        return ptr.get(n, "*bf16") if n.endswith("_ptr") else "fp32" if n == "scale" else "i32"

    out = {}
    for warm in (False, True):
        c = dict(D=128, BLOCK_R=32, BLOCK_S=64, PREC="tf32", UPCAST=False, WARM=warm)
        src = sm90_source(da._split_kernel, c, types)
        lines = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"].splitlines()
        out["on" if warm else "off"] = {
            "l2_prefetches": sum(1 for line in lines if "cp.async.bulk.prefetch.L2" in line),
            "first_l2_prefetch": _first(lines, r"cp\.async\.bulk\.prefetch\.L2"),
            "first_load": _first(lines, r"\bld\.global\b|\bcp\.async\.(cg|ca)\.shared\.global\b"),
            "first_store": _first(lines, r"\bst\.global\b"),
        }
    return out


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("warm_ptx.py compiles kernels: run it without TRITON_INTERPRET")
    print(json.dumps(report()))
