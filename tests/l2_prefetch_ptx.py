"""Compile kernels/l2_prefetch.py's kernels for sm_90 (no GPU needed) and count the L2 instructions in their PTX.

Run as a script, without TRITON_INTERPRET (the interpreter replaces `triton.jit`, so nothing compiles under it):
tests/test_l2_prefetch.py starts it in a subprocess. ptxas assembles each kernel, so a malformed inline PTX string
(the "prefetch" and "bulk" modes) fails here instead of on the H200. Prints one JSON object: mode -> the number of
`prefetch.global.L2::evict_last`, `cp.async.bulk.prefetch.L2.global` and evict_last loads in its PTX, and the
cubin's size.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specpilot.kernels import l2_prefetch as l2

    target = GPUTarget("cuda", 90, 32)
    cases = {
        "load": (l2._warm_load, {"w_ptr": "*bf16", "n": "i32", "per_program": "i32", "out_ptr": "*fp32",
                                 "BLOCK": "constexpr"}, {"BLOCK": l2.LOAD_BLOCK}),
    }
    asm_sig = {"b_ptr": "*u8", "n_units": "i32", "per_program": "i32", "unit": "i32", "last": "i32",
               "out_ptr": "*fp32", "BULK": "constexpr", "BLOCK": "constexpr"}
    for mode, bulk in (("prefetch", False), ("bulk", True)):
        cases[mode] = (l2._warm_asm, asm_sig, {"BULK": bulk, "BLOCK": l2.BLOCK})
    out = {}
    for mode, (fn, sig, consts) in cases.items():
        # as a GPU launch specializes them: pointers and the sizes of real weights divisible by 16
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n] != "constexpr"
                 and n != "pid"}
        options = {"num_warps": 8} if mode == "load" else {}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=target,
                           options=options)
        lines = [ln for ln in k.asm["ptx"].splitlines() if not ln.lstrip().startswith(".loc")]
        out[mode] = {"prefetch": sum("prefetch.global.L2::evict_last" in ln for ln in lines),
                     "bulk": sum("cp.async.bulk.prefetch.L2.global" in ln for ln in lines),
                     "evict_last_loads": sum("ld.global" in ln and "evict_last" in ln for ln in lines),
                     "vector_loads": sum("ld.global" in ln and ".v4." in ln for ln in lines),
                     "cubin_bytes": len(k.asm.get("cubin", b""))}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
