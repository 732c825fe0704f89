"""The norm epilogue: a GEMV launch that also writes RMSNorm(its output rows), for the GEMV that reads them next.

Why: in a fused decode / verify layer (models/fused_decode.py) the residual GEMVs (o_proj, down_proj) are followed
by a norm (post-attention; the next layer's input norm, or the final norm) that the next GEMV either recomputes in
every program (the one-row norm prologue: the 12-bit GEMVs streamed 2.5-2.7 TB/s with it on the H200 against
3.8-3.9 without) or gets from an RMSNorm launch of its own (a verify block: two a layer, each ~1.3 us of graphed
launch gap plus its latency). A norm needs the whole output row, which no single program of the GEMV has, so the
programs count themselves in after storing their slice and the one that arrives LAST normalizes the finished rows
(EngineConfig.norm_epilogue).

Protocol (`norm_rows_when_last`, the split-K merge's of kernels/gemm_rows.py): every thread's output stores come
before a CTA barrier; one acq_rel atomic at gpu scope then releases them (and, for the last, acquires everyone
else's); the last program reads the rows with ".cg" loads (L2, never a stale L1 line), normalizes them with
kernels/rmsnorm.py's own `_rmsnorm_row` over one next-power-of-two block of the row (the RMSNorm launch's block, so
the same bits from the same row), stores them and puts the counter back to 0 before the launch ends (so the next
launch, the next layer, a CUDA graph replay find it at 0; nothing is allocated per call). Only programs that
stored output count in: all of them, or with split-K the one merging program of each N tile, so `expected` is the
number of N tiles either way. The counter is one int32 per device shared by every such launch (kernels/scratch.py
says why that is safe on one stream).
"""

from __future__ import annotations

import torch

from specpilot.kernels.rmsnorm import MAX_DIM
from specpilot.kernels.scratch import DeviceBuffers

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.rmsnorm import _rmsnorm_row
except ImportError:  # CPU-only installs: nothing to launch
    triton = None

_COUNTERS = DeviceBuffers("norm epilogue arrival counter", torch.int32)


def check_out_norm(out_norm_weight: torch.Tensor | None, out_n: int, dtype: torch.dtype, what: str) -> None:
    """A norm epilogue's weight must be [output columns], unit stride, in the output's dtype (ValueError)."""
    if out_norm_weight is None:
        return
    if tuple(out_norm_weight.shape) != (out_n,) or (out_norm_weight.stride(0) != 1 and out_n > 1):
        raise ValueError(f"{what}: out_norm_weight must be [{out_n}] (the output's columns) with unit stride, got "
                         f"{tuple(out_norm_weight.shape)} strides {out_norm_weight.stride()}")
    if out_norm_weight.dtype != dtype:
        raise ValueError(f"{what}: out_norm_weight must be {dtype} like the output, got {out_norm_weight.dtype}")
    if out_n > MAX_DIM:
        raise ValueError(f"{what}: a norm epilogue holds a whole row in one program: at most {MAX_DIM} columns, "
                         f"got {out_n}")


def out_norm_args(y: torch.Tensor, out_norm_weight: torch.Tensor | None, out_eps: float):
    """For a launch writing y [M, N]: -> (the normed output [M, N] or None, the kernel's (normed, weight, counter,
    eps) arguments, its NORM_OUT / OUT_P2 constexprs). Without a norm the pointers are dummies (y), never touched."""
    if out_norm_weight is None:
        return None, (y, y, y, 0.0), dict(NORM_OUT=False, OUT_P2=1)
    normed = torch.empty_like(y)
    counter = _COUNTERS.at_least(y.device, 1)
    return normed, (normed, out_norm_weight, counter, float(out_eps)), dict(
        NORM_OUT=True, OUT_P2=triton.next_power_of_2(y.shape[1]))


def counter(device: torch.device) -> torch.Tensor:
    """The device's arrival counter (tests check it is back at 0 after each launch)."""
    return _COUNTERS.at_least(device, 1)


if triton is not None:

    @triton.jit
    def norm_rows_when_last(y_ptr, stride_ym, M, N, w_ptr, eps, out_ptr, stride_om, cnt_ptr, expected,
                            N_P2: tl.constexpr):
        """Call after this program's output stores: count in on cnt_ptr; the `expected`-th arrival writes
        out[m] = RMSNorm(y[m]; w, eps) for rows m < M (N columns) and resets the counter to 0."""
        tl.debug_barrier()  # every thread's output stores before the release below
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == expected - 1:  # the last: every program's slice of every row is published
            cols = tl.arange(0, N_P2)
            valid = cols < N
            w = tl.load(w_ptr + cols, mask=valid, other=0.0)
            for m in range(0, M):
                x = tl.load(y_ptr + m * stride_ym + cols, mask=valid, other=0.0, cache_modifier=".cg")
                out = _rmsnorm_row(x.to(tl.float32), w, N, eps, y_ptr.dtype.element_ty, out_ptr.dtype.element_ty)
                tl.store(out_ptr + m * stride_om + cols, out, mask=valid)
            # every arrival of this launch is in: nothing else touches the counter before the kernel ends
            tl.store(cnt_ptr, 0)
