"""RMSNorm over the last dimension in one Triton launch (one program per row).

Why: the eager `RMSNorm` (models/dense.py) is 8 small kernels (to fp32, pow, mean, +eps, rsqrt, mul, to dtype,
*weight); in a CUDA-graphed decode step each costs >= ~1.1 us plus its memory traffic, twice per layer (four
times with Qwen3's q/k norms) and once more for the final norm.

Numbers: the same rounding order as the eager module: the row in fp32, `x * rsqrt(mean(x^2) + eps)`, cast to the
input dtype, THEN multiplied by the weight (the product of two bf16/fp16 values is exact in fp32, so computing it
in fp32 and rounding once equals the eager dtype multiply). The output dtype is torch's promotion of the input's
and the weight's (a bf16 input with an fp32 weight gives fp32, as eager). Only the mean's summation order differs
(a tree in the kernel), so fp32 results agree to ~1e-6 and bf16 ones to within 1 ulp.

`rmsnorm_reference` is the plain-PyTorch twin the tests compare against (TRITON_INTERPRET=1 runs the kernel on
CPU). `rmsnorm_op` is the kernel as the torch custom op "specpilot::rmsnorm" (opaque to torch.compile).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options  # PDL (kernels/pdl.py)
except ImportError:  # CPU-only installs: the reference path only
    triton = None

MAX_DIM = 16384  # one row per program, held in registers in one block
# Launched with programmatic dependent launch where PDL is on (EngineConfig.norm_pdl): the kernel lets the next one
# launch first thing, then waits for the one ahead before it reads anything (kernels/pdl.py's rule). Why: a fused
# verify block's two RMSNorm launches a layer (models/fused_decode.py PRENORM_ROWS) were the only launches of its
# chain without PDL besides the attention pair, so each was a full kernel boundary: on an H100 (session 50) the
# 1.5B's 16-token step had 406 us of gaps between its kernels against 42 us for the one-token step. The M-row GEMM
# after a norm then launches while the norm runs and loads its first weight tile before its own wait. Same numbers
# (nothing but the launch changes). Off until a GPU times it; the loop searches it.
PDL = False


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Exactly `RMSNorm.forward` (models/dense.py)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


if triton is not None:

    @triton.jit
    def _to_dtype(v, dtype: tl.constexpr):
        """fp32 v rounded to `dtype` to nearest even. bf16 by hand: the CPU interpreter truncates fp32 -> bf16 (the
        GPU's cvt rounds to nearest even, which is what this computes, so both give torch's numbers)."""
        if dtype == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            v = tl.where(v != v, v, bits.to(tl.float32, bitcast=True))  # NaN kept as is
        return v.to(dtype)

    @triton.jit
    def _rmsnorm_row(x, w, N, eps, x_dtype: tl.constexpr, out_dtype: tl.constexpr):
        """RMSNorm.forward of one row: x in fp32 [BLOCK] (lanes >= N zero), w the weight [BLOCK] -> the row in
        out_dtype. One definition of the numbers for this kernel and for gemv_fused's norm epilogue
        (kernels/norm_epilogue.py), so both give the same bits from the same row in the same block size."""
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)  # as torch.rsqrt (the mean's sum is a tree here)
        y = _to_dtype(x * rstd, x_dtype)  # rounded to the input dtype first, as the eager module
        out = y.to(tl.float32) * w.to(tl.float32)  # exact in fp32 for 16-bit operands: one rounding below
        return _to_dtype(out, out_dtype)

    @triton.jit
    def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, x_row_stride, x_head_stride, HEADS, N, eps, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
        # row r of x is (r // HEADS, r % HEADS) of a [rows / HEADS, HEADS, N] view: HEADS = 1 for one row stride
        if USE_PDL:  # (launched with PDL: the next kernel may launch now; nothing is read before the wait)
            gdc_launch_dependents()
            gdc_wait()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        valid = cols < N
        x = tl.load(x_ptr + (row // HEADS) * x_row_stride + (row % HEADS) * x_head_stride + cols, mask=valid,
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=valid, other=0.0)
        out = _rmsnorm_row(x, w, N, eps, x_ptr.dtype.element_ty, out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * N + cols, out, mask=valid)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., N] with weight [N] -> same shape, contiguous, dtype promote(x, weight).

    Any leading shape; rows may be strided as long as the last dimension is unit-stride and the leading ones
    flatten to one row stride, or to two: [rows / heads, heads, N], e.g. q [B, T, H, D] of a fused qkv output,
    read in place (a copy would be one more launch than the unfused projections' contiguous q); otherwise x is
    copied contiguous first.
    Static shapes, no host sync: safe inside CUDA graphs."""
    if triton is None:
        raise RuntimeError("rmsnorm needs triton")
    N = x.shape[-1]
    if weight.shape != (N,) or N > MAX_DIM or N < 1:
        raise ValueError(f"rmsnorm: unsupported shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rows = x.numel() // N if N else 0
    if rows == 0:
        return out
    x2 = _rows_view(x, N)
    if x2 is None:
        x2 = _head_rows_view(x, N)
    if x2 is None:
        x2 = x.contiguous().view(rows, N)
    if x2.dim() == 2:
        x2 = x2[:, None]
    w = weight if weight.is_contiguous() else weight.contiguous()
    pdl = launch_options()
    extra = {"USE_PDL": True, **pdl.kwargs} if PDL and pdl.use_pdl else {}  # (both the switch and PDL on)
    _rmsnorm_kernel[(rows,)](x2, w, out, x2.stride(0), x2.stride(1), x2.shape[1], N, eps,
                             BLOCK=triton.next_power_of_2(N), num_warps=4 if N <= 2048 else 8, **extra)
    return out


def _rows_view(x: torch.Tensor, N: int) -> torch.Tensor | None:
    """x as a [rows, N] view with unit stride along N, or None when no such view exists without a copy."""
    if x.stride(-1) != 1 and N > 1:
        return None
    try:
        return x.view(-1, N)
    except RuntimeError:  # the leading dims do not flatten to one stride
        return None


def _head_rows_view(x: torch.Tensor, N: int) -> torch.Tensor | None:
    """x as a [rows / heads, heads, N] view (heads = x.shape[-2]) with unit stride along N, or None."""
    if x.dim() < 3 or (x.stride(-1) != 1 and N > 1):
        return None
    try:
        return x.view(-1, x.shape[-2], N)
    except RuntimeError:
        return None


def _register_op():
    """The kernel as a torch custom op, so torch.compile treats it as one opaque call (see decode_attention.py for
    why: Inductor re-compiling user Triton kernels failed on the H200)."""

    @torch.library.custom_op("specpilot::rmsnorm", mutates_args=())
    def rmsnorm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rmsnorm(x, weight, eps)

    @rmsnorm_op.register_fake
    def _(x, weight, eps):
        return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))

    return rmsnorm_op


rmsnorm_op = _register_op() if triton is not None else None
