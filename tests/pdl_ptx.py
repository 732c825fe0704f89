"""Compile the fused one-token path's kernels for sm_90 (no GPU needed) and report where PDL's calls land in PTX.

Run as a script, without TRITON_INTERPRET (the interpreter replaces `triton.jit`, so nothing compiles under it):
tests/test_pdl.py starts it in a subprocess. Prints one JSON object: kernel case -> for USE_PDL off and on, the PTX
line numbers of `griddepcontrol.launch_dependents`, `griddepcontrol.wait`, the first global load / store / atomic,
the first branch or basic-block label, the compiled `launch_pdl` option, the atomics and the ".cg" loads. The wait
is provably before every global memory access when it sits in the entry block (before any branch or block label)
and every access is textually after it: accesses in the entry block follow it, and every other block runs after
the entry block.
"""

from __future__ import annotations

import json
import os
import re
import sys

WRITE = re.compile(r"\b(st|atom|red)\.global\b|\b(atom|red)\.(gpu|sys|cta|acq|rel)")
GLOBAL_ACCESS = re.compile(r"\b(ld|st|atom|red|cp\.async[.\w]*)\.global\b|\b(atom|red)\.(gpu|sys|cta|acq|rel)")
BRANCH = re.compile(r"^\s*(@%p\d+\s+)?bra\b|^\$L__BB")


def with_defaults(fn, consts: dict) -> dict:
    """`consts` plus every constexpr parameter of `fn` it leaves out, at its default (as a launch that does not pass
    it compiles it: a switch that is off compiles nothing of its code)."""
    return {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}


def _signature(fn, consts: dict, types) -> dict:
    return {n: "constexpr" if n in consts else types(n) for n in fn.arg_names}


