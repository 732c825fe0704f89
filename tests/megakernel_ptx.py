"""Compile the one-launch decode step (kernels/megakernel.py) for sm_90 at the Qwen2.5-1.5B shape (no GPU needed)
and report what the GPU run depends on: that it compiles at all, its grid barrier's instructions (release /
acquire atomics at gpu scope, volatile polling loads, CTA barriers), the attention merge's L2-only loads and its
shared memory (a grid barrier needs every program resident: one per SM must fit; registers are known only once
loaded on a GPU, which scripts/gpu_megakernel.py prints).

Run as a script, without TRITON_INTERPRET (the interpreter replaces `triton.jit`, so nothing compiles under it):
tests/test_megakernel.py starts it in a subprocess. Prints one JSON object.
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

    from specpilot.kernels import megakernel as mk

    fn = mk._decode_step_kernel
    ptr = {"tok_ptr": "*i64", "pos_ptr": "*i64", "po_ptr": "*fp32", "pm_ptr": "*fp32", "pl_ptr": "*fp32",
           "cnt_ptr": "*i32", "bar_ptr": "*i32"}
    # Qwen2.5-1.5B on 132 SMs: 12 / 2 heads of 128, hidden 1536, MLP 8960, qkv bias, a 4096-slot pool
    consts = dict(HID=1536, H_Q=12, H_KV=2, D=128, INTER=8960, HAS_BIAS=True, QK_NORM=False, ON_GPU=True,
                  UPCAST=False, PREC="tf32", NUM_SPLITS=32, SPLITS_P2=32, BLOCK_R=16, BLOCK_S=mk.BLOCK_S,
                  SPLIT_S=mk.SPLIT_S, HID_P2=2048, INTER_P2=16384, BN_QKV=16, BN_O=16, BN_GU=64, BN_D=16,
                  BN_LM=64, BK_QKV=1024, BK_O=1024, BK_GU=128, BK_D=1024, BK_LM=256, PREFETCH=False, PF_GU=0,
                  TIMING=False, times_ptr=None, PRELOAD=False, ACC_1D=False, ACQ_POLL=False,
                  PRE_KV=False)
    sig = {n: "constexpr" if n in consts else ptr.get(n, "*bf16") if n.endswith("_ptr")
           else "fp32" if n in ("eps", "scale") else "i32" for n in fn.arg_names}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
    ptx = compiled.asm["ptx"]
    # with the L2 warming during the attention phase (DecodeMegakernel(prefetch_gu=...)): its prefetches compile
    pf = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={**consts, "PREFETCH": True, "PF_GU": 65536}),
                        target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    # each GEMV phase's first tile and the first attention slice loaded before their barriers, K steps summed into
    # [BLOCK_N], barriers polled with acquire loads (DecodeMegakernel(preload=True, acc_1d=True, acquire_poll=True,
    # preload_kv=True)): compiles, same arrivals
    fast = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={**consts, "PRELOAD": True, "ACC_1D": True,
                                                                      "ACQ_POLL": True, "PRE_KV": True}),
                          target=GPUTarget("cuda", 90, 32))
    pre = fast.asm["ptx"]
    # the per-phase timing stamps (DecodeMegakernel.step(times=...), a GPU diagnostic): the global timer is read
    sig_t = {**sig, "times_ptr": "*i64"}
    consts_t = {k: v for k, v in consts.items() if k != "times_ptr"} | {"TIMING": True}
    timed = triton.compile(ASTSource(fn=fn, signature=sig_t, constexprs=consts_t),
                           target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    return {
        "timer_reads_off": len(re.findall(r"%globaltimer", ptx)),
        "timer_reads_on": len(re.findall(r"%globaltimer", timed)),
        "prefetches_off": len(re.findall(r"prefetch\.global\.L2", ptx)),
        "prefetches_on": len(re.findall(r"prefetch\.global\.L2", pf)),
        "fast_volatile_loads": len(re.findall(r"\bld\.volatile\.global", pre)),
        "fast_releases": len(re.findall(r"red\.global\.gpu\.release", pre)),
        "fast_acquire_polls": len(re.findall(r"\bld\.acquire\.gpu\.global", pre)),
        "fast_acquire_loads": len(re.findall(r"\bld\.global\.gpu\.acquire\b", pre)),
        # (an atomic whose result is unused compiles to `red`; an acquire add of 0 to an acquire load)
        "atomics": sorted({m.group(0) for m in re.finditer(r"\b(atom|red)\.global[\w.]+", ptx)}),
        "acquire_loads": len(re.findall(r"\bld\.global\.gpu\.acquire\b", ptx)),
        "volatile_loads": len(re.findall(r"\bld\.volatile\.global", ptx)),
        "cg_loads": len(re.findall(r"\bld\.global\.cg\b", ptx)),
        "cta_barriers": len(re.findall(r"\bbar\.sync\b|\bbarrier\.sync\b", ptx)),
        "shared_bytes": compiled.metadata.shared,
        "fast_shared_bytes": fast.metadata.shared,
        "ptx_lines": ptx.count("\n"),
    }


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("megakernel_ptx.py compiles kernels: run it without TRITON_INTERPRET")
    print(json.dumps(report()))
