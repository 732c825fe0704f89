"""A residual add followed by RMSNorm in one Triton launch: (x + y, RMSNorm(x + y)).

Why: in `DecoderLayer.forward` (models/dense.py) each residual add is followed by a norm: `x + attn_out` by the
post-attention norm, `x + mlp_out` by the next layer's input norm (or the final norm after the last layer). Eager
that is 1 add + 8 norm kernels (1 + 1 with kernels/rmsnorm.py); here one launch reads x and y once and writes both
the new residual and the normed row, twice per layer. In a CUDA-graphed decode step each kernel costs >= ~1.1 us.

Numbers: the residual is `x + y` computed in fp32 and rounded to the dtype, exactly the eager add; the norm is
computed from that ROUNDED residual with the same fp32 statistics and rounding order as kernels/rmsnorm.py (so bf16
output equals the eager `RMSNorm`; only the mean's summation order differs: fp32 ~1e-6).

`add_rmsnorm_reference` is the plain-PyTorch twin the tests compare against (TRITON_INTERPRET=1 runs the kernel on
CPU); `add_rmsnorm_op` the kernel as the torch custom op "specpilot::add_rmsnorm" (opaque to torch.compile).
"""

from __future__ import annotations

import torch

from specpilot.kernels.rmsnorm import MAX_DIM, rmsnorm_reference

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.rmsnorm import _rows_view, _to_dtype  # fp32 -> dtype, round to nearest even
except ImportError:  # CPU-only installs: the reference path only
    triton = None

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def add_rmsnorm_reference(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float):
    """Exactly the eager `r = x + y; RMSNorm(r)` -> (r, normed)."""
    r = x + y
    return r, rmsnorm_reference(r, weight, eps)


if triton is not None:

    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, y_ptr, w_ptr, r_ptr, out_ptr, x_row_stride, y_row_stride, N, eps,
                            BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        valid = cols < N
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=valid, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * y_row_stride + cols, mask=valid, other=0.0).to(tl.float32)
        r = _to_dtype(x + y, r_ptr.dtype.element_ty)  # the eager add: fp32 sum rounded once to the dtype
        tl.store(r_ptr + row * N + cols, r, mask=valid)
        r = r.to(tl.float32)  # the norm reads the ROUNDED residual, as eager
        rstd = tl.rsqrt(tl.sum(r * r, axis=0) / N + eps)
        h = _to_dtype(r * rstd, r_ptr.dtype.element_ty)  # rounded to the input dtype first, as RMSNorm
        w = tl.load(w_ptr + cols, mask=valid, other=0.0)
        out = h.to(tl.float32) * w.to(tl.float32)  # exact in fp32 for 16-bit operands: one rounding below
        tl.store(out_ptr + row * N + cols, _to_dtype(out, out_ptr.dtype.element_ty), mask=valid)


def _check(x, y, weight):
    N = x.shape[-1] if x.dim() else 0
    if x.shape != y.shape or weight.shape != (N,) or not 1 <= N <= MAX_DIM:
        raise ValueError(f"add_rmsnorm: unsupported shapes x {tuple(x.shape)}, y {tuple(y.shape)}, "
                         f"weight {tuple(weight.shape)} (x and y one shape [..., N], weight [N], N <= {MAX_DIM})")
    if x.dtype != y.dtype or x.dtype not in DTYPES or weight.dtype not in DTYPES:
        raise ValueError(f"add_rmsnorm: x and y must share one of {DTYPES} (got {x.dtype}, {y.dtype}), "
                         f"weight a float dtype (got {weight.dtype})")


def add_rmsnorm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + y, RMSNorm(x + y)) for x, y [..., N] of one dtype, weight [N] -> (residual contiguous in x's dtype,
    normed contiguous in promote(x, weight)). Rows may be strided as in kernels/rmsnorm.py (else copied first).
    Static shapes, no host sync: safe inside CUDA graphs."""
    if triton is None:
        raise RuntimeError("add_rmsnorm needs triton")
    _check(x, y, weight)
    N = x.shape[-1]
    r = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rows = x.numel() // N
    if rows == 0:
        return r, out
    x2, y2 = _rows_view(x, N), _rows_view(y, N)
    x2 = x2 if x2 is not None else x.contiguous().view(rows, N)
    y2 = y2 if y2 is not None else y.contiguous().view(rows, N)
    w = weight if weight.is_contiguous() else weight.contiguous()
    _add_rmsnorm_kernel[(rows,)](x2, y2, w, r, out, x2.stride(0), y2.stride(0), N, eps,
                                 BLOCK=triton.next_power_of_2(N), num_warps=4 if N <= 2048 else 8)
    return r, out


def _register_op():
    """The kernel as a torch custom op: one opaque call under torch.compile (as kernels/decode_attention.py)."""

    @torch.library.custom_op("specpilot::add_rmsnorm", mutates_args=())
    def add_rmsnorm_op(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rmsnorm(x, y, weight, eps)

    @add_rmsnorm_op.register_fake
    def _(x, y, weight, eps):
        _check(x, y, weight)
        return x.new_empty(x.shape), x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))

    return add_rmsnorm_op


add_rmsnorm_op = _register_op() if triton is not None else None