def _cases():
    from specpilot.kernels import decode_attention as da
    from specpilot.kernels import gemv12 as g12
    from specpilot.kernels import gemm_rows as gr
    from specpilot.kernels import gemv_fused as gf
    from specpilot.kernels import qkv_rope as qr
    from specpilot.kernels import rope_attention as ra
    from specpilot.kernels import rope_write as rw
    from specpilot.kernels import rmsnorm as rk

    def gemv_types(n):  # (ocnt_ptr: the norm epilogue's arrival counter, kernels/norm_epilogue.py)
        return "*i32" if n == "ocnt_ptr" else "*bf16" if n.endswith("_ptr") else "fp32" if n in ("eps", "out_eps") \
            else "i32"

    def gemv12_types(n):  # the 12-bit planes and exception lists (formats/lossless12.py Packed12)
        ptr = {"lo_ptr": "*i32", "c_ptr": "*i32", "tab_ptr": "*u8", "ep_ptr": "*i32", "ec_ptr": "*i32",
               "ev_ptr": "*fp32"}
        return ptr.get(n) or gemv_types(n)

    def rope_types(n):
        return "*i64" if n == "pos_ptr" else "*bf16" if n.endswith("_ptr") else "fp32" if n == "eps" else "i32"

    def attn_types(n):
        ptr = {"pos_ptr": "*i64", "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "cnt_ptr": "*i32"}
        return ptr.get(n, "*bf16") if n.endswith("_ptr") else "fp32" if n == "scale" else "i32"

    gemv = dict(HAS_BIAS=False, HAS_NORM=False, HAS_RES=False, SILU_MUL=False, ON_GPU=True, K_P2=1, BLOCK_N=4,
                BLOCK_K=256, PAIRED=False, NORM_OUT=False, OUT_P2=1, PREFETCH=False, PDL_LATE=False, L2_PF=False,
                NX_PF=False)
    yield "gemv_norm_bias", gf._gemv_fused_kernel, {**gemv, "HAS_BIAS": True, "HAS_NORM": True, "K_P2": 2048}, \
        gemv_types
    yield "gemv_residual", gf._gemv_fused_kernel, {**gemv, "HAS_RES": True}, gemv_types
    # the norm epilogue (EngineConfig.norm_epilogue): its arrival atomic, row loads and counter reset after the wait
    norm_out = {"HAS_RES": True, "NORM_OUT": True, "OUT_P2": 2048}
    yield "gemv_residual_norm_out", gf._gemv_fused_kernel, {**gemv, **norm_out}, gemv_types
    yield "gemv_norm_silu_mul", gf._gemv_fused_kernel, {**gemv, "HAS_NORM": True, "K_P2": 2048, "SILU_MUL": True}, \
        gemv_types
    yield "gemv_norm_silu_mul_paired", gf._gemv_fused_kernel, {**gemv, "HAS_NORM": True, "K_P2": 2048,
                                                               "SILU_MUL": True, "PAIRED": True}, gemv_types
    # PREFETCH (what gemv_fused launches with PDL on): the first weight tile's loads come before the wait
    # (weights only; tests/test_pdl.py checks that no store or atomic does)
    yield "gemv_norm_bias_prefetch", gf._gemv_fused_kernel, {**gemv, "HAS_BIAS": True, "HAS_NORM": True,
                                                             "K_P2": 2048, "PREFETCH": True}, gemv_types
    yield "gemv_residual_prefetch", gf._gemv_fused_kernel, {**gemv, "HAS_RES": True, "PREFETCH": True}, gemv_types
    yield "gemv_norm_silu_mul_prefetch", gf._gemv_fused_kernel, {**gemv, "HAS_NORM": True, "K_P2": 2048,
                                                                 "SILU_MUL": True, "PREFETCH": True}, gemv_types
    yield "gemv_norm_silu_mul_paired_prefetch", gf._gemv_fused_kernel, {**gemv, "HAS_NORM": True, "K_P2": 2048,
                                                                        "SILU_MUL": True, "PAIRED": True,
                                                                        "PREFETCH": True}, gemv_types
    # PDL_LATE (EngineConfig.pdl_trigger "late"): launch_dependents after the K loop, before any store
    yield "gemv_norm_bias_late", gf._gemv_fused_kernel, {**gemv, "HAS_BIAS": True, "HAS_NORM": True, "K_P2": 2048,
                                                         "PDL_LATE": True}, gemv_types
    yield "gemv_norm_silu_mul_paired_prefetch_late", gf._gemv_fused_kernel, {
        **gemv, "HAS_NORM": True, "K_P2": 2048, "SILU_MUL": True, "PAIRED": True, "PREFETCH": True, "PDL_LATE": True}, \
        gemv_types
    yield "gemv_residual_late", gf._gemv_fused_kernel, {**gemv, "HAS_RES": True, "PDL_LATE": True}, gemv_types
    # L2_PF (PDL_L2_MAX_BYTES): bulk L2 prefetches of the program's weight rows before the wait, no store
    yield "gemv_residual_l2_late", gf._gemv_fused_kernel, {**gemv, "HAS_RES": True, "PDL_LATE": True, "L2_PF": True}, \
        gemv_types
    yield "gemv_norm_silu_mul_l2_late", gf._gemv_fused_kernel, {**gemv, "HAS_NORM": True, "K_P2": 2048,
                                                                "SILU_MUL": True, "PDL_LATE": True, "L2_PF": True}, \
        gemv_types
    # NX_PF (PDL_L2_NEXT_BYTES, EngineConfig.pdl_l2_next_mb): o_proj also warms the heads of gate/up's two halves
    yield "gemv_residual_l2_next_late", gf._gemv_fused_kernel, {**gemv, "HAS_RES": True, "PDL_LATE": True,
                                                                "L2_PF": True, "NX_PF": True}, gemv_types
    # L2_PART (PDL_L2_PART, EngineConfig.pdl_l2_share): a quarter of each program's rows, the same placement
    yield "gemv_norm_silu_mul_l2_share_late", gf._gemv_fused_kernel, {
        **gemv, "HAS_NORM": True, "K_P2": 2048, "SILU_MUL": True, "PDL_LATE": True, "L2_PF": True, "L2_PART": 16}, \
        gemv_types
    # the M-row (tl.dot) kernel of a multi-token verify step (models/fused_decode.py with fused_verify)
    def gemm_types(n):  # the split-K workspace (fp32 partials) and arrival counters (int32)
        return {"ws_ptr": "*fp32", "cnt_ptr": "*i32", "ss_ptr": "*fp32", "si_ptr": "*fp32"}.get(n) or gemv_types(n)

    gemm = {k: v for k, v in gemv.items() if k not in ("PAIRED", "PREFETCH", "L2_PF", "L2_PART", "NX_PF")} | dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1)
    yield "gemm_norm_bias", gr._gemm_fused_kernel, {**gemm, "HAS_BIAS": True, "HAS_NORM": True, "K_P2": 2048}, \
        gemm_types
    yield "gemm_residual", gr._gemm_fused_kernel, {**gemm, "HAS_RES": True}, gemm_types
    yield "gemm_norm_silu_mul", gr._gemm_fused_kernel, {**gemm, "HAS_NORM": True, "K_P2": 2048, "SILU_MUL": True}, \
        gemm_types
    # split-K (down_proj + residual): partial stores, the arrival atomic and the counter reset after the wait too
    yield "gemm_residual_split_k", gr._gemm_fused_kernel, {**gemm, "HAS_RES": True, "BLOCK_N": 16, "SPLIT_K": 4}, \
        gemm_types
    yield "gemm_residual_norm_out", gr._gemm_fused_kernel, {**gemm, **norm_out}, gemm_types
    yield "gemm_residual_split_k_norm_out", gr._gemm_fused_kernel, {**gemm, **norm_out, "BLOCK_N": 16,
                                                                    "SPLIT_K": 4}, gemm_types
    yield "gemm_residual_split_k_late", gr._gemm_fused_kernel, {**gemm, "HAS_RES": True, "BLOCK_N": 16, "SPLIT_K": 4,
                                                                "PDL_LATE": True}, gemm_types
    # the norm handoff (kernels/norm_handoff.py): the sums-of-squares stores, and the sums' load, after the wait
    yield "gemm_residual_ss_out", gr._gemm_fused_kernel, {**gemm, "HAS_RES": True, "SS_OUT": True}, gemm_types
    yield "gemm_residual_split_k_ss_out", gr._gemm_fused_kernel, {**gemm, "HAS_RES": True, "BLOCK_N": 16,
                                                                  "SPLIT_K": 4, "SS_OUT": True}, gemm_types
    yield "gemm_norm_silu_mul_ss_in", gr._gemm_fused_kernel, {**gemm, "HAS_NORM": True, "K_P2": 2048,
                                                              "SILU_MUL": True, "SS_IN": True, "SS_P2": 128}, \
        gemm_types
    gemv12 = {k: v for k, v in gemv.items() if k not in ("PAIRED", "BLOCK_K", "PREFETCH", "L2_PF", "L2_PART", "NX_PF")} | dict(BLOCK_G=64, EXC_BLOCK=16)
    yield "gemv12_residual_norm_out", g12._gemv12_kernel, {**gemv12, **norm_out}, gemv12_types
    yield "gemv12_residual_late", g12._gemv12_kernel, {**gemv12, "HAS_RES": True, "PDL_LATE": True}, gemv12_types
    yield "rope_write_qk_norm", rw._rope_write_kernel, dict(D=128, BLOCK_H=16, Q_NORM=True, K_NORM=True, Q_BLOCK=0,
                                                            QP=1), rope_types
    # q's heads over 8 programs (kernels/rope_write.py Q_HEADS_PER_PROGRAM)
    yield "rope_write_qk_norm_split", rw._rope_write_kernel, dict(D=128, BLOCK_H=8, Q_NORM=True, K_NORM=True,
                                                                  Q_BLOCK=4, QP=8), rope_types
    attn = dict(D=128, BLOCK_R=16, BLOCK_S=64, PREC="tf32", UPCAST=False, SPLITS_P2=32, KV_L2=False, MERGE_CH=0,
                MERGE_R=16, EARLY_POS=False, PRELOAD=False, PRE_NB=1)
    yield "attention_one_launch", da._split_merge_kernel, attn, attn_types
    # the positions read before the wait (decode_attention.PDL_EARLY_POS) and the merge in chunks (MERGE_CHUNK)
    yield "attention_one_launch_early_pos", da._split_merge_kernel, {**attn, "EARLY_POS": True, "MERGE_CH": 8,
                                                                     "MERGE_R": 4}, attn_types
    # the K/V hint before the wait (decode_attention.PDL_KV_L2): a positions load, then bulk L2 prefetches, no write
    yield "attention_one_launch_kv_hint", da._split_merge_kernel, {**attn, "KV_L2": True}, attn_types
    # the slice's older K/V rows loaded before the wait (decode_attention.KV_PRELOAD), with the early positions
    yield "attention_one_launch_kv_preload", da._split_merge_kernel, {**attn, "EARLY_POS": True, "PRELOAD": True,
                                                                      "PRE_NB": 2}, attn_types
    # the only working slice storing the output itself (decode_attention.SINGLE_DIRECT), with the early positions
    yield "attention_one_launch_single_early_pos", da._split_merge_kernel, {**attn, "EARLY_POS": True,
                                                                           "SINGLE": True}, attn_types
    # the merge's loads four slices at a time (decode_attention.MERGE_UNROLL), with the early positions
    yield "attention_one_launch_unroll_early_pos", da._split_merge_kernel, {**attn, "EARLY_POS": True,
                                                                           "MERGE_UN": 4}, attn_types

    def qkv_rope_types(n):  # EngineConfig.rope_in_qkv: the positions, the q/k heads' arrival counters
        return {"pos_ptr": "*i64", "cnt_ptr": "*i32"}.get(n) or ("*bf16" if n.endswith("_ptr") else "fp32"
                                                                 if n in ("eps", "qk_eps") else "i32")

    qkv = dict(HAS_BIAS=True, HAS_NORM=True, ON_GPU=True, K_P2=2048, D=128, BLOCK_P=8, BLOCK_K=256, QK_NORM=False,
               PDL_LATE=True, L2_PF=False)
    yield "qkv_rope_late", qr._qkv_rope_kernel, qkv, qkv_rope_types
    # qkv + RoPE triggering first thing (EngineConfig.qkv_trigger_first): launch_dependents, then the wait, first
    yield "qkv_rope_trigger_first", qr._qkv_rope_kernel, {**qkv, "PDL_LATE": False}, qkv_rope_types
    # Qwen3's per-head q/k norm: stores, the arrival atomic and the last program's L2-only reads after the wait
    yield "qkv_rope_qk_norm_late", qr._qkv_rope_kernel, {**qkv, "HAS_BIAS": False, "QK_NORM": True}, qkv_rope_types
    # L2_PF (qkv's weight under PDL_L2_MAX_BYTES, the 1.5B's): its two row ranges' bulk prefetches before the wait
    yield "qkv_rope_l2_late", qr._qkv_rope_kernel, {**qkv, "L2_PF": True}, qkv_rope_types
    # a verify block's qkv GEMM + RoPE + K/V write (EngineConfig.verify_rope_in_qkv), normed x or the handed-over sums
    from specpilot.kernels import qkv_rope_rows as qrr

    def rows_types(n):
        return "*fp32" if n == "si_ptr" else qkv_rope_types(n)

    rows = dict(HAS_BIAS=True, HAS_NORM=False, SS_IN=False, SS_P2=1, K_P2=1, ON_GPU=True, D=128, BLOCK_M=16,
                BLOCK_P=32, BLOCK_K=128, PDL_LATE=False)
    yield "qkv_rope_rows", qrr._qkv_rope_rows_kernel, rows, rows_types
    yield "qkv_rope_rows_ss_in_late", qrr._qkv_rope_rows_kernel, {**rows, "HAS_NORM": True, "SS_IN": True,
                                                                  "SS_P2": 128, "K_P2": 2048, "PDL_LATE": True}, \
        rows_types

    def rope_attn_types(n):  # EngineConfig.rope_in_attention: its K/V slot store, partials, counter after the wait
        return "fp32" if n == "eps" else attn_types(n)

    def norm_types(n):  # kernels/rmsnorm.py (EngineConfig.norm_pdl): a verify block's norms
        return "*bf16" if n.endswith("_ptr") else "fp32" if n == "eps" else "i32"

    yield "rmsnorm", rk._rmsnorm_kernel, dict(BLOCK=2048), norm_types
    yield "rope_attention_qk_norm", ra._rope_attention_kernel, dict(
        D=128, BLOCK_R=16, BLOCK_S=64, PREC="tf32", UPCAST=False, SPLITS_P2=32, Q_NORM=True, K_NORM=True), \
        rope_attn_types


