"""The fused GEMV's M-row kernel: 2 to 16 rows (a verify block) through tensor cores, optionally split over K.

Why a kernel of its own: the one-row loop of kernels/gemv_fused.py would stream the weights once per row. Here each
program loads a weight tile [BLOCK_N, BLOCK_K] once per K step and multiplies it with an x tile of 16 rows (rows
>= M masked to 0; a speculative verify block of T tokens: models/fused_decode.py with fused_verify) through
`tl.dot` (tensor cores; fp32 accumulation), so the weights are read once whatever M is. Prologue and epilogue are
the one-row kernel's helpers (kernels/gemv_parts.py) applied to [16, BLOCK_K] / [16, BLOCK_N] tiles: rstd per
row, the same rounding points per element. M == 1 keeps `_gemv_fused_kernel` (tuned and measured on the H200).
The M-row norm prologue (a serial pass over the M rows, then a normed [16, BLOCK_K] tile per K step in every
program) made the normed calls 1.7-2.8x cuBLAS's time on the H200, so models/fused_decode.py normalizes the rows
in a launch of its own first (PRENORM_ROWS) and the M-row calls normally get no norm; the prologue stays for
other callers.

Split-K (M rows only, SPLIT_K > 1, an autotuning choice): a narrow output over a long K (down_proj: N 1536, K 8960
at 1.5B) has N / BLOCK_N ~ 50-100 programs for 132 SMs and ran at 1.8x cuBLAS's time. Program (n, s) then sums K
chunk s of SPLIT_K (whole BLOCK_K steps), writes its fp32 partial [16, BLOCK_N] (gate and up: two) to a
workspace and counts itself in on the N tile's counter (an acq_rel atomic after a CTA barrier, as
kernels/decode_attention.py's one-launch merge); the last to arrive adds the partials in the fixed order
0..SPLIT_K-1, so the result never depends on which program finished last (deterministic, though not the bits of
SPLIT_K = 1: another summation order), runs the epilogue and zeroes the counter. The workspace and counters are
one buffer pair per device, grown eagerly and never inside a CUDA graph capture (`split_k_scratch`). The
autotuner tries split-K only where K >= 2N and there is no norm prologue (`_split_k_applies`); SPLIT_K = 1
compiles to the plain kernel (no workspace, no atomics).

Called through kernels/gemv_fused.py `gemv_fused` (M >= 2), which checks the arguments and sets up the norm
epilogue's and the norm handoff's; its docstring gives the rounding points.
"""

from __future__ import annotations

import functools
import os

import torch

from specpilot.kernels import tuned  # pinned autotuning picks
from specpilot.kernels.scratch import DeviceBuffers

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.gemv_parts import _dot_acc, _epilogue_tile, _norm_h, _norm_rstds
    from specpilot.kernels.norm_epilogue import norm_rows_when_last  # NORM_OUT (kernels/norm_epilogue.py)
    from specpilot.kernels.norm_handoff import rstd_from_ss, ss_store  # SS_IN / SS_OUT (kernels/norm_handoff.py)
    from specpilot.kernels.pdl import gdc_launch_dependents, gdc_wait  # PDL (kernels/pdl.py)
except ImportError:  # CPU-only installs: gemv_fused's reference path only
    triton = None

MAX_ROWS = 16  # the x tile: tl.dot's smallest M (a verify block of up to 16 tokens)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
INTERPRET_SPLIT_K = 1  # the interpreter's fixed M-row configuration splits K this many ways (tests set it; on a GPU
# the autotuner chooses, where `_split_k_applies`)
# The M-row kernel's autotuning key M_BUCKET is M rounded up to a power of two, and at least this (0: M's own).
# Every bucket runs the same BLOCK_M = MAX_ROWS tile, so the key only decides which tuned tiling a launch takes;
# the tunings are timed one launch at a time, outside a graph and without PDL, and at 1.5B the 5-8-row bucket's
# chose worse than the 16-row one's there (H200, session 29: the graphed 5-token verify step 2.005 ms, the 9-token
# 1.866). EngineConfig.gemm_bucket_min sets it. Numbers: another tiling's fp32 summation order, as any autotuning
# choice of this kernel.
M_BUCKET_MIN = 0


def _split_k_applies(N: int, K: int, has_norm: bool) -> bool:
    """Whether the M-row kernel's autotuner may try split-K: a long K over few output columns (K >= 2N: the
    1.5B's down_proj, N 1536 / K 8960, has ~100 programs at BLOCK_N 16 for 132 SMs and ran at 1.8x cuBLAS's time),
    and no norm prologue (each split would recompute the full rows' rstd; with fused_decode.PRENORM_ROWS the
    M-row calls get no norm anyway)."""
    return not has_norm and K >= 2 * N


