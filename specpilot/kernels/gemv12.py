"""One-row GEMV over lossless 12-bit weights (formats/lossless12.py), with gemv_fused's prologue and epilogues.

Why: a bs-1 decode step is bound by the bytes of its weights. Reading 1.5 bytes a weight instead of 2 lowers that
floor by a quarter while every weight stays exactly the bf16 value it was (the format is lossless), so the step
computes what kernels/gemv_fused.py computes from the bf16 matrix, up to the fp32 summation order.

Kernel: as gemv_fused's non-paired loop (each program owns BLOCK_N output rows, accumulates an fp32 [BLOCK_N,
BLOCK_G] tile over K, reduces once), but each K step reads 32-bit words: BLOCK_G code words and BLOCK_G low-byte
words of each row half (4 BLOCK_G column pairs (j, K/2 + j)) and the matching x values, all contiguous. Decoding a
weight = its magnitude byte from the 8-entry table, its sign, its low byte, put together as the bf16 bits:
- on the GPU in inline PTX, four weights per call (byte permutes: one `prmt` looks four magnitudes up in the table
  held in two registers, two more build the four bf16 bit patterns) -- ~2.5-3 instructions a weight beside its FMA;
- in the interpreter (CPU tests) with plain integer ops and a table load, bit-identical.
After the loop the program adds its rows' exceptions (weights the table does not cover, stored exactly beside the
matrix: their codes decode to +0): value * x[col], the norm prologue applied to x[col] as in the loop.
Then the epilogue of gemv_fused (bias, rounding, SiLU x up, residual) -- the same jit helper.

`gemv12_reference` is the plain-PyTorch twin: unpack the matrix exactly, then gemv_fused_reference.
"""

from __future__ import annotations

import os

import torch

from specpilot.formats.lossless12 import Packed12, unpack
from specpilot.kernels import tuned  # autotuning kept on disk
from specpilot.kernels.gemv_fused import _check, gemv_fused_reference
from specpilot.kernels.norm_epilogue import check_out_norm, out_norm_args

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.gemv_parts import _epilogue, _norm_h, _norm_rstd
    from specpilot.kernels.norm_epilogue import norm_rows_when_last
    from specpilot.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options
except ImportError:  # CPU-only installs: the reference path only
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# four weights of one row half from its low-byte word ($4: byte k = weight k's low byte), its code word ($5) and
# the table (two registers $6, $7: magnitude bytes 0-3, 4-7) -> four fp32 values ($0-$3), exact. The code word's
# layout (formats/lossless12.py): the indices in nibbles (first half: nibbles 0-3, second: 4-7) become a byte-permute
# selector with one `and`; the signs sit at the byte tops (first half) or 4 bits below them (second half).
# Operands are whole 32-bit words (pack 1), so which register holds which weight never depends on a tile layout.
_DECODE_PTX = """{{
.reg .b32 s, t, h, p;
{select}
prmt.b32 h, $6, $7, s;
{signs}
and.b32 t, t, 0x80808080;
or.b32 h, h, t;
prmt.b32 p, $4, h, 0x5140;
shl.b32 $0, p, 16;
and.b32 $1, p, 0xFFFF0000;
prmt.b32 p, $4, h, 0x7362;
shl.b32 $2, p, 16;
and.b32 $3, p, 0xFFFF0000;
}}"""
_PTX_FIRST = _DECODE_PTX.format(select="and.b32 s, $5, 0x7777;", signs="mov.b32 t, $5;")
_PTX_SECOND = _DECODE_PTX.format(select="shr.b32 s, $5, 16;\nand.b32 s, s, 0x7777;", signs="shl.b32 t, $5, 4;")
_CONSTRAINTS = "=r,=r,=r,=r,r,r,r,r"  # 4 fp32 outputs; low-byte word, code word, the two table words


def gemv12_reference(x: torch.Tensor, packed: Packed12, bias: torch.Tensor | None = None, *,
                     norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                     residual: torch.Tensor | None = None, act: str | None = None) -> torch.Tensor:
    """The bf16 matrix restored exactly, then gemv_fused_reference (the eager modules' numbers)."""
    return gemv_fused_reference(x, unpack(packed), bias, norm_weight=norm_weight, eps=eps, residual=residual, act=act)