def sm90_source(fn, consts: dict, types):
    """The ASTSource a launch of `fn` with these constexprs compiles, every pointer argument 16-byte aligned as a
    launch specializes it (torch's allocations are): without the alignment the compiler sees 2-byte pointers, so it
    emits scalar loads and no software pipelining (cp.async) at all, even for tl.dot loops, and the PTX is not the
    device's (session 52: the M-row GEMM's K loop compiled to 52 scalar loads and no cp.async without, 26 cp.async
    with)."""
    from triton.compiler import ASTSource

    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
               if n not in consts and n.endswith("_ptr")}
    return ASTSource(fn=fn, signature=_signature(fn, consts, types), constexprs=consts, attrs=aligned)


def _first(lines, pattern) -> int | None:
    return next((i for i, line in enumerate(lines) if re.search(pattern, line)), None)


def report() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    out = {}
    for name, fn, consts, types in _cases():
        out[name] = {}
        for use_pdl in (False, True):
            c = with_defaults(fn, {**consts, "USE_PDL": use_pdl})
            src = sm90_source(fn, c, types)
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": use_pdl})
            lines = compiled.asm["ptx"].splitlines()
            out[name]["on" if use_pdl else "off"] = {
                "launch_dependents": _first(lines, r"griddepcontrol\.launch_dependents"),
                "wait": _first(lines, r"griddepcontrol\.wait"),
                "first_global_access": _first(lines, GLOBAL_ACCESS.pattern),
                "first_global_write": _first(lines, WRITE.pattern),  # a store or an atomic
                # global loads before the wait (PREFETCH: the first weight tile's)
                "loads_before_wait": sum(1 for line in lines[: _first(lines, r"griddepcontrol\.wait") or 0]
                                         if re.search(r"\bld\.global\b", line)),
                "first_branch": _first(lines, BRANCH.pattern),
                "launch_pdl": bool(compiled.metadata.launch_pdl),
                # (the norm epilogue's, tests/test_pdl.py: its arrival atomic and L2-only row loads, and none
                # where it is off)
                "atomics": sorted({m.group(0) for m in re.finditer(r"\batom\.[\w.]+", "\n".join(lines))}),
                "cg_loads": sum(1 for line in lines if re.search(r"\bld\.global\.cg\b", line)),
                # bulk L2 prefetches (L2_PF) before the wait
                "l2_prefetches_before_wait": sum(1 for line in lines[: _first(lines, r"griddepcontrol\.wait") or 0]
                                                 if "cp.async.bulk.prefetch.L2" in line),
                "l2_prefetches": sum(1 for line in lines if "cp.async.bulk.prefetch.L2" in line),
            }
    return out


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("pdl_ptx.py compiles kernels: run it without TRITON_INTERPRET")
    print(json.dumps(report()))
