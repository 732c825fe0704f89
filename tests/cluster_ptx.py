"""Compile the cluster attention (kernels/cluster_attention.py) for sm_90 at the Qwen2.5-1.5B shape (no GPU needed)
and report what its GPU run depends on: that it compiles with each cluster size and option, its two cluster
barriers (release / acquire), the distributed-shared-memory reads (mapa + ld.shared::cluster), the static shared
buffer each CTA's partial goes to, and the cross-cluster path's acq_rel atomic and L2-only reads.

Run as a script, without TRITON_INTERPRET (the interpreter replaces `triton.jit`, so nothing compiles under it):
tests/test_decode_attention.py starts it in a subprocess. Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import re
import sys


def report() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specpilot.kernels import cluster_attention as ca

    fn = ca._cluster_kernel
    ptr = {"pos_ptr": "*i64", "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "cnt_ptr": "*i32"}
    # Qwen2.5-1.5B: 6 query heads a KV head (8 merge rows), D 128, 128-key slices of a 4096-slot pool
    base = dict(D=128, BLOCK_R=16, BLOCK_S=128, PREC="tf32", C=8, MR=8, GROUPS_P2=4, LARGE=False, USE_PDL=True,
                EARLY_POS=True, PRELOAD=False, PRE_NB=1, FIRST=False, EVEN=False, KV_L2=False, PUSH=False, TRACE=False, tr_ptr=None)

    def ptx(**over) -> tuple[str, int]:
        consts = {**base, **over}
        sig = {n: "constexpr" if n in consts else ptr.get(n, "*bf16") if n.endswith("_ptr")
               else "fp32" if n == "scale" else "i32" for n in fn.arg_names}
        c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
        return c.asm["ptx"], c.metadata.shared

    text, shared = ptx()
    # with the JIT's alignment facts (pointers and strides divisible by 16), as on a GPU: the slice's K / V tiles go
    # to shared memory by cp.async, a buffer a pipeline stage (EngineConfig.attn_stages)
    div = [n for n in fn.arg_names if n not in base and (n.endswith("_ptr") or n in
                                                         ("sq_b", "sq_h", "sk_b", "sk_h", "sk_s", "sv_b", "sv_h",
                                                          "sv_s", "so_b", "so_h", "S", "SPLIT_S"))]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
    sig = {n: "constexpr" if n in base else ptr.get(n, "*bf16") if n.endswith("_ptr")
           else "fp32" if n == "scale" else "i32" for n in fn.arg_names}
    staged = {}
    for stages in (3, 2):
        c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=base, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_stages": stages})
        staged[stages] = (c.metadata.shared, len(re.findall(r"\bcp\.async\.cg", c.asm["ptx"])))
    sizes = {}
    for n in (4, 16):
        sizes[n] = bool(ptx(C=n, GROUPS_P2=max(1, 32 // n // 4))[0])
    options = {name: bool(ptx(**over)[0]) for name, over in
               (("preload", dict(PRELOAD=True)), ("loads_first", dict(FIRST=True)), ("even", dict(EVEN=True)), ("kv_l2", dict(KV_L2=True)),
                ("push16", dict(PUSH=True, C=16, GROUPS_P2=2)), ("push_large", dict(PUSH=True, MR=16, LARGE=True)),
                ("large", dict(MR=16, LARGE=True)), ("no_pdl", dict(USE_PDL=False, EARLY_POS=False)))}
    large = ptx(MR=16, LARGE=True)[0]
    push = ptx(PUSH=True)[0]
    return {
        "cluster_arrives": re.findall(r"barrier\.cluster\.arrive[\w.]*", text),
        "cluster_waits": re.findall(r"barrier\.cluster\.wait[\w.]*", text),
        "mapa": len(re.findall(r"\bmapa\.shared::cluster", text)),
        "dsmem_loads": len(re.findall(r"\bld\.shared::cluster\.f32", text)),
        "shared_stores": len(re.findall(r"\bst\.shared\.f32", text)),
        "static_buffers": re.findall(r"\.shared \.align 16 \.b8 (\w+)\[(\d+)\]", text),
        "large_buffers": re.findall(r"\.shared \.align 16 \.b8 (\w+)\[(\d+)\]", large),
        "atomics": sorted({m.group(0) for m in re.finditer(r"\b(atom|red)\.global[\w.]+", text)}),
        "cg_loads": len(re.findall(r"\bld\.global\.cg\b", text)),
        "griddepcontrol": len(re.findall(r"griddepcontrol", text)),
        "triton_shared_bytes": shared,
        "staged_shared_bytes": {str(k): v[0] for k, v in staged.items()},
        "staged_cp_async": {str(k): v[1] for k, v in staged.items()},
        "push_arrives": len(re.findall(r"barrier\.cluster\.arrive", push)),
        "push_remote_stores": len(re.findall(r"\bst\.shared::cluster\.f32", push)),
        "push_dsmem_loads": len(re.findall(r"\bld\.shared::cluster", push)),
        "push_buffers": re.findall(r"\.shared \.align 16 \.b8 (\w+)\[(\d+)\]", push),
        "sizes_compile": sizes,
        "options_compile": options,
    }


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("cluster_ptx.py compiles kernels: run it without TRITON_INTERPRET")
    print(json.dumps(report()))
