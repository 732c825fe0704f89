"""GEMV of 1 to 16 rows with an optional RMSNorm prologue and a residual-add or SiLU*up epilogue, in one launch.

Why: a bs-1 decode step of a dense model (models/dense.py) is ~15 small kernels per layer; in a CUDA-graphed step
each costs >= ~1.1 us plus its memory traffic. Folding the norm in front of the projection it feeds and the
elementwise op after it turns a layer into ~6 launches:
  [norm + qkv GEMV] [rope] [attention] [o_proj GEMV + residual] [norm + gate_up GEMV + SiLU*up] [down GEMV + residual]

Kernel (the M == 1 loop of kernels/gemv.py: each program owns BLOCK_N outputs and accumulates an fp32
[BLOCK_N, BLOCK_K] tile of products over K, reduced once after the loop):
- norm prologue: every program first sums x^2 over the whole row (K <= ~8k: the row sits in L2; recomputing it
  per program is cheaper than another launch), then scales each x block by rstd and the norm weight as it loads it.
- silu_mul: the weight is the fused [2I, K] gate+up weight (`MLP.fuse()`); program n loads BOTH rows n (gate) and
  I + n (up) each K step (two tiles), so gate/up never reach memory and the output is [1, I].
- residual: out = residual + y, added before the single store.

M rows, 2 <= M <= 16 (a speculative verify block): kernels/gemm_rows.py, a tl.dot kernel that reads the weights
once whatever M is (and may split K), with this kernel's prologue and epilogue (kernels/gemv_parts.py: the Triton
helpers every fused GEMV shares). `gemv_fused` checks the arguments once for both and dispatches on M.

Numbers: the eager rounding order of each module, with `_to_dtype` (round to nearest even) at the same points:
  RMSNorm.forward: xn = x_f32 * rsqrt(mean(x_f32^2) + eps), rounded to the dtype, times norm_weight, rounded;
  nn.Linear: fp32 accumulation (+ bias in fp32), rounded once to the dtype (as cuBLAS);
  MLP: silu in fp32 on the rounded gate (IEEE division, CUDA's expf), rounded, times the rounded up, rounded;
  residual: the sum of the two dtype values in fp32, rounded once (the eager bf16/fp16 add).
Only summation orders differ (the mean's tree, the dot product's): fp32 agrees to ~1e-6 relative, bf16/fp16 to a
few ulp (a 1-ulp flip of a normed input moves the dot product by that much). In the M-row kernel the dot products
are tl.dot's: 16-bit operands go in as they are (exact products, fp32 sums, as cuBLAS's nn.Linear); fp32 operands
with input_precision="ieee", so a GPU does not round them to TF32.

Norm epilogue (`out_norm_weight`, both kernels and split-K; kernels/norm_epilogue.py says why and how): the launch
also writes RMSNorm(y) for the GEMV that reads y next, computed by the last program to finish (NORM_OUT, a
constexpr: without it no atomic is compiled and the kernels are as before).

`gemv_fused_reference` is the plain-PyTorch twin built from the eager ops themselves (tests check it equals the
dense.py modules bit for bit); `gemv_fused_op` is the kernel as the torch custom op "specpilot::gemv_fused" (split-K
leaves its counters at zero, as they began: no state torch.compile would need to know of).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specpilot.kernels import gemm_rows, trace, tuned  # M >= 2 rows; per-program timelines; pinned autotuning picks
from specpilot.kernels.gemm_rows import MAX_ROWS  # the most rows a call takes
from specpilot.kernels.norm_epilogue import check_out_norm, out_norm_args
from specpilot.kernels.norm_handoff import check_norm_ss, groups, handoff_args
from specpilot.kernels.rmsnorm import rmsnorm_reference

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.gemv_parts import (_L2_CHUNK_C, _acc_block, _epilogue, _epilogue_apply, _epilogue_loads,
                                              _l2_prefetch_bytes, _l2_prefetch_rows, _norm_rstd, _w_tiles)
    from specpilot.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options  # PDL (kernels/pdl.py)
    from specpilot.kernels.norm_epilogue import norm_rows_when_last  # NORM_OUT (kernels/norm_epilogue.py)
    from specpilot.kernels.trace import cycles as _tr_cycles, now as _tr_now, record as _tr_record  # TRACE
except ImportError:  # CPU-only installs: the reference path only
    triton = None

ACTS = ("", "silu_mul")  # "" (or None): no activation
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
INTERPRET_PAIRED = False  # the interpreter's fixed configuration takes the PAIRED layout (tests set it; on a GPU
# the autotuner chooses)
INTERPRET_PREFETCH = False  # the interpreter's one-row kernel prefetches its first weight tile (tests set it; on a
# GPU it does with PDL, where the prefetch can overlap the previous kernel)
# The one-row kernel loads its first weight tile before anything else (PREFETCH) without PDL too: that first DRAM
# round trip then overlaps the norm prologue's row load and reduction (the qkv and gate/up GEMVs) instead of
# following it, in every program. The same bits (the loop adds the same sums in the same order). Under PDL it is
# on unless PDL_PREFETCH says otherwise (and never with the late trigger). Off: slower on the H200 (session 26,
# scripts/gpu_step_timing.py --variants=fuseddecode,fusedprefetch: 1.5B step +8.5%, Qwen3-8B equal); the autotuner
# keys on it, so the tiles are chosen for each way.
ONE_ROW_PREFETCH = False
# Under PDL the one-row kernel prefetches its first weight tile before its wait (session 18). Session 19 measured the
# PDL path SLOWER with it (1.5B step 1.442 -> 1.562 ms) where session 13's PDL without it had been ~1% faster: the
# early-resident programs holding a tile each are the suspect. False: PDL launches without the prefetch, to time
# the two apart (scripts/gpu_step_timing.py fuseddecode_pdl vs fuseddecode_pdlnopf). Same bits either way. With
# the late trigger (kernels/pdl.py) there is no first-tile prefetch at all: session 26 timed it there at 1.3776 vs
# 1.3769 ms (1.5B) and 4.592 vs 4.527 ms (Qwen3-8B) with / without.
PDL_PREFETCH = True
# The one-row kernel's K loop runs one block ahead (PIPE, EngineConfig.gemv_pipeline): block k's weight tiles are
# asked for before block k - 1's are multiplied, so every program keeps two tiles in flight instead of one. Why:
# compiled for sm_90 (session 35) the loop issued a block's loads, then waited on them before its FMAs, and Triton
# does not pipeline loads that feed no tl.dot (the num_stages 3 configs allocate no shared-memory stages), so a
# program's speed was one DRAM round trip a block; the GEMVs that tune to few programs an SM or few bytes a block
# (1.5B down: 4 KB a block, ~5.8 programs an SM; 8B down / o_proj: 2 KB) are latency-bound there. Costs registers
# (the 1.5B gate/up tile 79 -> 96 a thread: 3 -> 2 programs an SM); small tiles keep theirs. The same sums in the
# same order (the same bits). A process-wide switch; the autotuner keys on it, so tiles are chosen for each way.
# Off: neutral on the H200 (session 35, graphed one-token step, two interleaved pairs: 1.5B -0.8%, Qwen3-8B +0.4%,
# both inside the calls' drift; the autotuner took other tiles with it, e.g. 1.5B gate/up 4 x 256 instead of 32 x 128)
ONE_ROW_PIPE = False
# The one-row kernel loads its epilogue's operands (the residual of o_proj / down, a bias) right after its PDL wait
# instead of after the K loop (EARLY_EPI, EngineConfig.early_epilogue). Why: after the loop those loads are one more
# L2 round trip between a program's last weight tile and its store, and the LAST program's store is what releases
# the next kernel (the chain of a one-token step is five such kernels a layer); before the loop the round trip
# overlaps the weight stream. The residual is an activation, so it is read after the wait, never before (the rule
# of kernels/pdl.py). Costs a program BLOCK_N values in registers. The same values in the same sums: the same bits.
# Not tuned on: the autotuning key leaves it out, so the tiles tuned (or pinned, kernels/tuned.py) without it apply.
EARLY_EPILOGUE = False
# The one-row kernel asks for its first K block's weight tile(s) right after its PDL wait, ahead of the norm
# prologue (TILE_AFTER_WAIT, EngineConfig.tile_after_wait): gate/up and the LM head otherwise load and reduce the
# whole input row first (an L2 round trip and a tree reduction) before their first DRAM request. PREFETCH's tile
# comes before the wait instead (slower, session 26: +8.5% without PDL; never taken with the late trigger), where
# it holds registers and queues behind the kernel ahead's stream. The same sums in the same order: the same bits.
# Not in the autotuning key (the tiles tuned or pinned without it apply). kernels/qkv_rope.py has its twin.
FIRST_TILE_AFTER_WAIT = False
# Under PDL, a one-row GEMV whose whole weight is at most this many bytes first asks L2 for all of it, one bulk
# prefetch (cp.async.bulk.prefetch.L2, sm_90) per gemv_parts.L2_CHUNK bytes of its own rows, before its wait:
# where the kernel ahead is latency-bound (o_proj behind RoPE + attention, ~13 us at Qwen3-8B in which HBM idles)
# the weight then streams into L2 meanwhile and the GEMV reads it from there. No data comes back to the program, so
# registers and numbers are unchanged. 0: off (EngineConfig.pdl_l2_mb sets it, 8 MiB by default since session 29:
# at 1.5B o_proj's 4.5 MiB warmed behind RoPE + attention took 4.5-9% off the step; the L2 holds 50 MB on the
# H100/H200, so weights larger than about half of it would evict their own first lines before they are read).
PDL_L2_MAX_BYTES = 0
# The share of each warmed weight asked of L2 before the wait, in 64ths (EngineConfig.pdl_l2_share): every program
# warms only the first PDL_L2_PART / 64 of its own rows' bytes. Why: warming all of o_proj's 32 MiB at Qwen3-8B was
# slower (session 27, +1.4%): ~7.5 us of HBM traffic issued while the attention ahead still waits on its own K/V
# reads, i.e. the critical path's loads queue behind it. A share the idle window can hold (RoPE + attention at 8B,
# ~10 us; the tail of down_proj before qkv) takes that much of the weight off the GEMV's own DRAM time and no more.
# 64: all of it (as before the share existed). A hint: the same numbers. Measured (H200, session 29): slower or
# neutral everywhere (Qwen3-8B o_proj 1/8-1/4: -0.05 / +1.5%; 1.5B 1/4-3/4: -0.1 to +1.2% where all of it was
# -4.5 to -6.2%): what warming buys is a GEMV reading L2 only, no DRAM ramp, not bytes off its stream. 64 it stays.
PDL_L2_PART = 64
# Under PDL, o_proj's one-row GEMV also asks L2, before its wait, for the head of the NEXT GEMV's weight (gate/up:
# the first rows of its gate half and of its up half, the rows its first programs read), this many bytes in all; 0:
# off (EngineConfig.pdl_l2_next_mb sets it). Why: o_proj's programs are resident while the attention ahead runs (it
# triggers first thing), a latency-bound launch in which HBM idles, and with its own weight warmed (PDL_L2_MAX_BYTES)
# o_proj reads L2 too; the largest weight of the layer then starts from L2 instead of one DRAM ramp for all of it.
# Session 21 warmed gate/up from a side stream over qkv, RoPE, attention and o_proj (slower: its traffic queued
# behind qkv's own DRAM stream and the streams' joins cost launches); here the warming is issued inside the window
# that is idle and by programs already waiting in it. The first PDL_L2_NEXT_PROGRAMS programs share the bytes (the
# lowest program ids are the ones resident early). A hint: the same numbers.
PDL_L2_NEXT_BYTES = 0
PDL_L2_NEXT_PROGRAMS = 128


def _check(x, weight, bias, norm_weight, residual, act, max_rows: int = MAX_ROWS) -> tuple[int, int, str]:
    """Validate shapes, strides and dtypes (ValueError) -> (K, output columns, act as a str). `max_rows`: 1 for a
    one-row kernel (kernels/gemv12.py)."""
    act = act or ""
    if act not in ACTS:
        raise ValueError(f"gemv_fused: unknown act {act!r}; supported: None, 'silu_mul'")
    if x.dim() != 2 or not 1 <= x.shape[0] <= max_rows or weight.dim() != 2:
        rows = "x [1, K] (one row)" if max_rows == 1 else f"x [M, K] with 1 <= M <= {max_rows} rows"
        raise ValueError(f"gemv_fused: need {rows} and weight [N, K]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    (M, K), (N, K2) = x.shape, weight.shape
    if K != K2 or K < 1 or N < 1:
        raise ValueError(f"gemv_fused: x [{M}, {K}] and weight {tuple(weight.shape)} disagree on K (or are empty)")
    if x.stride(1) != 1 and K > 1:
        raise ValueError(f"gemv_fused: x must have unit stride along K, got strides {x.stride()}")
    if not weight.is_contiguous():
        raise ValueError("gemv_fused: weight must be contiguous [N, K]")
    if act and residual is not None:
        raise ValueError("gemv_fused: residual and act cannot be combined (the residual adds after down_proj)")
    if act == "silu_mul" and N % 2:
        raise ValueError(f"gemv_fused: silu_mul needs the fused gate+up weight [2I, K]; got odd N = {N}")
    out_n = N // 2 if act == "silu_mul" else N
    for name, t, shape in (("bias", bias, (N,)), ("norm_weight", norm_weight, (K,)), ("residual", residual, (M, N))):
        if t is None:
            continue
        if tuple(t.shape) != shape or (t.stride(-1) != 1 and t.shape[-1] > 1):
            raise ValueError(f"gemv_fused: {name} must be {list(shape)} with unit stride, got {tuple(t.shape)} "
                             f"strides {t.stride()}")
    dts = {n: t.dtype for n, t in (("x", x), ("weight", weight), ("bias", bias), ("norm_weight", norm_weight),
                                   ("residual", residual)) if t is not None}
    if x.dtype not in DTYPES or len(set(dts.values())) != 1:
        raise ValueError(f"gemv_fused: all tensors must share one of {DTYPES} (as the eager modules need); got {dts}")
    return K, out_n, act


def gemv_fused_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                         norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                         residual: torch.Tensor | None = None, act: str | None = None) -> torch.Tensor:
    """Exactly the eager modules: `RMSNorm.forward`, `nn.Linear`, the MLP's `F.silu(gate) * up`, `residual + y`."""
    _, _, act = _check(x, weight, bias, norm_weight, residual, act)
    h = x if norm_weight is None else rmsnorm_reference(x, norm_weight, eps)
    y = F.linear(h, weight, bias)
    if act == "silu_mul":
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