if triton is not None:
    _PTX_FIRST_C, _PTX_SECOND_C, _CONSTRAINTS_C = (tl.constexpr(v) for v in (_PTX_FIRST, _PTX_SECOND, _CONSTRAINTS))

    @triton.jit
    def _decode_one(lw, cw, tab_ptr, k: tl.constexpr, SECOND: tl.constexpr):
        """The interpreter's decode of weight k of each word (plain integer ops, bit-identical to the PTX)."""
        if SECOND:
            idx, sign = (cw >> (16 + 4 * k)) & 7, (cw >> (8 * k + 3)) & 1
        else:
            idx, sign = (cw >> (4 * k)) & 7, (cw >> (8 * k + 7)) & 1
        mag = tl.load(tab_ptr + idx).to(tl.int32)
        return ((sign << 31) | (mag << 24) | (((lw >> (8 * k)) & 255) << 16)).to(tl.float32, bitcast=True)

    @triton.jit
    def _decode(lw, cw, tab_ptr, t0, t1, SECOND: tl.constexpr, ON_GPU: tl.constexpr):
        """int32 low-byte words and code words [BN, BG] of the first (SECOND False) or second row half -> the four
        fp32 weights of each word (weight k: column 4 g + k of that half)."""
        if ON_GPU:
            a = tl.full(lw.shape, t0, tl.int32)
            b = tl.full(lw.shape, t1, tl.int32)
            w0, w1, w2, w3 = tl.inline_asm_elementwise(
                _PTX_SECOND_C if SECOND else _PTX_FIRST_C, _CONSTRAINTS_C, [lw, cw, a, b],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        else:
            w0 = _decode_one(lw, cw, tab_ptr, 0, SECOND)
            w1 = _decode_one(lw, cw, tab_ptr, 1, SECOND)
            w2 = _decode_one(lw, cw, tab_ptr, 2, SECOND)
            w3 = _decode_one(lw, cw, tab_ptr, 3, SECOND)
        return w0, w1, w2, w3

    @triton.jit
    def _x_one(x_ptr, nw_ptr, cols, gm, rstd, dt: tl.constexpr, HAS_NORM: tl.constexpr, ON_GPU: tl.constexpr):
        h = tl.load(x_ptr + cols, mask=gm, other=0.0).to(tl.float32)
        if HAS_NORM:
            h = _norm_h(h, tl.load(nw_ptr + cols, mask=gm, other=0.0).to(tl.float32), rstd, dt, ON_GPU)
        return h

    @triton.jit
    def _x4(x_ptr, nw_ptr, c0, gm, rstd, dt: tl.constexpr, HAS_NORM: tl.constexpr, ON_GPU: tl.constexpr):
        """The (normed) inputs of columns c0 + k, k = 0..3, each [BG].

        Without a norm: four strided loads (L1 hits) in the tile's own column layout. With the norm prologue: one
        [BG, 4] load, normed, split in registers (a shared-memory round trip a K step). Chosen by measurement:
        on the H200 (session 13) each way was the faster one for those GEMVs (no norm: down 1.5B 11.6 -> 8.6 us,
        8B 33.5 -> 25.9 strided; norm: gate_up 1.5B 14.5 split vs 18.9 strided)."""
        if HAS_NORM:
            cols = c0[:, None] + tl.arange(0, 4)[None, :]
            x4 = _x_one(x_ptr, nw_ptr, cols, gm[:, None], rstd, dt, HAS_NORM, ON_GPU)
            even, odd = tl.split(tl.reshape(x4, (x4.shape[0], 2, 2)))  # k = 2 a + b: b = 0 -> k 0, 2; b = 1 -> 1, 3
            x0, x2 = tl.split(even)
            x1, x3 = tl.split(odd)
            return x0, x1, x2, x3
        return (_x_one(x_ptr, nw_ptr, c0, gm, rstd, dt, HAS_NORM, ON_GPU),
                _x_one(x_ptr, nw_ptr, c0 + 1, gm, rstd, dt, HAS_NORM, ON_GPU),
                _x_one(x_ptr, nw_ptr, c0 + 2, gm, rstd, dt, HAS_NORM, ON_GPU),
                _x_one(x_ptr, nw_ptr, c0 + 3, gm, rstd, dt, HAS_NORM, ON_GPU))

    @triton.jit
    def _accumulate(acc, lo_rows, c_rows, g, m, CW, xa, xb, tab_ptr, t0, t1, ON_GPU: tl.constexpr):
        """acc [BN, BG] + the products of one K step: the four weights of word g in each row half times x."""
        cw = tl.load(c_rows + g[None, :], mask=m, other=0)
        wa = _decode(tl.load(lo_rows + g[None, :], mask=m, other=0), cw, tab_ptr, t0, t1, False, ON_GPU)
        wb = _decode(tl.load(lo_rows + CW + g[None, :], mask=m, other=0), cw, tab_ptr, t0, t1, True, ON_GPU)
        a0, a1, a2, a3 = xa
        b0, b1, b2, b3 = xb
        acc += wa[0] * a0[None, :]
        acc += wa[1] * a1[None, :]
        acc += wa[2] * a2[None, :]
        acc += wa[3] * a3[None, :]
        acc += wb[0] * b0[None, :]
        acc += wb[1] * b1[None, :]
        acc += wb[2] * b2[None, :]
        acc += wb[3] * b3[None, :]
        return acc

    @triton.jit
    def _exceptions(y, r0, n_rows, BLOCK_N: tl.constexpr, ep_ptr, ec_ptr, ev_ptr, x_ptr, nw_ptr, rstd,
                    dt: tl.constexpr, HAS_NORM: tl.constexpr, ON_GPU: tl.constexpr, EXC_BLOCK: tl.constexpr):
        """y [BN] (fp32 sums of rows r0 ...) + the exceptions of those rows: value * (normed) x[col]."""
        r = r0 + tl.arange(0, BLOCK_N)
        e_lo = tl.load(ep_ptr + r0)
        e_hi = tl.load(ep_ptr + tl.minimum(r0 + BLOCK_N, n_rows))
        ends = tl.load(ep_ptr + r + 1, mask=r < n_rows, other=2147483647)  # [BN] where each row's list ends
        for e0 in range(e_lo, e_hi, EXC_BLOCK):
            e = e0 + tl.arange(0, EXC_BLOCK)
            em = e < e_hi
            col = tl.load(ec_ptr + e, mask=em, other=0)
            val = tl.load(ev_ptr + e, mask=em, other=0.0)
            h = tl.load(x_ptr + col, mask=em, other=0.0).to(tl.float32)
            if HAS_NORM:
                h = _norm_h(h, tl.load(nw_ptr + col, mask=em, other=0.0).to(tl.float32), rstd, dt, ON_GPU)
            row = tl.sum((ends[None, :] <= e[:, None]).to(tl.int32), axis=1)  # [EB] row within the block
            hit = row[None, :] == tl.arange(0, BLOCK_N)[:, None]  # [BN, EB]
            y += tl.sum(tl.where(hit & em[None, :], (val * h)[None, :], 0.0), axis=1)
        return y

    @triton.jit
    def _gemv12_kernel(x_ptr, lo_ptr, c_ptr, tab_ptr, t0, t1, ep_ptr, ec_ptr, ev_ptr, b_ptr, nw_ptr, r_ptr, y_ptr,
                       N, K, CW, eps, on_ptr, onw_ptr, ocnt_ptr, out_eps,
                       HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr,
                       SILU_MUL: tl.constexpr, ON_GPU: tl.constexpr, K_P2: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, EXC_BLOCK: tl.constexpr,
                       USE_PDL: tl.constexpr = False, NORM_OUT: tl.constexpr = False, OUT_P2: tl.constexpr = 1,
                       PDL_LATE: tl.constexpr = False):
        """y[n] for this program's BLOCK_N columns n < N (N = I with SILU_MUL: gate row n, up row N + n).
        lo_ptr / c_ptr: the planes as int32 words (K / 4 and CW = K / 8 a row); each K step takes BLOCK_G words
        of each half (4 BLOCK_G column pairs). USE_PDL: as gemv_fused's (kernels/pdl.py): nothing is read or
        written before the wait. NORM_OUT: as gemv_fused's (kernels/norm_epilogue.py): the last program to finish
        also writes on = RMSNorm(y; onw, out_eps). PDL_LATE: as gemv_fused's (the trigger after the K loop)."""
        if USE_PDL:
            if not PDL_LATE:
                gdc_launch_dependents()
            gdc_wait()
        dt = y_ptr.dtype.element_ty
        n0 = tl.program_id(0) * BLOCK_N
        n_offs = n0 + tl.arange(0, BLOCK_N)
        n_mask = n_offs < N
        lo_rows = n_offs.to(tl.int64)[:, None] * (2 * CW)  # [BN, 1], in words
        c_rows = n_offs.to(tl.int64)[:, None] * CW
        KH = 4 * CW
        rstd = 0.0
        if HAS_NORM:
            rstd = _norm_rstd(x_ptr, K, eps, K_P2)
        acc = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
        if SILU_MUL:
            acc_up = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
        for g0 in range(0, CW, BLOCK_G):  # words g: columns 4 g + k of the first half, KH + 4 g + k of the second
            g = g0 + tl.arange(0, BLOCK_G)
            gm = g < CW
            xa4 = _x4(x_ptr, nw_ptr, 4 * g, gm, rstd, dt, HAS_NORM, ON_GPU)
            xb4 = _x4(x_ptr, nw_ptr, KH + 4 * g, gm, rstd, dt, HAS_NORM, ON_GPU)
            m = n_mask[:, None] & gm[None, :]
            acc = _accumulate(acc, lo_ptr + lo_rows, c_ptr + c_rows, g, m, CW, xa4, xb4, tab_ptr, t0, t1, ON_GPU)
            if SILU_MUL:  # the up rows N + n
                acc_up = _accumulate(acc_up, lo_ptr + lo_rows + N * 2 * CW, c_ptr + c_rows + N * CW, g, m, CW, xa4,
                                     xb4, tab_ptr, t0, t1, ON_GPU)
        n_rows = 2 * N if SILU_MUL else N
        if USE_PDL and PDL_LATE:
            gdc_launch_dependents()
        y = _exceptions(tl.sum(acc, axis=1), n0, n_rows, BLOCK_N, ep_ptr, ec_ptr, ev_ptr, x_ptr, nw_ptr, rstd, dt,
                        HAS_NORM, ON_GPU, EXC_BLOCK)
        u = y
        if SILU_MUL:
            u = _exceptions(tl.sum(acc_up, axis=1), N + n0, n_rows, BLOCK_N, ep_ptr, ec_ptr, ev_ptr, x_ptr, nw_ptr,
                            rstd, dt, HAS_NORM, ON_GPU, EXC_BLOCK)
        _epilogue(y, u, n_offs, n_mask, N, b_ptr, r_ptr, y_ptr, HAS_BIAS, HAS_RES, SILU_MUL, ON_GPU)
        if NORM_OUT:
            norm_rows_when_last(y_ptr, N, 1, N, onw_ptr, out_eps, on_ptr, N, ocnt_ptr, tl.num_programs(0), OUT_P2)

    # 28 choices (a K step covers 8 BLOCK_G = 2 bj columns: bj = 256 moves as many weights as gemv_fused's 512)
    _CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_G": bj // 4, "EXC_BLOCK": 16}, num_warps=w, num_stages=s)
                for bn, bj in ((2, 256), (4, 128), (4, 256), (8, 128), (8, 256), (16, 128), (32, 64))
                for w in (4, 8) for s in (1, 3)]

    if _INTERPRET:
        _kernel = _gemv12_kernel
    else:
        _kernel = tuned.autotune(_gemv12_kernel, _CONFIGS, ["N", "K", "HAS_BIAS", "HAS_NORM", "HAS_RES", "SILU_MUL",
                                                            "NORM_OUT"])