if triton is not None:

    @triton.jit
    def _store_partials(tile, s, acc, acc_up, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
        """Split s's fp32 sums [BM, BN] (and the up sums with SILU_MUL) into its slot of the N tile's workspace
        [SPLIT_K, 1 or 2, BM, BN]; whole tiles, unmasked (rows >= M and columns >= N hold zeros or junk that the
        epilogue never stores)."""
        offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        slot = tile + s * ((1 + SILU_MUL) * BLOCK_M * BLOCK_N)
        tl.store(slot + offs, acc)
        if SILU_MUL:
            tl.store(slot + BLOCK_M * BLOCK_N + offs, acc_up)

    @triton.jit
    def _sum_partials(tile, SILU_MUL: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
        """The N tile's SPLIT_K partials added in the fixed order 0, 1, .. SPLIT_K - 1 -> (y, u) [BM, BN] (u = y
        without SILU_MUL). Read with ".cg" (L2, the point of coherence across SMs), never from this SM's L1, so no
        line cached before the acquire can be served stale."""
        offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        step = (1 + SILU_MUL) * BLOCK_M * BLOCK_N
        y = tl.load(tile + offs, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            y += tl.load(tile + s * step + offs, cache_modifier=".cg")
        u = y
        if SILU_MUL:
            u = tl.load(tile + BLOCK_M * BLOCK_N + offs, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                u += tl.load(tile + s * step + BLOCK_M * BLOCK_N + offs, cache_modifier=".cg")
        return y, u

    @triton.jit
    def _gemm_fused_kernel(x_ptr, w_ptr, b_ptr, nw_ptr, r_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm,
                           stride_wn, stride_rm, stride_ym, eps, M_BUCKET, on_ptr, onw_ptr, ocnt_ptr, out_eps,
                           ss_ptr, si_ptr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr,
                           SILU_MUL: tl.constexpr, ON_GPU: tl.constexpr, K_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr = 1,
                           USE_PDL: tl.constexpr = False, NORM_OUT: tl.constexpr = False,
                           OUT_P2: tl.constexpr = 1, PDL_LATE: tl.constexpr = False, SS_OUT: tl.constexpr = False,
                           SS_IN: tl.constexpr = False, SS_P2: tl.constexpr = 1):
        """y[m, n] for rows m < M (2 <= M <= BLOCK_M) and this program's BLOCK_N columns n < N (N = I with
        SILU_MUL: gate row n, up row N + n).

        The x tile has BLOCK_M = MAX_ROWS rows whatever M is (tl.dot's smallest M); rows >= M load as 0 and are not
        stored, so one compiled kernel serves every M. M_BUCKET is never read: it is the autotuner's key (M rounded
        up to a power of two). USE_PDL: as `_gemv_fused_kernel`'s (nothing read or written before the wait).

        SPLIT_K > 1 (grid axis 1): this program sums only its chunk of K (SPLIT_K chunks, each a multiple of
        BLOCK_K), publishes the fp32 partial(s) to ws_ptr and counts in on cnt_ptr[n tile]; the last to arrive
        adds the SPLIT_K partials in the fixed order 0..SPLIT_K-1 (the numbers do not depend on which program is
        last), runs the epilogue and zeroes the counter. SPLIT_K == 1: ws_ptr and cnt_ptr are never touched.

        NORM_OUT: as `_gemv_fused_kernel`'s, over the M rows (on [M, N], row stride N); the programs that stored
        output count in (all of them; with split-K each N tile's merging program, after its merge), so the last of
        the whole launch normalizes finished rows.

        The norm handoff (kernels/norm_handoff.py): SS_OUT: each program that stores output (with split-K each N
        tile's merging program) also stores its tile's per-row sums of squares at ss_ptr; SS_IN (with HAS_NORM):
        the rows' rstd come from such sums at si_ptr (SS_P2 >= their groups) instead of a pass over x's rows."""
        if USE_PDL:
            if not PDL_LATE:
                gdc_launch_dependents()
            gdc_wait()
        dt = y_ptr.dtype.element_ty
        m_offs = tl.arange(0, BLOCK_M)
        m_mask = m_offs < M
        n_offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n_offs < N
        rows = n_offs.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
        x_rows = m_offs.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
        if HAS_NORM:
            if SS_IN:  # the producing launch's sums of squares: one [BM, groups] load
                rstd = rstd_from_ss(si_ptr, K, eps, BLOCK_M, SS_P2)[:, None]  # [BM, 1]
            else:
                rstd = _norm_rstds(x_ptr, stride_xm, M, K, eps, K_P2, BLOCK_M)[:, None]  # [BM, 1]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = acc
        k_lo = 0
        k_hi = K
        if SPLIT_K > 1:  # this program's chunk: chunks are whole BLOCK_K steps, so `k_offs < K` stays the only mask
            chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
            k_lo = tl.program_id(1) * chunk
            k_hi = tl.minimum(k_lo + chunk, K)  # <= k_lo: an empty chunk (K small), its partial is zero
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_offs = k0 + tl.arange(0, BLOCK_K)
            k_mask = k_offs < K
            h = tl.load(x_ptr + x_rows + k_offs[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if HAS_NORM:  # [BM, BK]; the normed values are dtype values, so casting them back is exact
                nw = tl.load(nw_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32)
                h = _norm_h(h.to(tl.float32), nw[None, :], rstd, dt, ON_GPU).to(dt)
            w_mask = n_mask[:, None] & k_mask[None, :]
            w = tl.load(w_ptr + rows + k_offs[None, :], mask=w_mask, other=0.0)  # [BN, BK]
            acc = _dot_acc(h, w, acc, ON_GPU)
            if SILU_MUL:
                wu = tl.load(w_ptr + rows + N * stride_wn + k_offs[None, :], mask=w_mask, other=0.0)
                acc_up = _dot_acc(h, wu, acc_up, ON_GPU)
        if USE_PDL and PDL_LATE:  # this program's K loop is done (PDL_LATE: as the one-row kernel's)
            gdc_launch_dependents()
        cols = n_offs[None, :]
        r_ptrs = r_ptr + m_offs[:, None] * stride_rm + cols
        y_ptrs = y_ptr + m_offs[:, None] * stride_ym + cols
        mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT_K == 1:
            out = _epilogue_tile(acc, acc_up, n_offs, n_mask, N, b_ptr, r_ptrs, y_ptrs, mask, HAS_BIAS, HAS_RES,
                                 SILU_MUL, ON_GPU)
            if SS_OUT:
                ss_store(out, mask, ss_ptr, tl.program_id(0), N, BLOCK_M, BLOCK_N)
            if NORM_OUT:
                norm_rows_when_last(y_ptr, stride_ym, M, N, onw_ptr, out_eps, on_ptr, N, ocnt_ptr,
                                    tl.num_programs(0), OUT_P2)
        else:
            pid_n = tl.program_id(0)
            tile = ws_ptr + pid_n * (SPLIT_K * (1 + SILU_MUL) * BLOCK_M * BLOCK_N)  # [SPLIT_K, 1 or 2, BM, BN]
            _store_partials(tile, tl.program_id(1), acc, acc_up, SILU_MUL, BLOCK_M, BLOCK_N)
            # Publish, as decode_attention.py's one-launch merge: every thread's partial stores come before the
            # CTA barrier; the one thread that performs the scalar atomic then releases them at gpu scope (acq_rel:
            # release for ours, acquire for the others' when we are last).
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # the last: every partial of this N tile is published
                y, u = _sum_partials(tile, SILU_MUL, SPLIT_K, BLOCK_M, BLOCK_N)
                out = _epilogue_tile(y, u, n_offs, n_mask, N, b_ptr, r_ptrs, y_ptrs, mask, HAS_BIAS, HAS_RES,
                                     SILU_MUL, ON_GPU)
                if SS_OUT:
                    ss_store(out, mask, ss_ptr, pid_n, N, BLOCK_M, BLOCK_N)
                # back to zero for the next launch (the next layer, a graph replay): every arrival of this launch
                # is in, so nothing else touches this counter before the kernel ends
                tl.store(cnt_ptr + pid_n, 0)
                if NORM_OUT:  # one merging program per N tile counts in
                    norm_rows_when_last(y_ptr, stride_ym, M, N, onw_ptr, out_eps, on_ptr, N, ocnt_ptr,
                                        tl.num_programs(0), OUT_P2)

    # M rows: tiles that keep enough programs streaming at 1.5B-8B widths (BLOCK_N 16-32 for N ~ 1.5k-4k) up to
    # wide ones for gate_up / the 8B shapes; keyed on M's power-of-two bucket too (more rows, more x-side work)
    _GEMM_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1}, num_warps=w, num_stages=3)
                     for bn, bk in ((16, 128), (16, 256), (32, 64), (32, 128), (32, 256), (64, 64), (64, 128),
                                    (128, 64))
                     for w in (4, 8)]
    # + split-K (narrow outputs over a long K: down_proj, N/BLOCK_N ~ 50-100 programs for 132 SMs), narrow tiles
    # only: the point is more programs in flight; `_gemm_prune` keeps them where K >= 2N and there is no norm
    _GEMM_CONFIGS += [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}, num_warps=w, num_stages=3)
                      for bn, bk in ((16, 128), (16, 256), (32, 64), (32, 128)) for sk in (2, 4, 8) for w in (4, 8)]

    _GEMM_KEY = ["N", "K", "HAS_BIAS", "HAS_NORM", "HAS_RES", "SILU_MUL", "M_BUCKET", "NORM_OUT"]

    def _gemm_prune(configs, named_args, **kwargs):
        flag = lambda name: kwargs.get(name, named_args.get(name))  # noqa: E731
        split_ok = _split_k_applies(named_args["N"], named_args["K"], flag("HAS_NORM"))
        configs = [c for c in configs if c.kwargs["SPLIT_K"] == 1
                   or split_ok and named_args["K"] >= 2 * c.kwargs["SPLIT_K"] * c.kwargs["BLOCK_K"]]
        return tuned.narrow("_gemm_fused_kernel", configs, named_args, kwargs, _GEMM_KEY)

    # CPU tests: one small fixed configuration (masks on N and K get exercised)
    _gemm_kernel = (_gemm_fused_kernel if _INTERPRET
                    else tuned.autotune(_gemm_fused_kernel, _GEMM_CONFIGS, _GEMM_KEY, _gemm_prune))


def launch_rows(ptrs, M: int, out_n: int, K: int, stride_wn: int, stride_rm: int, eps: float, norm_args: tuple,
                flags: dict) -> None:
    """The M-row kernel (2 <= M <= 16) over gemv_fused's pointers (x, weight, bias, norm weight, residual, y) and
    the norm epilogue's and the norm handoff's arguments (kernels/norm_epilogue.py `out_norm_args`, kernels/
    norm_handoff.py `handoff_args`)."""
    x, y = ptrs[0], ptrs[-1]
    ws = cnt = ptrs[1]  # no split-K: never touched (dummies)
    sizes = _split_k_sizes(out_n, K, flags["HAS_NORM"], flags["SILU_MUL"], INTERPRET_SPLIT_K if _INTERPRET else 0)
    if sizes is not None:
        ws, cnt = split_k_scratch(x.device, *sizes)
    args = (*ptrs, ws, cnt, M, out_n, K, x.stride(0), stride_wn, stride_rm, y.stride(0), float(eps),
            max(triton.next_power_of_2(M), M_BUCKET_MIN), *norm_args)
    if _INTERPRET:  # BLOCK_N 16, BLOCK_K 64: the tests' N and K are not multiples of either
        _gemm_kernel[(triton.cdiv(out_n, 16), INTERPRET_SPLIT_K)](*args, **flags, BLOCK_M=MAX_ROWS, BLOCK_N=16,
                                                                  BLOCK_K=64, SPLIT_K=INTERPRET_SPLIT_K)
    else:
        _gemm_kernel[lambda meta: (triton.cdiv(out_n, meta["BLOCK_N"]), meta["SPLIT_K"])](*args, **flags,
                                                                                          BLOCK_M=MAX_ROWS)


@functools.lru_cache(maxsize=None)
def _split_k_sizes(out_n: int, K: int, has_norm: bool, silu: bool, interpret_split: int) -> tuple[int, int] | None:
    """(fp32 partials, counters) that every split-K tiling the M-row kernel may run with needs, or None when it
    runs without split-K. interpret_split: the interpreter's fixed SPLIT_K (BLOCK_N 16), 0 on a GPU (the
    autotuner's surviving split-K configs)."""
    if interpret_split:
        tiles = [(16, interpret_split)] if interpret_split > 1 else []
    elif _split_k_applies(out_n, K, has_norm):
        tiles = [(c.kwargs["BLOCK_N"], c.kwargs["SPLIT_K"]) for c in _gemm_prune(
            _GEMM_CONFIGS, dict(N=out_n, K=K), HAS_NORM=has_norm) if c.kwargs["SPLIT_K"] > 1]
    else:
        tiles = []
    if not tiles:
        return None
    floats = max(triton.cdiv(out_n, bn) * bn * sk * MAX_ROWS * (2 if silu else 1) for bn, sk in tiles)
    return floats, max(triton.cdiv(out_n, bn) for bn, _ in tiles)


# split-K's fp32 partials and arrival counters: one zero buffer each per device, shared by every call (every layer;
# kernels/scratch.py says why and what that asks of streams and graph capture)
_PARTIALS = DeviceBuffers("gemv_fused split-K partials", torch.float32)
_SPLIT_COUNTERS = DeviceBuffers("gemv_fused split-K arrival counters", torch.int32)


def split_k_scratch(device: torch.device, floats: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The M-row kernel's split-K buffers on `device`: >= `floats` fp32 partials and >= `counters` int32 arrival
    counters (zero: each launch's merging programs reset theirs before it ends)."""
    return _PARTIALS.at_least(device, floats), _SPLIT_COUNTERS.at_least(device, counters)