if triton is not None:

    _NX_PROGRAMS_C = tl.constexpr(PDL_L2_NEXT_PROGRAMS)

    @triton.jit
    def _l2_prefetch_next(nx_ptr, nx_off, nx_bytes, PROGRAMS: tl.constexpr):
        """This program's share of [nx_ptr, nx_ptr + nx_bytes) (and of the same span at nx_off, where nx_off > 0)
        asked of L2: the first min(grid, PROGRAMS) programs split the bytes in 16-byte-rounded spans."""
        pid = tl.program_id(0)
        p = tl.minimum(tl.num_programs(0), PROGRAMS)
        if pid < p:
            span = (tl.cdiv(nx_bytes, p) + 15) // 16 * 16
            lo = pid.to(tl.int64) * span
            n = tl.minimum(nx_bytes - lo, span)
            if n > 0:
                base = nx_ptr.to(tl.pointer_type(tl.int8), bitcast=True)
                _l2_prefetch_bytes(base + lo, n, _L2_CHUNK_C)
                if nx_off > 0:
                    _l2_prefetch_bytes(base + nx_off + lo, n, _L2_CHUNK_C)

    @triton.jit
    def _gemv_fused_kernel(x_ptr, w_ptr, b_ptr, nw_ptr, r_ptr, y_ptr, N, K, stride_wn, eps, on_ptr, onw_ptr,
                           ocnt_ptr, out_eps, nx_ptr, nx_off, nx_bytes, HAS_BIAS: tl.constexpr,
                           HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr,
                           SILU_MUL: tl.constexpr, ON_GPU: tl.constexpr, K_P2: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PAIRED: tl.constexpr = False,
                           USE_PDL: tl.constexpr = False, NORM_OUT: tl.constexpr = False,
                           OUT_P2: tl.constexpr = 1, PREFETCH: tl.constexpr = False,
                           PDL_LATE: tl.constexpr = False, L2_PF: tl.constexpr = False,
                           L2_PART: tl.constexpr = 64, NX_PF: tl.constexpr = False, PIPE: tl.constexpr = False,
                           EARLY_EPI: tl.constexpr = False, TILE_AFTER_WAIT: tl.constexpr = False,
                           TRACE: tl.constexpr = False, tr_ptr=None):
        """y[n] for this program's BLOCK_N columns n < N (N = I with SILU_MUL: gate row n, up row N + n).

        PAIRED (SILU_MUL only, an autotuning choice): the gate and up rows as ONE [2 BLOCK_N, BLOCK_K] tile,
        interleaved (gate n, up n, gate n+1, ...) and one accumulator, split after the reduction, instead of two
        tiles and two accumulators (the same loop as a plain GEMV of 2 BLOCK_N rows; same numbers).

        USE_PDL (launched with PDL, kernels/pdl.py): let the next kernel launch now, then wait for the previous one
        before anything else. Nothing but weights may be read, and nothing written, before the wait: the
        predecessor may still be running and may still read the buffer the allocator gave us as y. PDL_LATE
        (kernels/pdl.py trigger "late"): the next kernel may launch only once this program's K loop is done.
        L2_PF (with PDL; PDL_L2_MAX_BYTES): before the wait, this program's weight rows (gate and up) are asked of
        L2 by bulk prefetches, so they stream in while the kernel ahead still runs; L2_PART (PDL_L2_PART): only the
        first L2_PART / 64 of their bytes. NX_PF (with PDL; PDL_L2_NEXT_BYTES): before the wait, the first
        PDL_L2_NEXT_PROGRAMS programs also ask L2 for nx_bytes of the next GEMV's weight at the byte pointer nx_ptr
        and, where nx_off > 0, as many at nx_ptr + nx_off (gate/up: the heads of its gate and up halves), an equal
        16-byte-rounded span each.

        PREFETCH (with PDL or ONE_ROW_PREFETCH on a GPU; the tests set it under the interpreter): the first K
        block's weight tile(s) are
        loaded before the wait, so a program that became resident while the previous kernel drains has its first
        weights in registers when the wait returns (the DRAM latency of the first load overlaps the predecessor's
        tail instead of following it). The K loop then starts at the second block; the sums are added in the same
        order, so the numbers are the same bits.

        PIPE (ONE_ROW_PIPE): the K loop one block ahead, each block's weight tiles loaded before the previous
        block's are summed (two tiles in flight); the same sums in the same order, so the same bits.

        NORM_OUT (the norm epilogue, kernels/norm_epilogue.py): the last program to finish also writes
        on = RMSNorm(y; onw, out_eps) (OUT_P2: next power of two >= N), counting in on ocnt_ptr. Without it the
        on / onw / ocnt pointers are never touched and no atomic is compiled.

        EARLY_EPI (EARLY_EPILOGUE): the epilogue's bias and residual loads right after the wait, before the norm
        prologue and the K loop (their round trip overlaps the weight stream); the same values, the same bits.

        TILE_AFTER_WAIT (FIRST_TILE_AFTER_WAIT; not with PREFETCH): the first K block's weight tile(s) asked for
        right after the wait, ahead of the norm prologue's row load and reduction (as PREFETCH's, whose tile comes
        before the wait); the same sums in the same order, the same bits.

        TRACE (kernels/trace.py, a diagnostic): the program's timeline row into tr_ptr's region; nothing else."""
        FIRST: tl.constexpr = PREFETCH or TILE_AFTER_WAIT  # the first block's tiles loaded ahead of the loop
        if TRACE:
            t_start = _tr_now()
        if USE_PDL and not PDL_LATE:
            gdc_launch_dependents()
        dt = y_ptr.dtype.element_ty
        n_offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n_offs < N
        rows = n_offs.to(tl.int64)[:, None] * stride_wn  # [BN, 1] (int64: lm_head-sized weights)
        if PAIRED:  # tile row i: column n0 + i // 2, gate (i even) or up (i odd)
            pi = tl.arange(0, 2 * BLOCK_N)
            p_col = tl.program_id(0) * BLOCK_N + pi // 2
            p_mask = p_col < N
            rows = (p_col + (pi % 2) * N).to(tl.int64)[:, None] * stride_wn  # [2 BN, 1]
        m_rows = p_mask if PAIRED else n_mask
        UP: tl.constexpr = SILU_MUL and not PAIRED  # the up rows as a second tile
        if PREFETCH:  # weights only: nobody writes them (see the docstring)
            w0, wu0 = _w_tiles(w_ptr, rows, m_rows, 0, K, N * stride_wn, UP, BLOCK_K)
        if USE_PDL and L2_PF:  # weights only, nothing comes back (see the docstring)
            n0 = tl.program_id(0) * BLOCK_N
            mine = tl.minimum(N - n0, BLOCK_N)
            _l2_prefetch_rows(w_ptr, n0, mine, K, _L2_CHUNK_C, L2_PART)
            if SILU_MUL:
                _l2_prefetch_rows(w_ptr, N + n0, mine, K, _L2_CHUNK_C, L2_PART)
        if USE_PDL and NX_PF:  # the next GEMV's weight only, nothing comes back (see the docstring)
            _l2_prefetch_next(nx_ptr, nx_off, nx_bytes, _NX_PROGRAMS_C)
        if USE_PDL:
            gdc_wait()
        if TRACE:
            t_waited = _tr_now()
            c_waited = _tr_cycles()
        if TILE_AFTER_WAIT and not PREFETCH:  # weights, first: their DRAM round trip overlaps the norm prologue
            w0, wu0 = _w_tiles(w_ptr, rows, m_rows, 0, K, N * stride_wn, UP, BLOCK_K)
        if EARLY_EPI:  # after the wait: the residual is an activation (see EARLY_EPILOGUE)
            b_e, bu_e, r_e = _epilogue_loads(n_offs, n_mask, N, b_ptr, r_ptr + n_offs, n_mask, HAS_BIAS, HAS_RES,
                                             SILU_MUL)
        rstd = 1.0
        if HAS_NORM:
            rstd = _norm_rstd(x_ptr, K, eps, K_P2)
        acc = tl.zeros((2 * BLOCK_N if PAIRED else BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = acc
        if SILU_MUL and not PAIRED:
            acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if FIRST:  # the first K block with the prefetched tiles (the loop's body, same order of sums)
            acc, acc_up = _acc_block(acc, acc_up, w0, wu0, x_ptr, nw_ptr, 0, K, rstd, dt, HAS_NORM, UP, ON_GPU,
                                     BLOCK_K)
        if PIPE:  # the K loop one block ahead: block k0's weights are asked for before block k0 - BK is summed
            k_lo = FIRST * BLOCK_K
            if k_lo < K:
                w, wu = _w_tiles(w_ptr, rows, m_rows, k_lo, K, N * stride_wn, UP, BLOCK_K)
                for k0 in range(k_lo + BLOCK_K, K, BLOCK_K):
                    w_nx, wu_nx = _w_tiles(w_ptr, rows, m_rows, k0, K, N * stride_wn, UP, BLOCK_K)
                    acc, acc_up = _acc_block(acc, acc_up, w, wu, x_ptr, nw_ptr, k0 - BLOCK_K, K, rstd, dt, HAS_NORM,
                                             UP, ON_GPU, BLOCK_K)
                    w = w_nx
                    wu = wu_nx
                acc, acc_up = _acc_block(acc, acc_up, w, wu, x_ptr, nw_ptr, (K - 1) // BLOCK_K * BLOCK_K, K, rstd,
                                         dt, HAS_NORM, UP, ON_GPU, BLOCK_K)
        else:
            for k0 in range(FIRST * BLOCK_K, K, BLOCK_K):
                w, wu = _w_tiles(w_ptr, rows, m_rows, k0, K, N * stride_wn, UP, BLOCK_K)
                acc, acc_up = _acc_block(acc, acc_up, w, wu, x_ptr, nw_ptr, k0, K, rstd, dt, HAS_NORM, UP, ON_GPU,
                                         BLOCK_K)
        if TRACE:
            t_looped = _tr_now()
        if USE_PDL and PDL_LATE:  # every weight is in: the next kernel's programs may take the slots we free
            gdc_launch_dependents()
        if PAIRED:  # [2 BN] -> the gate and up sums [BN] each
            y, u = tl.split(tl.reshape(tl.sum(acc, axis=1), (BLOCK_N, 2)))
        else:
            y = tl.sum(acc, axis=1)  # [BN], one reduction after the loop
            u = y
            if SILU_MUL:
                u = tl.sum(acc_up, axis=1)
        if EARLY_EPI:
            _epilogue_apply(y, u, b_e, bu_e, r_e, y_ptr + n_offs, n_mask, HAS_BIAS, HAS_RES, SILU_MUL, ON_GPU)
        else:
            _epilogue(y, u, n_offs, n_mask, N, b_ptr, r_ptr, y_ptr, HAS_BIAS, HAS_RES, SILU_MUL, ON_GPU)
        if NORM_OUT:
            norm_rows_when_last(y_ptr, N, 1, N, onw_ptr, out_eps, on_ptr, N, ocnt_ptr, tl.num_programs(0), OUT_P2)
        if TRACE:
            _tr_record(tr_ptr, tl.program_id(0), t_start, t_waited, t_looped, c_waited, 1, t_looped)

    # two weight tiles per K step with silu_mul: the autotuner keys on the flags, so it may pick smaller tiles there
    # (ON_GPU: libdevice's expf and the hardware's round-to-nearest-even casts; the interpreter has neither)
    # + wider tiles with 8 warps: more rows share each program's x-side work (the norm prologue), and more bytes
    # in flight per SM at the 8B-class shapes (the first H200 run: 3.2 TB/s there vs cuBLAS's 3.7 at gate_up)
    _CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                for bn, bk in ((1, 1024), (2, 512), (2, 1024), (4, 256), (4, 512), (8, 256), (8, 512), (16, 256))
                for w in (2, 4) for s in (1, 3)] + [
                triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                for bn, bk in ((16, 512), (32, 128), (32, 256)) for w in (4, 8) for s in (1, 3)]
    # SiLU x up also tries the paired single-tile layout (PAIRED) with each tile shape; other calls never see it
    _CONFIGS += [triton.Config({**c.kwargs, "PAIRED": True}, num_warps=c.num_warps, num_stages=c.num_stages)
                 for c in _CONFIGS if c.kwargs["BLOCK_N"] <= 16]

    _KEY = ["N", "K", "HAS_BIAS", "HAS_NORM", "HAS_RES", "SILU_MUL", "NORM_OUT", "PREFETCH", "PIPE"]

    def _prune(configs, named_args, **kwargs):  # (+ a pinned pick where one ships: kernels/tuned.py)
        silu = kwargs.get("SILU_MUL", named_args.get("SILU_MUL"))
        configs = [c for c in configs if silu or not c.kwargs.get("PAIRED", False)]
        return tuned.narrow("_gemv_fused_kernel", configs, named_args, kwargs, _KEY)

    # CPU tests: one small fixed configuration (masks on N and K get exercised)
    _kernel = _gemv_fused_kernel if _INTERPRET else tuned.autotune(_gemv_fused_kernel, _CONFIGS, _KEY, _prune)


def gemv_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
               act: str | None = None, out_norm_weight: torch.Tensor | None = None, out_eps: float = 1e-6,
               warm_next: torch.Tensor | None = None, warm_next_halves: bool = False, ss_out: bool = False,
               norm_ss: torch.Tensor | None = None):
    """y = act(RMSNorm(x) @ weight^T + bias) (+ residual) for M = 1..16 rows, in one launch.

    x [M, K] unit stride along K; weight [N, K] contiguous; bias [N]; norm_weight [K] (prologue, eps, per row);
    residual [M, N] unit stride along N (epilogue, not with act); act None or "silu_mul" (weight = fused gate+up
    [2I, K], output [M, I]). All one dtype (fp32 / bf16 / fp16). -> a new [M, N] (or [M, I]) tensor in x's dtype;
    with out_norm_weight [N] (the norm epilogue, kernels/norm_epilogue.py) -> (y, RMSNorm(y; out_norm_weight,
    out_eps)), the second the bits kernels/rmsnorm.py gives for y.
    warm_next (M == 1 under PDL, PDL_L2_NEXT_BYTES > 0, this weight warmed): the next GEMV's weight, whose head
    this launch asks L2 for before its wait (`next_warming`; warm_next_halves: a gate/up weight, the heads of both
    halves). A hint only.
    The norm handoff (M >= 2 rows; kernels/norm_handoff.py): ss_out -> (y, ss), ss the fp32 [ceil(N' / 16), 16]
    per-row group sums of squares of y (N' its columns) for the launch that normalizes y next; norm_ss (with
    norm_weight): such sums of x's rows, taken for the norm's rstd instead of a pass over the rows.
    M == 1 runs the one-row kernel, M >= 2 the tl.dot kernel. Static shapes, no host sync: safe inside CUDA graphs
    (once autotuned outside capture, and with the norm epilogue run once eagerly: its counter is allocated then)."""
    if triton is None:
        raise RuntimeError("gemv_fused needs triton")
    K, out_n, act = _check(x, weight, bias, norm_weight, residual, act)
    check_out_norm(out_norm_weight, out_n, x.dtype, "gemv_fused")
    M = x.shape[0]
    check_norm_ss(norm_ss, norm_weight, M, K, MAX_ROWS, "gemv_fused")
    if ss_out and (M < 2 or out_norm_weight is not None):
        raise ValueError(f"gemv_fused: ss_out is the M-row kernel's (2 to {MAX_ROWS} rows) and not with a norm "
                         f"epilogue (out_norm_weight), got {M} row(s)")
    y = torch.empty(M, out_n, device=x.device, dtype=x.dtype)
    normed, norm_args, norm_flags = out_norm_args(y, out_norm_weight, out_eps)
    ss, ss_args, ss_flags = handoff_args(y, ss_out, norm_ss, K, MAX_ROWS)
    ptrs = (x, weight, weight if bias is None else bias, weight if norm_weight is None else norm_weight,
            weight if residual is None else residual, y)  # unused pointers: dummies (the weight)
    pdl = launch_options()  # launch_pdl=True with USE_PDL when the PDL switch is on
    flags = dict(HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None, HAS_RES=residual is not None,
                 SILU_MUL=act == "silu_mul", ON_GPU=not _INTERPRET,
                 K_P2=triton.next_power_of_2(K) if norm_weight is not None else 1, USE_PDL=pdl.use_pdl,
                 PDL_LATE=pdl.late, **pdl.kwargs, **norm_flags)
    if M > 1:
        gemm_rows.launch_rows(ptrs, M, out_n, K, weight.stride(0), 0 if residual is None else residual.stride(0),
                              eps, (*norm_args, *ss_args), {**flags, **ss_flags})
    else:
        nx_args, nx_on = next_warming(warm_next, warm_next_halves, pdl.use_pdl, weight)
        args = (*ptrs, out_n, K, weight.stride(0), float(eps), *norm_args, *nx_args)
        tr = trace.launch_args(x.device, trace_name, out_n, K, flags)  # a diagnostic, off (kernels/trace.py)
        if _INTERPRET:
            _kernel[(triton.cdiv(out_n, 4),)](*args, **flags, BLOCK_N=4, BLOCK_K=64, PAIRED=INTERPRET_PAIRED,
                                               PREFETCH=INTERPRET_PREFETCH or ONE_ROW_PREFETCH, PIPE=ONE_ROW_PIPE,
                                               EARLY_EPI=EARLY_EPILOGUE, TILE_AFTER_WAIT=FIRST_TILE_AFTER_WAIT,
                                               **tr)
        else:
            _kernel[lambda meta: (triton.cdiv(out_n, meta["BLOCK_N"]),)](*args, **flags,
                                                                         PREFETCH=pdl.use_pdl and PDL_PREFETCH
                                                                         and not pdl.late or ONE_ROW_PREFETCH,
                                                                         **l2_warming(weight, pdl.use_pdl),
                                                                         NX_PF=nx_on, PIPE=ONE_ROW_PIPE,
                                                                         EARLY_EPI=EARLY_EPILOGUE,
                                                                         TILE_AFTER_WAIT=FIRST_TILE_AFTER_WAIT, **tr)
    return y if normed is None and ss is None else (y, normed if ss is None else ss)


