"""One-row GEMV over lossless 12-bit weights (formats/lossless12.py), with gemv_fused's prologue and epilogues.

Why: a bs-1 decode step is bound by the bytes of its weights. Reading 1.5 bytes a weight instead of 2 lowers that
floor by a quarter while every weight stays exactly the bf16 value it was (the format is lossless), so the step
computes what kernels/gemv_fused.py computes from the bf16 matrix, up to the fp32 summation order.

Kernel: as gemv_fused's non-paired loop (each program owns BLOCK_N output rows, accumulates an fp32 [BLOCK_N,
BLOCK_J] tile over K, reduces once), but each K step covers the column pairs (j, K/2 + j) of BLOCK_J positions:
BLOCK_J code bytes, the two halves' BLOCK_J low bytes and x values, all contiguous loads. Decoding a weight = its
magnitude byte from the 8-entry table, its sign, its low byte, put together as the bf16 bits:
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
from specpilot.kernels.gemv_fused import _check, gemv_fused_reference

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.gemv_fused import _epilogue, _norm_h, _norm_rstd
except ImportError:  # CPU-only installs: the reference path only
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# four weights of one row half from one code word ($5: four code bytes), one low-byte register ($4: byte k = weight
# k) and the table (two registers: magnitude bytes 0-3, 4-7) -> four fp32 values, exact. The word's layout
# (formats/lossless12.py): the indices in nibbles (first half: nibbles 0-3, second: 4-7) become a byte-permute
# selector with one `and`; the signs sit at the byte tops (first half) or 4 bits below them (second half).
_DECODE_PTX = """{{
.reg .b32 s, t, h, p;
{select}
prmt.b32 h, $6, $10, s;
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
_CONSTRAINTS = "=r,=r,=r,=r,r,r" + ",r" * 8  # 4 outputs; low bytes, codes (4 a register); the two table words x4


def gemv12_reference(x: torch.Tensor, packed: Packed12, bias: torch.Tensor | None = None, *,
                     norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                     residual: torch.Tensor | None = None, act: str | None = None) -> torch.Tensor:
    """The bf16 matrix restored exactly, then gemv_fused_reference (the eager modules' numbers)."""
    return gemv_fused_reference(x, unpack(packed), bias, norm_weight=norm_weight, eps=eps, residual=residual, act=act)


if triton is not None:
    _PTX_FIRST_C, _PTX_SECOND_C, _CONSTRAINTS_C = (tl.constexpr(v) for v in (_PTX_FIRST, _PTX_SECOND, _CONSTRAINTS))

    @triton.jit
    def _decode(lo, code, c_word, tab_ptr, t0, t1, SECOND: tl.constexpr, ON_GPU: tl.constexpr):
        """uint8 low bytes [BN, BJ] of the first (SECOND False) or second row half and the code bytes [BN, BJ]
        -> the fp32 weights. The interpreter reads each element's whole code word (c_word, int32; the GPU's asm
        gets it as the four code bytes of one register)."""
        if ON_GPU:
            a = tl.full(lo.shape, t0, tl.int32)
            b = tl.full(lo.shape, t1, tl.int32)
            w = tl.inline_asm_elementwise(_PTX_SECOND_C if SECOND else _PTX_FIRST_C, _CONSTRAINTS_C,
                                          [lo, code, a, b], dtype=tl.float32, is_pure=True, pack=4)
        else:
            k = tl.arange(0, lo.shape[1])[None, :] % 4  # the element's place in its word
            if SECOND:
                idx, sign = (c_word >> (16 + 4 * k)) & 7, (c_word >> (8 * k + 3)) & 1
            else:
                idx, sign = (c_word >> (4 * k)) & 7, (c_word >> (8 * k + 7)) & 1
            mag = tl.load(tab_ptr + idx).to(tl.int32)
            bits = (sign << 31) | (mag << 24) | (lo.to(tl.int32) << 16)
            w = bits.to(tl.float32, bitcast=True)
        return w

    @triton.jit
    def _accumulate(acc, lo_rows, c_rows, j, m, KH, ha, hb, tab_ptr, t0, t1, ON_GPU: tl.constexpr):
        """acc [BN, BJ] + the products of one K step: weights (j, KH + j) of each row times ha, hb."""
        code = tl.load(c_rows + j[None, :], mask=m, other=0)
        c_word = 0
        if not ON_GPU:  # the interpreter decodes element by element: give each its whole 32-bit word
            w0 = c_rows + (j - j % 4)[None, :]
            c_word = (tl.load(w0, mask=m, other=0).to(tl.int32) | (tl.load(w0 + 1, mask=m, other=0).to(tl.int32) << 8)
                      | (tl.load(w0 + 2, mask=m, other=0).to(tl.int32) << 16)
                      | (tl.load(w0 + 3, mask=m, other=0).to(tl.int32) << 24))
        wa = _decode(tl.load(lo_rows + j[None, :], mask=m, other=0), code, c_word, tab_ptr, t0, t1, False, ON_GPU)
        wb = _decode(tl.load(lo_rows + KH + j[None, :], mask=m, other=0), code, c_word, tab_ptr, t0, t1, True,
                     ON_GPU)
        acc += wa * ha[None, :]
        acc += wb * hb[None, :]
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
                       N, K, KH, eps,
                       HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr,
                       SILU_MUL: tl.constexpr, ON_GPU: tl.constexpr, K_P2: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, EXC_BLOCK: tl.constexpr):
        """y[n] for this program's BLOCK_N columns n < N (N = I with SILU_MUL: gate row n, up row N + n)."""
        dt = y_ptr.dtype.element_ty
        n0 = tl.program_id(0) * BLOCK_N
        n_offs = n0 + tl.arange(0, BLOCK_N)
        n_mask = n_offs < N
        lo_rows = n_offs.to(tl.int64)[:, None] * K  # [BN, 1]
        c_rows = n_offs.to(tl.int64)[:, None] * KH
        rstd = 0.0
        if HAS_NORM:
            rstd = _norm_rstd(x_ptr, K, eps, K_P2)
        acc = tl.zeros((BLOCK_N, BLOCK_J), dtype=tl.float32)
        if SILU_MUL:
            acc_up = tl.zeros((BLOCK_N, BLOCK_J), dtype=tl.float32)
        for j0 in range(0, KH, BLOCK_J):  # column pairs (j, KH + j): the two halves of the row
            j = j0 + tl.arange(0, BLOCK_J)
            jm = j < KH
            ha = tl.load(x_ptr + j, mask=jm, other=0.0).to(tl.float32)
            hb = tl.load(x_ptr + KH + j, mask=jm, other=0.0).to(tl.float32)
            if HAS_NORM:
                ha = _norm_h(ha, tl.load(nw_ptr + j, mask=jm, other=0.0).to(tl.float32), rstd, dt, ON_GPU)
                hb = _norm_h(hb, tl.load(nw_ptr + KH + j, mask=jm, other=0.0).to(tl.float32), rstd, dt, ON_GPU)
            m = n_mask[:, None] & jm[None, :]
            acc = _accumulate(acc, lo_ptr + lo_rows, c_ptr + c_rows, j, m, KH, ha, hb, tab_ptr, t0, t1, ON_GPU)
            if SILU_MUL:  # the up rows N + n
                acc_up = _accumulate(acc_up, lo_ptr + lo_rows + N * K, c_ptr + c_rows + N * KH, j, m, KH, ha, hb,
                                     tab_ptr, t0, t1, ON_GPU)
        n_rows = 2 * N if SILU_MUL else N
        y = _exceptions(tl.sum(acc, axis=1), n0, n_rows, BLOCK_N, ep_ptr, ec_ptr, ev_ptr, x_ptr, nw_ptr, rstd, dt,
                        HAS_NORM, ON_GPU, EXC_BLOCK)
        u = y
        if SILU_MUL:
            u = _exceptions(tl.sum(acc_up, axis=1), N + n0, n_rows, BLOCK_N, ep_ptr, ec_ptr, ev_ptr, x_ptr, nw_ptr,
                            rstd, dt, HAS_NORM, ON_GPU, EXC_BLOCK)
        _epilogue(y, u, n_offs, n_mask, N, b_ptr, r_ptr, y_ptr, HAS_BIAS, HAS_RES, SILU_MUL, ON_GPU)

    # 28 choices (each K step reads 2 BLOCK_J columns: BLOCK_J = 256 moves as many weights as gemv_fused's 512)
    _CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_J": bj, "EXC_BLOCK": 16}, num_warps=w, num_stages=s)
                for bn, bj in ((2, 256), (4, 128), (4, 256), (8, 128), (8, 256), (16, 128), (32, 64))
                for w in (4, 8) for s in (1, 3)]

    if _INTERPRET:
        _kernel = _gemv12_kernel
    else:
        _kernel = triton.autotune(configs=_CONFIGS, key=["N", "K", "HAS_BIAS", "HAS_NORM", "HAS_RES", "SILU_MUL"])(
            _gemv12_kernel)


