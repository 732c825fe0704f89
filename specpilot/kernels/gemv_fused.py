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

M rows, 2 <= M <= 16 (a speculative verify block of T tokens: models/fused_decode.py with fused_verify): a second
kernel, `_gemm_fused_kernel`, since the one-row loop would stream the weights once per row. Each program loads a
weight tile [BLOCK_N, BLOCK_K] once per K step and multiplies it with an x tile of 16 rows (rows >= M masked to 0)
through `tl.dot` (tensor cores; fp32 accumulation), so the weights are read once whatever M is. Prologue and
epilogue are the one-row kernel's helpers applied to [16, BLOCK_K] / [16, BLOCK_N] tiles: rstd per row, the same
rounding points per element. M == 1 keeps `_gemv_fused_kernel` (tuned and measured on the H200). The M-row norm
prologue (a serial pass over the M rows, then a normed [16, BLOCK_K] tile per K step in every program) made the
normed calls 1.7-2.8x cuBLAS's time on the H200, so models/fused_decode.py normalizes the rows in a launch of its
own first (PRENORM_ROWS) and the M-row calls normally get no norm; the prologue stays for other callers.

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

import functools
import os

import torch
import torch.nn.functional as F

from specpilot.kernels import trace, tuned  # per-program timelines (a diagnostic); pinned autotuning picks
from specpilot.kernels.norm_epilogue import check_out_norm, out_norm_args
from specpilot.kernels.norm_handoff import check_norm_ss, groups, handoff_args
from specpilot.kernels.rmsnorm import rmsnorm_reference
from specpilot.kernels.scratch import DeviceBuffers

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from specpilot.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options  # PDL (kernels/pdl.py)
    from specpilot.kernels.norm_epilogue import norm_rows_when_last  # NORM_OUT (kernels/norm_epilogue.py)
    from specpilot.kernels.norm_handoff import rstd_from_ss, ss_store  # SS_IN / SS_OUT (kernels/norm_handoff.py)
    from specpilot.kernels.rmsnorm import _to_dtype  # fp32 -> dtype, round to nearest even (also interpreted)
    from specpilot.kernels.trace import cycles as _tr_cycles, now as _tr_now, record as _tr_record  # TRACE
except ImportError:  # CPU-only installs: the reference path only
    triton = None