def trace_name(out_n: int, K: int, flags: dict) -> str:
    """A one-row launch's name in a trace (kernels/trace.py): its shape and what its prologue / epilogue do."""
    parts = [f"gemv N={out_n} K={K}"] + [tag for tag, flag in (("norm", "HAS_NORM"), ("silu_mul", "SILU_MUL"),
                                                               ("res", "HAS_RES"), ("bias", "HAS_BIAS"))
                                         if flags.get(flag)]
    return " ".join(parts)


def l2_warming(weight: torch.Tensor, use_pdl: bool) -> dict:
    """The one-row kernel's L2 warming constexprs for this weight: L2_PF where PDL is on, the weight is at most
    PDL_L2_MAX_BYTES and its rows are whole 16-byte granules (the bulk prefetch's); L2_PART, the share of each
    program's rows it warms (PDL_L2_PART / 64), where it does (64 otherwise: one compiled variant)."""
    nbytes = weight.numel() * weight.element_size()
    on = bool(use_pdl and PDL_L2_MAX_BYTES > 0 and nbytes <= PDL_L2_MAX_BYTES
              and weight.shape[-1] * weight.element_size() % 16 == 0)
    if on and not 1 <= PDL_L2_PART <= 64:
        raise ValueError(f"gemv_fused: PDL_L2_PART must be in [1, 64] (64ths of the weight), got {PDL_L2_PART}")
    return {"L2_PF": on, "L2_PART": PDL_L2_PART if on else 64}