def gemv12(x: torch.Tensor, packed: Packed12, bias: torch.Tensor | None = None, *,
           norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
           act: str | None = None) -> torch.Tensor:
    """gemv_fused over a Packed12 matrix: y = act(RMSNorm(x) @ W^T + bias) (+ residual) for ONE bf16 row.

    Same contract as kernels/gemv_fused.gemv_fused (x [1, K], bias [N], norm_weight [K], residual [1, N], act None
    or "silu_mul" over the fused gate+up matrix), all bf16. Static shapes, no host sync: safe in CUDA graphs."""
    if triton is None:
        raise RuntimeError("gemv12 needs triton")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"gemv12: lossless 12-bit weights are bf16, so x must be bf16; got {x.dtype}")
    n, k = packed.shape
    shape_only = torch.empty(n, k, dtype=torch.bfloat16, device="meta")  # the matrix as _check sees it
    K, out_n, act = _check(x, shape_only, bias, norm_weight, residual, act)
    y = torch.empty(1, out_n, device=x.device, dtype=x.dtype)
    t0, t1 = packed.words
    dummy = packed.exc_val
    args = (x, packed.lo, packed.codes, packed.table, t0, t1, packed.exc_ptr, packed.exc_col, packed.exc_val,
            dummy if bias is None else bias, dummy if norm_weight is None else norm_weight,
            dummy if residual is None else residual, y, out_n, K, K // 2, float(eps))
    flags = dict(HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None, HAS_RES=residual is not None,
                 SILU_MUL=act == "silu_mul", ON_GPU=not _INTERPRET,
                 K_P2=triton.next_power_of_2(K) if norm_weight is not None else 1)
    if _INTERPRET:
        _kernel[(triton.cdiv(out_n, 4),)](*args, **flags, BLOCK_N=4, BLOCK_J=32, EXC_BLOCK=4)
    else:
        _kernel[lambda meta: (triton.cdiv(out_n, meta["BLOCK_N"]),)](*args, **flags)
    return y


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

    return gemv12_op


gemv12_op = _register_op() if triton is not None else None


def gemv12_call(x: torch.Tensor, packed: Packed12, bias, norm_weight, eps: float, residual, act: str) -> torch.Tensor:
    """gemv12 through the custom op, in gemv_fused_op's argument order (models/fused_decode.py calls either)."""
    t0, t1 = packed.words
    return gemv12_op(x, packed.lo, packed.codes, packed.table, t0, t1, packed.exc_ptr, packed.exc_col,
                     packed.exc_val, bias, norm_weight, eps, residual, act)