ACTS = ("", "silu_mul")  # "" (or None): no activation
MAX_ROWS = 16  # the M-row kernel's x tile: tl.dot's smallest M (a verify block of up to 16 tokens)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
INTERPRET_PAIRED = False  # the interpreter's fixed configuration takes the PAIRED layout (tests set it; on a GPU
# the autotuner chooses)
INTERPRET_PREFETCH = False  # the interpreter's one-row kernel prefetches its first weight tile (tests set it; on a
# GPU it does with PDL, where the prefetch can overlap the previous kernel)
INTERPRET_SPLIT_K = 1  # the interpreter's fixed M-row configuration splits K this many ways (tests set it; on a GPU
# the autotuner chooses, where `_split_k_applies`)
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
# prefetch (cp.async.bulk.prefetch.L2, sm_90) per L2_CHUNK bytes of its own rows, before its wait: where the kernel
# ahead is latency-bound (o_proj behind RoPE + attention, ~13 us at Qwen3-8B in which HBM idles) the weight then
# streams into L2 meanwhile and the GEMV reads it from there. No data comes back to the program, so registers and
# numbers are unchanged. 0: off (EngineConfig.pdl_l2_mb sets it, 8 MiB by default since session 29: at 1.5B
# o_proj's 4.5 MiB warmed behind RoPE + attention took 4.5-9% off the step; the L2 holds 50 MB on the H100/H200,
# so weights larger than about half of it would evict their own first lines before they are read).
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
L2_CHUNK = 64 * 1024  # bytes a bulk prefetch asks for (a multiple of 16)
# The M-row kernel's autotuning key M_BUCKET is M rounded up to a power of two, and at least this (0: M's own).
# Every bucket runs the same BLOCK_M = MAX_ROWS tile, so the key only decides which tuned tiling a launch takes;
# the tunings are timed one launch at a time, outside a graph and without PDL, and at 1.5B the 5-8-row bucket's
# chose worse than the 16-row one's there (H200, session 29: the graphed 5-token verify step 2.005 ms, the 9-token
# 1.866). EngineConfig.gemm_bucket_min sets it. Numbers: another tiling's fp32 summation order, as any autotuning
# choice of this kernel.
M_BUCKET_MIN = 0


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

    @triton.jit
    def _norm_rstd(x_ptr, K, eps, K_P2: tl.constexpr):
        """1 / RMS of the row x[:K]: recomputed by every program (the row is L2-resident) from ONE load of the
        whole row (K_P2 = next power of two >= K): a loop over K blocks here was a serial pass ahead of the weight
        stream (H200: the norm + qkv GEMV took 1.4x cuBLAS's plain GEMV at 8B shapes)."""
        kk = tl.arange(0, K_P2)
        xk = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        return tl.rsqrt(tl.sum(xk * xk, axis=0) / K + eps)  # as torch.rsqrt(mean + eps) (the sum is a tree)

    # one bulk L2 prefetch of $2 bytes at $1, issued by the program's thread 0 only (a scalar runs in every thread)
    _L2_BULK_PTX = tl.constexpr("{\n\t.reg .pred %l2p;\n\t.reg .b32 %l2t;\n\tmov.u32 %l2t, %tid.x;\n\t"
                                "setp.eq.u32 %l2p, %l2t, 0;\n\t@%l2p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t"
                                "mov.u32 $0, 0;\n\t}")
    _L2_CHUNK_C = tl.constexpr(L2_CHUNK)

    @triton.jit
    def _l2_prefetch_bytes(base, nbytes, CHUNK: tl.constexpr):
        """Ask L2 for the nbytes (a multiple of 16) at the byte pointer `base` (16-byte aligned), CHUNK bytes per
        bulk prefetch; nothing comes back."""
        for off in range(0, nbytes, CHUNK):
            size = tl.minimum(nbytes - off, CHUNK).to(tl.int32)
            tl.inline_asm_elementwise(_L2_BULK_PTX, "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False,
                                      pack=1)

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
    def _l2_prefetch_rows(w_ptr, row0, rows, K, CHUNK: tl.constexpr, PART: tl.constexpr = 64):
        """Ask L2 for weight rows [row0, row0 + rows) of a contiguous [*, K] matrix (K * itemsize a multiple of 16:
        the host checks), CHUNK bytes per bulk prefetch. PART < 64: only the first PART / 64 of those bytes
        (rounded down to 16, the bulk prefetch's granule)."""
        base = (w_ptr + row0.to(tl.int64) * K).to(tl.pointer_type(tl.int8), bitcast=True)
        nbytes = rows.to(tl.int64) * K * w_ptr.dtype.element_ty.primitive_bitwidth // 8
        if PART < 64:
            nbytes = nbytes * PART // 64 // 16 * 16
        _l2_prefetch_bytes(base, nbytes, CHUNK)

    @triton.jit
    def _norm_h(h, nw, rstd, dt: tl.constexpr, ON_GPU: tl.constexpr):
        """RMSNorm.forward on fp32 inputs h with fp32 norm weights nw: normalized, rounded to the dtype, times the
        weight, rounded (returned in fp32)."""
        if ON_GPU:  # the GPU's cvt rounds to nearest even: one instruction (this runs per program and K block; the
            # by-hand rounding cost ~8 integer ops an element, as much as the weight's FMAs when a program owns
            # few rows)
            h = ((h * rstd).to(dt).to(tl.float32) * nw).to(dt).to(tl.float32)
        else:  # the interpreter truncates fp32 -> bf16: round by hand
            h = _to_dtype(_to_dtype(h * rstd, dt).to(tl.float32) * nw, dt).to(tl.float32)
        return h

    @triton.jit
    def _norm_rstds(x_ptr, stride_xm, M, K, eps, K_P2: tl.constexpr, BLOCK_M: tl.constexpr):
        """[BLOCK_M] 1 / RMS of rows m < M (0 for the masked rows): `_norm_rstd` row by row, so each row's value is
        the one-row kernel's bit for bit (a [BLOCK_M, K_P2] tile at once would not fit in registers at K ~ 4k)."""
        rows = tl.arange(0, BLOCK_M)
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for m in range(0, M):
            rstd = tl.where(rows == m, _norm_rstd(x_ptr + m * stride_xm, K, eps, K_P2), rstd)
        return rstd

    @triton.jit
    def _epilogue_loads(n_offs, n_mask, N, b_ptr, r_ptrs, mask, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                        SILU_MUL: tl.constexpr):
        """The epilogue's operands -> (bias of the columns n_offs, bias of their up rows (SILU_MUL), residual at
        r_ptrs under mask), fp32; 0.0 for those the flags leave out. Split from `_epilogue_apply` so that the
        one-row kernel can issue them before its K loop (EARLY_EPI)."""
        b = 0.0
        bu = 0.0
        r = 0.0
        if HAS_BIAS:
            b = tl.load(b_ptr + n_offs, mask=n_mask, other=0.0).to(tl.float32)
            if SILU_MUL:
                bu = tl.load(b_ptr + N + n_offs, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        return b, bu, r

    @triton.jit
    def _silu_times_up(y, u, dt: tl.constexpr, ON_GPU: tl.constexpr):
        """The eager MLP's SiLU(gate) x up on gate y and up u, both fp32 holding dtype values: silu rounded to the
        dtype, times up, in fp32 (the caller rounds the product once). kernels/fused_mlp.py shares it."""
        if ON_GPU:  # torch's silu: g / (1 + exp(-g)), IEEE division, CUDA's expf (as kernels/silu_mul.py)
            e = libdevice.exp(-y)
        else:  # the interpreter has no libdevice: numpy's exp
            e = tl.exp(-y)
        return _to_dtype(tl.math.div_rn(y, 1.0 + e), dt).to(tl.float32) * u  # silu rounded, then times up

    @triton.jit
    def _epilogue_apply(y, u, b, bu, r, y_ptrs, mask, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                        SILU_MUL: tl.constexpr, ON_GPU: tl.constexpr):
        """fp32 sums y (gate with SILU_MUL) and u (up; unused otherwise) -> the stored outputs: + bias b (bu for
        up), nn.Linear's rounding, SiLU(gate) x up, + residual r, each rounded where the eager modules round;
        stored at y_ptrs under mask. -> the stored values (the norm handoff sums their squares)."""
        dt = y_ptrs.dtype.element_ty
        if HAS_BIAS:
            y += b
        y = _to_dtype(y, dt).to(tl.float32)  # nn.Linear's output in the dtype
        if SILU_MUL:
            if HAS_BIAS:
                u += bu
            y = _silu_times_up(y, _to_dtype(u, dt).to(tl.float32), dt, ON_GPU)
        if HAS_RES:
            y += r  # the eager add, rounded below
        out = _to_dtype(y, dt)
        tl.store(y_ptrs, out, mask=mask)
        return out

    @triton.jit
    def _epilogue_tile(y, u, n_offs, n_mask, N, b_ptr, r_ptrs, y_ptrs, mask, HAS_BIAS: tl.constexpr,
                       HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr, ON_GPU: tl.constexpr):
        """fp32 sums y (gate with SILU_MUL) and u (up; unused otherwise), [BN] or [rows, BN] -> the stored
        outputs: + bias (columns n_offs, the same for every row), nn.Linear's rounding, SiLU(gate) x up,
        + residual (read at r_ptrs), each rounded where the eager modules round; stored at y_ptrs under mask.
        -> the stored values."""
        b, bu, r = _epilogue_loads(n_offs, n_mask, N, b_ptr, r_ptrs, mask, HAS_BIAS, HAS_RES, SILU_MUL)
        return _epilogue_apply(y, u, b, bu, r, y_ptrs, mask, HAS_BIAS, HAS_RES, SILU_MUL, ON_GPU)

    @triton.jit
    def _epilogue(y, u, n_offs, n_mask, N, b_ptr, r_ptr, y_ptr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                  SILU_MUL: tl.constexpr, ON_GPU: tl.constexpr):
        """`_epilogue_tile` for one row: y and u [BN] at columns n_offs."""
        _epilogue_tile(y, u, n_offs, n_mask, N, b_ptr, r_ptr + n_offs, y_ptr + n_offs, n_mask, HAS_BIAS, HAS_RES,
                       SILU_MUL, ON_GPU)

    @triton.jit
    def _w_tiles(w_ptr, rows, m_rows, k0, K, up_off, UP: tl.constexpr, BLOCK_K: tl.constexpr):
        """K block k0's weight tile at the row offsets `rows` [R, 1] (rows masked by m_rows [R]) and, with UP (the
        two-tile SiLU x up), the up tile up_off elements further on -> (w, wu); wu is w without UP (unused)."""
        k_offs = k0 + tl.arange(0, BLOCK_K)
        mask = m_rows[:, None] & (k_offs < K)[None, :]
        w = tl.load(w_ptr + rows + k_offs[None, :], mask=mask, other=0.0)  # [BN or 2 BN, BK]
        wu = w
        if UP:
            wu = tl.load(w_ptr + rows + up_off + k_offs[None, :], mask=mask, other=0.0)
        return w, wu

    @triton.jit
    def _acc_block(acc, acc_up, w, wu, x_ptr, nw_ptr, k0, K, rstd, dt: tl.constexpr, HAS_NORM: tl.constexpr,
                   UP: tl.constexpr, ON_GPU: tl.constexpr, BLOCK_K: tl.constexpr):
        """The one-row K loop's body for block k0 with its weight tiles already loaded: x's block (normed with
        HAS_NORM) times w into acc, and times wu into acc_up with UP (two-tile SiLU x up) -> (acc, acc_up)."""
        k_offs = k0 + tl.arange(0, BLOCK_K)
        k_mask = k_offs < K
        h = tl.load(x_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32)  # [BK]
        if HAS_NORM:
            h = _norm_h(h, tl.load(nw_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32), rstd, dt, ON_GPU)
        acc += w.to(tl.float32) * h[None, :]
        if UP:
            acc_up += wu.to(tl.float32) * h[None, :]
        return acc, acc_up

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

    @triton.jit
    def _dot_acc(h, w, acc, ON_GPU: tl.constexpr):
        """acc [BM, BN] + h [BM, BK] @ w [BN, BK]^T, fp32 sums. On the GPU 16-bit operands go in as they are (exact
        products, fp32 sums: nn.Linear's numbers) and fp32 ones at IEEE precision, not TF32. The interpreter's dot
        gets both upcast to fp32: a 16-bit product is exact in fp32, so the numbers are the same."""
        if ON_GPU:
            if h.dtype == tl.float32:
                acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(h, tl.trans(w), acc)
        else:
            acc = tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        return acc

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
    _GEMM_KEY = ["N", "K", "HAS_BIAS", "HAS_NORM", "HAS_RES", "SILU_MUL", "M_BUCKET", "NORM_OUT"]

    def _prune(configs, named_args, **kwargs):  # (+ a pinned pick where one ships: kernels/tuned.py)
        silu = kwargs.get("SILU_MUL", named_args.get("SILU_MUL"))
        configs = [c for c in configs if silu or not c.kwargs.get("PAIRED", False)]
        return tuned.narrow("_gemv_fused_kernel", configs, named_args, kwargs, _KEY)

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

    def _gemm_prune(configs, named_args, **kwargs):
        flag = lambda name: kwargs.get(name, named_args.get(name))  # noqa: E731
        split_ok = _split_k_applies(named_args["N"], named_args["K"], flag("HAS_NORM"))
        configs = [c for c in configs if c.kwargs["SPLIT_K"] == 1
                   or split_ok and named_args["K"] >= 2 * c.kwargs["SPLIT_K"] * c.kwargs["BLOCK_K"]]
        return tuned.narrow("_gemm_fused_kernel", configs, named_args, kwargs, _GEMM_KEY)

    if _INTERPRET:  # CPU tests: one small fixed configuration (masks on N and K get exercised)
        _kernel = _gemv_fused_kernel
        _gemm_kernel = _gemm_fused_kernel
    else:
        _kernel = tuned.autotune(_gemv_fused_kernel, _CONFIGS, _KEY, _prune)
        _gemm_kernel = tuned.autotune(_gemm_fused_kernel, _GEMM_CONFIGS, _GEMM_KEY, _gemm_prune)


def _split_k_applies(N: int, K: int, has_norm: bool) -> bool:
    """Whether the M-row kernel's autotuner may try split-K: a long K over few output columns (K >= 2N: the
    1.5B's down_proj, N 1536 / K 8960, has ~100 programs at BLOCK_N 16 for 132 SMs and ran at 1.8x cuBLAS's time),
    and no norm prologue (each split would recompute the full rows' rstd; with fused_decode.PRENORM_ROWS the
    M-row calls get no norm anyway)."""
    return not has_norm and K >= 2 * N


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
        _launch_rows(ptrs, M, out_n, K, weight.stride(0), 0 if residual is None else residual.stride(0), eps,
                     (*norm_args, *ss_args), {**flags, **ss_flags})
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


def _launch_rows(ptrs, M: int, out_n: int, K: int, stride_wn: int, stride_rm: int, eps: float, norm_args: tuple,
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