def gemv12(x: torch.Tensor, packed: Packed12, bias: torch.Tensor | None = None, *,
           norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
           act: str | None = None, out_norm_weight: torch.Tensor | None = None, out_eps: float = 1e-6):
    """gemv_fused over a Packed12 matrix: y = act(RMSNorm(x) @ W^T + bias) (+ residual) for ONE bf16 row.

    Same contract as kernels/gemv_fused.gemv_fused (x [1, K], bias [N], norm_weight [K], residual [1, N], act None
    or "silu_mul" over the fused gate+up matrix; out_norm_weight [N]: the norm epilogue -> (y, RMSNorm(y))), all
    bf16. Static shapes, no host sync: safe in CUDA graphs."""
    if triton is None:
        raise RuntimeError("gemv12 needs triton")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"gemv12: lossless 12-bit weights are bf16, so x must be bf16; got {x.dtype}")
    n, k = packed.shape
    shape_only = torch.empty(n, k, dtype=torch.bfloat16, device="meta")  # the matrix as _check sees it
    K, out_n, act = _check(x, shape_only, bias, norm_weight, residual, act, max_rows=1)
    check_out_norm(out_norm_weight, out_n, x.dtype, "gemv12")
    y = torch.empty(1, out_n, device=x.device, dtype=x.dtype)
    normed, norm_args, norm_flags = out_norm_args(y, out_norm_weight, out_eps)
    t0, t1 = packed.words
    dummy = packed.exc_val
    args = (x, packed.lo.view(torch.int32), packed.codes.view(torch.int32), packed.table, t0, t1, packed.exc_ptr,
            packed.exc_col, packed.exc_val, dummy if bias is None else bias,
            dummy if norm_weight is None else norm_weight, dummy if residual is None else residual, y, out_n, K,
            K // 8, float(eps), *norm_args)
    flags = dict(HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None, HAS_RES=residual is not None,
                 SILU_MUL=act == "silu_mul", ON_GPU=not _INTERPRET,
                 K_P2=triton.next_power_of_2(K) if norm_weight is not None else 1, **norm_flags)
    if _INTERPRET:
        _kernel[(triton.cdiv(out_n, 4),)](*args, **flags, BLOCK_N=4, BLOCK_G=8, EXC_BLOCK=4)
    else:
        pdl = launch_options()  # launch_pdl=True with USE_PDL when the PDL switch is on (kernels/pdl.py)
        _kernel[lambda meta: (triton.cdiv(out_n, meta["BLOCK_N"]),)](*args, **flags, USE_PDL=pdl.use_pdl,
                                                                      PDL_LATE=pdl.late, **pdl.kwargs)
    return y if normed is None else (y, normed)


def _register_op():
    """The kernel as a torch custom op (as gemv_fused's): the Packed12 fields passed one by one."""

    @torch.library.custom_op("specpilot::gemv12", mutates_args=())
    def gemv12_op(x: torch.Tensor, lo: torch.Tensor, codes: torch.Tensor, table: torch.Tensor, t0: int, t1: int,
                  exc_ptr: torch.Tensor, exc_col: torch.Tensor, exc_val: torch.Tensor, bias: torch.Tensor | None,
                  norm_weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None,
                  act: str) -> torch.Tensor:
        packed = Packed12(lo, codes, table, exc_ptr, exc_col, exc_val, (lo.shape[0], lo.shape[1]), (t0, t1))
        return gemv12(x, packed, bias, norm_weight=norm_weight, eps=eps, residual=residual, act=act)

    @gemv12_op.register_fake
    def _(x, lo, codes, table, t0, t1, exc_ptr, exc_col, exc_val, bias, norm_weight, eps, residual, act):
        n = lo.shape[0] // 2 if act == "silu_mul" else lo.shape[0]
        return x.new_empty(1, n)

    @torch.library.custom_op("specpilot::gemv12_normed", mutates_args=())
    def gemv12_normed_op(x: torch.Tensor, lo: torch.Tensor, codes: torch.Tensor, table: torch.Tensor, t0: int,
                         t1: int, exc_ptr: torch.Tensor, exc_col: torch.Tensor, exc_val: torch.Tensor,
                         bias: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
                         residual: torch.Tensor | None, act: str, out_norm_weight: torch.Tensor,
                         out_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """gemv12 with the norm epilogue -> (y, RMSNorm(y))."""
        packed = Packed12(lo, codes, table, exc_ptr, exc_col, exc_val, (lo.shape[0], lo.shape[1]), (t0, t1))
        return gemv12(x, packed, bias, norm_weight=norm_weight, eps=eps, residual=residual, act=act,
                      out_norm_weight=out_norm_weight, out_eps=out_eps)

    @gemv12_normed_op.register_fake
    def _(x, lo, codes, table, t0, t1, exc_ptr, exc_col, exc_val, bias, norm_weight, eps, residual, act,
          out_norm_weight, out_eps):
        n = lo.shape[0] // 2 if act == "silu_mul" else lo.shape[0]
        return x.new_empty(1, n), x.new_empty(1, n)

    return gemv12_op, gemv12_normed_op


gemv12_op, gemv12_normed_op = _register_op() if triton is not None else (None, None)


def gemv12_call(x: torch.Tensor, packed: Packed12, bias, norm_weight, eps: float, residual, act: str,
                out_norm=None):
    """gemv12 through the custom op, in gemv_fused_op's argument order (models/fused_decode.py calls either).
    out_norm: None, or (weight, eps) of the norm epilogue -> (y, RMSNorm(y)) instead of y."""
    t0, t1 = packed.words
    args = (x, packed.lo, packed.codes, packed.table, t0, t1, packed.exc_ptr, packed.exc_col, packed.exc_val, bias,
            norm_weight, eps, residual, act)
    return gemv12_op(*args) if out_norm is None else gemv12_normed_op(*args, *out_norm)
