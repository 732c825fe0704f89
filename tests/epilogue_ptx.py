"""Compile the one-row GEMV and qkv + RoPE for sm_90 with EARLY_EPI off and on (no GPU needed) and count the global
loads between the PDL wait and the K loop's first block label.

Run as a script, without TRITON_INTERPRET (tests/test_gemv_fused.py starts it in a subprocess, as tests/pdl_ptx.py).
Prints one JSON object: case -> {"off": n, "on": n, "tile": n}, the `ld.global` lines after `griddepcontrol.wait` and
before the first basic-block label after it (the K loop's head): EARLY_EPI ("on") moves the epilogue's loads
(residual, bias, the cache slot, cos / sin) there, TILE_AFTER_WAIT ("tile") the first K block's weight loads.
"""

from __future__ import annotations

import json
import os
import re
import sys

from trace_ptx import _cases


def loads_before_loop(ptx: str) -> int:
    lines = ptx.splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    label = next(i for i in range(wait, len(lines)) if re.match(r"^\$L__BB", lines[i]))
    return sum(bool(re.search(r"\bld\.global\b", line)) for line in lines[wait:label])


def report() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from pdl_ptx import sm90_source, with_defaults

    out = {}
    for name, fn, consts, types in _cases():
        if "attention" in name:
            continue
        out[name] = {}
        for label, extra in (("off", {}), ("on", {"EARLY_EPI": True}), ("tile", {"TILE_AFTER_WAIT": True})):
            c = with_defaults(fn, {**consts, **extra})
            src = sm90_source(fn, c, types)
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": True}).asm["ptx"]
            out[name][label] = loads_before_loop(ptx)
    return out


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("epilogue_ptx.py compiles kernels: run it without TRITON_INTERPRET")
    print(json.dumps(report()))