def next_warming(nxt: torch.Tensor | None, halves: bool, use_pdl: bool, weight: torch.Tensor) -> tuple[tuple, bool]:
    """The one-row kernel's (nx_ptr, nx_off, nx_bytes) and NX_PF for warming the head of the next GEMV's weight
    `nxt` (contiguous; PDL_L2_NEXT_BYTES in all, at most the whole weight; `halves`: a [2I, K] gate/up weight, half
    of the bytes from the head of each half) from a launch over `weight` -> ((weight, 0, 0), False) where it does
    not apply: no next weight, the budget 0, byte counts that are not whole 16-byte granules (the bulk
    prefetch's), or a launch whose own weight is not warmed (`l2_warming`: without PDL, or larger than
    PDL_L2_MAX_BYTES). Only a GEMV that reads L2 leaves HBM idle behind the kernel ahead; one streaming its own
    weight from DRAM (Qwen3-8B's o_proj, 32 MiB) would queue the extra traffic on itself (H200, session 33: +0.5 to
    +1.5% there, -2.0 / -2.8% at 1.5B)."""
    off = ((weight, 0, 0), False)
    if nxt is None or PDL_L2_NEXT_BYTES <= 0 or not nxt.is_contiguous() or not l2_warming(weight, use_pdl)["L2_PF"]:
        return off
    total = nxt.numel() * nxt.element_size()
    if halves:
        if nxt.dim() != 2 or nxt.shape[0] % 2:
            raise ValueError(f"gemv_fused: warm_next_halves needs a [2I, K] weight, got {tuple(nxt.shape)}")
        half = total // 2
        each = min(PDL_L2_NEXT_BYTES // 2, half) // 16 * 16
        if half % 16 or each <= 0:
            return off
        return (nxt, half, each), True
    each = min(PDL_L2_NEXT_BYTES, total) // 16 * 16
    return ((nxt, 0, each), True) if each > 0 else off


def _register_op():
    """The kernel as a torch custom op: one opaque call under torch.compile (as kernels/gemv.py)."""

    @torch.library.custom_op("specpilot::gemv_fused", mutates_args=())
    def gemv_fused_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      norm_weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None,
                      act: str, warm_next: torch.Tensor | None = None) -> torch.Tensor:
        """gemv_fused; warm_next: a gate/up weight whose halves' heads are warmed in L2 (see gemv_fused)."""
        return gemv_fused(x, weight, bias, norm_weight=norm_weight, eps=eps, residual=residual, act=act,
                          warm_next=warm_next, warm_next_halves=True)

    @gemv_fused_op.register_fake
    def _(x, weight, bias, norm_weight, eps, residual, act, warm_next=None):
        _, out_n, _ = _check(x, weight, bias, norm_weight, residual, act)
        return x.new_empty(x.shape[0], out_n)

    @torch.library.custom_op("specpilot::gemv_fused_normed", mutates_args=())
    def gemv_fused_normed_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             norm_weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None, act: str,
                             out_norm_weight: torch.Tensor, out_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """gemv_fused with the norm epilogue -> (y, RMSNorm(y)); the arrival counter ends at zero as it began."""
        return gemv_fused(x, weight, bias, norm_weight=norm_weight, eps=eps, residual=residual, act=act,
                          out_norm_weight=out_norm_weight, out_eps=out_eps)

    @gemv_fused_normed_op.register_fake
    def _(x, weight, bias, norm_weight, eps, residual, act, out_norm_weight, out_eps):
        _, out_n, _ = _check(x, weight, bias, norm_weight, residual, act)
        return x.new_empty(x.shape[0], out_n), x.new_empty(x.shape[0], out_n)

    @torch.library.custom_op("specpilot::gemv_fused_handoff", mutates_args=())
    def gemv_fused_handoff_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              norm_weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None, act: str,
                              norm_ss: torch.Tensor | None, ss_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """gemv_fused with the norm handoff (M >= 2 rows) -> (y, its sums of squares); without ss_out the second is
        an empty fp32 [0, 16]."""
        out = gemv_fused(x, weight, bias, norm_weight=norm_weight, eps=eps, residual=residual, act=act,
                         ss_out=ss_out, norm_ss=norm_ss)
        return out if ss_out else (out, x.new_empty(0, MAX_ROWS, dtype=torch.float32))

    @gemv_fused_handoff_op.register_fake
    def _(x, weight, bias, norm_weight, eps, residual, act, norm_ss, ss_out):
        _, out_n, _ = _check(x, weight, bias, norm_weight, residual, act)
        return x.new_empty(x.shape[0], out_n), x.new_empty(groups(out_n) if ss_out else 0, MAX_ROWS,
                                                            dtype=torch.float32)

    return gemv_fused_op, gemv_fused_normed_op, gemv_fused_handoff_op


gemv_fused_op, gemv_fused_normed_op, gemv_fused_handoff_op = _register_op() if triton is not None else (None,) * 3
