"""The MLP's `silu(gate) * up` in one Triton launch.

Why: the eager expression (models/dense.py, `MLP.forward`) is 2 kernels (silu, mul; the chunk of the fused gate+up
output into its halves is a pair of free views) once per layer; in a CUDA-graphed decode step each costs >= ~1.1 us
plus its memory traffic (the silu output is written and read back once more).

Numbers: the eager rounding order: silu in fp32, `g / (1 + exp(-g))` as torch's CUDA kernel computes it (IEEE
division, libdevice `expf`, i.e. CUDA's `expf`), rounded to the input dtype, THEN times `up` (the product of two
bf16/fp16 values is exact in fp32, so computing it in fp32 and rounding once equals the eager dtype multiply).
bf16 results are therefore bit-equal to the eager ops; fp32 ones agree to ~1 ulp (exp implementations).

Layout: gate and up are any [..., I] tensors with a unit-stride last dimension whose leading dimensions flatten to
one row stride: in particular the two halves of the fused [..., 2I] gate+up output, read in place (no copy). A 2-D
grid (rows, column blocks), so no limit on I. The output is contiguous [..., I].

`silu_mul_reference` is the plain-PyTorch twin the tests compare against (TRITON_INTERPRET=1 runs the kernel on
CPU); `silu_mul_op` the kernel as the torch custom op "specpilot::silu_mul" (opaque to torch.compile).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from specpilot.kernels.rmsnorm import _rows_view, _to_dtype  # fp32 -> dtype, round to nearest even
except ImportError:  # CPU-only installs: the reference path only
    triton = None

BLOCK = 1024  # columns per program
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Exactly the MLP's eager `F.silu(gate) * up` (models/dense.py)."""
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, g_row_stride, u_row_stride, N, BLOCK: tl.constexpr,
                         LIBDEVICE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = cols < N
        g = tl.load(g_ptr + row * g_row_stride + cols, mask=valid, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * u_row_stride + cols, mask=valid, other=0.0).to(tl.float32)
        # torch's silu: x / (1 + exp(-x)) in fp32 with an IEEE division and CUDA's expf (libdevice), not the
        # approximate ex2/div Triton emits for `tl.exp` and `/`
        if LIBDEVICE:
            e = libdevice.exp(-g)
        else:  # the interpreter has no libdevice: numpy's exp (as accurate as torch's CPU exp)
            e = tl.exp(-g)
        s = tl.math.div_rn(g, 1.0 + e)
        s = _to_dtype(s, out_ptr.dtype.element_ty).to(tl.float32)  # silu's output rounded to the dtype, as eager
        tl.store(out_ptr + row * N + cols, _to_dtype(s * u, out_ptr.dtype.element_ty), mask=valid)


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dim() < 1 or gate.shape[-1] < 1:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} must share one non-empty shape")
    if gate.dtype != up.dtype or gate.dtype not in DTYPES:
        raise ValueError(f"silu_mul: gate and up must share one of {DTYPES}, got {gate.dtype} and {up.dtype}")


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., I] (same shape and dtype) -> contiguous [..., I] of that dtype.

    Rows may be strided (the halves of a fused gate+up output are read in place) as long as the last dimension is
    unit-stride and the leading ones flatten to one row stride, otherwise the input is copied contiguous first.
    Static shapes, no host sync: safe inside CUDA graphs."""
    if triton is None:
        raise RuntimeError("silu_mul needs triton")
    _check(gate, up)
    N = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows = gate.numel() // N
    if rows == 0:
        return out
    g2, u2 = _rows_view(gate, N), _rows_view(up, N)
    g2 = g2 if g2 is not None else gate.contiguous().view(rows, N)
    u2 = u2 if u2 is not None else up.contiguous().view(rows, N)
    block = min(BLOCK, triton.next_power_of_2(N))
    _silu_mul_kernel[(rows, triton.cdiv(N, block))](g2, u2, out, g2.stride(0), u2.stride(0), N, BLOCK=block,
                                                    LIBDEVICE=not _INTERPRETED, num_warps=4)
    return out


def _register_op():
    """The kernel as a torch custom op: one opaque call under torch.compile (as kernels/decode_attention.py)."""

    @torch.library.custom_op("specpilot::silu_mul", mutates_args=())
    def silu_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate, up)

    @silu_mul_op.register_fake
    def _(gate, up):
        _check(gate, up)
        return gate.new_empty(gate.shape)

    return silu_mul_op


silu_mul_op = _register_op() if triton is not None else None
