"""A one-token layer's whole MLP in one launch: post-attention RMSNorm + gate/up GEMV + SiLU(gate) x up + down GEMV
(EngineConfig.fused_mlp). down's sums leave as fp32 atomics into a `pending` row; the next layer's qkv launch
(kernels/qkv_rope.py, PENDING) rounds them and adds the residual as it reads its input.

Why: the fused one-token layer (models/fused_decode.py) is five launches, and its two MLP GEMVs are the largest:
on the H200 at the Qwen2.5-1.5B shape gate/up took 16.4 us for 12.9 us of bytes and down 9.1 us for 6.5 us
(BENCHMARKS.md session 24): each pays a ramp (every program waits a DRAM latency for its first tile), a tail (the
last wave's programs finish alone) and the kernel boundary between them. down cannot start before all of gate/up
is done, because each of its outputs sums over every intermediate column. Split by intermediate columns instead,
each program can do its share of both: the columns' gate and up rows give their SiLU x up values, and the same
columns of down's weight turn those into a partial sum of every output. The partial sums meet in `pending` by
atomic adds, so the MLP is one stream of 82 MB (1.5B) with one ramp and one tail, and the layer four launches.

Measured (H100, session 47, BENCHMARKS.md): exact (argmax equal on every step) but SLOWER, the graphed one-token
step +63% at the 1.5B shape and +86% at Qwen3-8B's, so it stays off. The likely reason: the down tile
[BLOCK_C, H] lives in registers, which caps BLOCK_C at 8 (1.5B) or 4 (8B) columns a block, so gate/up is read
as 8- or 4-row tiles (gemv_fused's one-row kernel reads far wider ones) and each block waits on its own down
rows. A version worth timing again would stage SiLU x up through shared memory instead.

Work split: program p owns a contiguous range of intermediate columns, in blocks of BLOCK_C (balanced to a block
whatever I is; the grid is at most PER_SM programs a multiprocessor). Per block: gate/up's one-row K loop over the
normed input (kernels/gemv_parts.py's helpers: the same norm prologue, the same tiles), SiLU x up rounded where
the eager MLP rounds, then the block's rows of W_down^T [I, H] (a transposed copy of down_proj's weight that
DenseLM.use_fused_mlp keeps: a block's down weights are then BLOCK_C contiguous rows, asked for before the gate/up
loop so their bytes are in flight with gate/up's) folded into the program's fp32 sums of the H outputs. After its
last block the program adds those H sums into `pending` (relaxed atomics; the launch's end orders them for the
next kernel).

Numbers: the eager MLP's up to down's fp32 summation order, as any GEMV's: the norm, gate/up's sums and SiLU x up
are gemv_fused's bit for bit; down's I products per output are summed in fp32 over blocks, then across programs
in the order the atomics land, and rounded once to the dtype by the consumer, which then adds the residual as the
eager add does (fp32 sum of the two dtype values, rounded once). On a GPU that order varies between runs, so a
down output can differ by one ulp from one run to the next (the interpreter adds in program order). `pending`
must be zero before the launch (models/dense.py zeroes every layer's row once a step).

PDL (kernels/pdl.py, as gemv_fused's one-row kernel): USE_PDL waits for o_proj before reading anything; PDL_LATE
lets the next launch start once a program's loops are done.

`fused_mlp_reference` is the plain-PyTorch twin; `fused_mlp_op` the kernel as the torch custom op
"specpilot::fused_mlp", which declares `pending` mutated.
"""

from __future__ import annotations

import functools
import os

import torch

from specpilot.kernels import tuned
from specpilot.kernels.gemv_fused import gemv_fused_reference

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.gemv_parts import _acc_block, _norm_rstd, _silu_times_up, _w_tiles
    from specpilot.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options  # PDL (kernels/pdl.py)
    from specpilot.kernels.rmsnorm import _to_dtype  # fp32 -> dtype, round to nearest even (interpreter too)
except ImportError:  # CPU-only installs: the reference path only
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
INTERPRET_BLOCK_C = 2  # the interpreter's fixed tile (tests): columns a block, and programs in all
INTERPRET_PROGRAMS = 3


def fused_mlp_reference(x, norm_weight, eps, gate_up_weight, down_weight) -> torch.Tensor:
    """The eager MLP in plain PyTorch up to down's sums: RMSNorm, the fused gate/up GEMV with its SiLU x up
    (gemv_fused's reference), then down's fp32 sums -> [1, H] fp32 (not rounded: the consumer rounds)."""
    act = gemv_fused_reference(x, gate_up_weight, None, norm_weight=norm_weight, eps=eps, act="silu_mul")
    return act.float() @ down_weight.float().t()


def settle(residual: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
    """What the consumer of `pending` computes, in plain PyTorch: the residual stream after the MLP, rounded as
    the eager `x + down_proj(...)` is (down's output rounded to the dtype, the two added in fp32, rounded once)."""
    return (residual.float() + pending.to(residual.dtype).float()).to(residual.dtype)


if triton is not None:

    @triton.jit
    def settled_row(x_ptr, pend_ptr, offs, mask, dt: tl.constexpr):
        """The residual after the previous layer's fused MLP at `offs` (fp32 holding dtype values): x + down's
        output, down's fp32 sums in `pending` rounded to the dtype first, the sum rounded once (`settle`)."""
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        d = _to_dtype(tl.load(pend_ptr + offs, mask=mask, other=0.0), dt).to(tl.float32)
        return _to_dtype(x + d, dt).to(tl.float32)

    @triton.jit
    def settled_rstd(x_ptr, pend_ptr, xo_ptr, K, eps, K_P2: tl.constexpr, dt: tl.constexpr):
        """`_norm_rstd` of the settled row (`settled_row`), from one load of it; the consumer's program 0 also
        stores the settled row at xo_ptr: the residual stream the rest of the layer adds to."""
        kk = tl.arange(0, K_P2)
        xk = settled_row(x_ptr, pend_ptr, kk, kk < K, dt)
        first = (kk * 0 + tl.program_id(0)) == 0  # (a tensor: the interpreter rejects scalar & tensor masks)
        tl.store(xo_ptr + kk, xk.to(dt), mask=(kk < K) & first)
        return tl.rsqrt(tl.sum(xk * xk, axis=0) / K + eps)  # as `_norm_rstd`

    @triton.jit
    def _fused_mlp_kernel(x_ptr, nw_ptr, w_ptr, wd_ptr, pend_ptr, I, H, stride_w, stride_wd, eps,
                          ON_GPU: tl.constexpr, H_P2: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                          PER_SM=1, USE_PDL: tl.constexpr = False, PDL_LATE: tl.constexpr = False):
        """pending[:H] += this program's columns' share of down(SiLU(gate) x up) of RMSNorm(x). PER_SM (programs a
        multiprocessor, a tuning choice) only sizes the grid: a plain argument, so it compiles no new variant."""
        if USE_PDL and not PDL_LATE:
            gdc_launch_dependents()
        dt = x_ptr.dtype.element_ty
        pid = tl.program_id(0)
        progs = tl.num_programs(0)
        blocks = tl.cdiv(I, BLOCK_C)
        b_lo = pid * blocks // progs
        b_hi = (pid + 1) * blocks // progs
        if USE_PDL:  # nothing read before it: x is o_proj's output
            gdc_wait()
        rstd = _norm_rstd(x_ptr, H, eps, H_P2)
        hh = tl.arange(0, H_P2)
        h_mask = hh < H
        out = tl.zeros((H_P2,), dtype=tl.float32)
        for b in range(b_lo, b_hi):
            c = b * BLOCK_C + tl.arange(0, BLOCK_C)
            c_mask = c < I
            c64 = c.to(tl.int64)
            wd = tl.load(wd_ptr + c64[:, None] * stride_wd + hh[None, :], mask=c_mask[:, None] & h_mask[None, :],
                         other=0.0)  # [BC, H_P2]: in flight during the gate/up loop
            rows = c64[:, None] * stride_w
            acc = tl.zeros((BLOCK_C, BLOCK_K), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_C, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, H, BLOCK_K):  # gemv_fused's one-row loop, two tiles (gate rows c, up rows I + c)
                w, wu = _w_tiles(w_ptr, rows, c_mask, k0, H, I * stride_w, True, BLOCK_K)
                acc, acc_up = _acc_block(acc, acc_up, w, wu, x_ptr, nw_ptr, k0, H, rstd, dt, True, True, ON_GPU,
                                         BLOCK_K)
            g = _to_dtype(tl.sum(acc, axis=1), dt).to(tl.float32)  # nn.Linear's outputs in the dtype
            u = _to_dtype(tl.sum(acc_up, axis=1), dt).to(tl.float32)
            a = _to_dtype(_silu_times_up(g, u, dt, ON_GPU), dt).to(tl.float32)  # the MLP's activation, rounded
            a = tl.where(c_mask, a, 0.0)
            out += tl.sum(wd.to(tl.float32) * a[:, None], axis=0)
        if USE_PDL and PDL_LATE:  # every weight is in
            gdc_launch_dependents()
        tl.atomic_add(pend_ptr + hh, out, mask=h_mask, sem="relaxed")

    _CONFIGS = [triton.Config({"BLOCK_C": bc, "BLOCK_K": bk, "PER_SM": ps}, num_warps=w, num_stages=1)
                for bc in (2, 4, 8) for bk in (256, 512) for ps in (1, 2, 4) for w in (4, 8)]
    _KEY = ["I", "H"]

    def _prune(configs, named_args, **kwargs):  # the down tile [BLOCK_C, H_P2] in registers: at most 64 values a
        # thread (compiled for sm_90 here, session 45: 128 spilled at H 4096 and took 231-255 registers at 1536)
        h_p2 = kwargs.get("H_P2", named_args.get("H_P2"))
        configs = [c for c in configs if c.kwargs["BLOCK_C"] * h_p2 <= 64 * 32 * c.num_warps] or configs[:1]
        return tuned.narrow("_fused_mlp_kernel", configs, named_args, kwargs, _KEY)

    _kernel = _fused_mlp_kernel if _INTERPRET else tuned.autotune(_fused_mlp_kernel, _CONFIGS, _KEY, _prune,
                                                                 reset_to_zero=["pend_ptr"])


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _problem(x, norm_weight, gate_up_weight, down_t, pending) -> str | None:
    """-> what is wrong with the arguments, or None."""
    if x.dim() != 2 or x.shape[0] != 1 or not x.is_contiguous():
        return f"x must be one contiguous row [1, H], got {tuple(x.shape)}"
    H = x.shape[1]
    if down_t.dim() != 2 or down_t.shape[1] != H or not down_t.is_contiguous():
        return f"down_t must be down_proj's weight transposed, contiguous [I, H = {H}], got {tuple(down_t.shape)}"
    I = down_t.shape[0]
    if tuple(gate_up_weight.shape) != (2 * I, H) or not gate_up_weight.is_contiguous():
        return (f"gate_up_weight must be the contiguous fused [2I, H] = [{2 * I}, {H}], "
                f"got {tuple(gate_up_weight.shape)}")
    if tuple(norm_weight.shape) != (H,) or not norm_weight.is_contiguous():
        return f"norm_weight must be [{H}], got {tuple(norm_weight.shape)}"
    if tuple(pending.shape) != (H,) or pending.dtype != torch.float32 or not pending.is_contiguous():
        return f"pending must be a contiguous fp32 [{H}], got {pending.dtype} {tuple(pending.shape)}"
    dts = {t.dtype for t in (x, norm_weight, gate_up_weight, down_t)}
    if len(dts) != 1:
        return f"x and the weights must share one dtype, got {sorted(map(str, dts))}"
    if len({t.device for t in (x, norm_weight, gate_up_weight, down_t, pending)}) != 1:
        return "every tensor must be on one device"
    return None


def fused_mlp(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor,
              down_t: torch.Tensor, pending: torch.Tensor) -> None:
    """pending [H] fp32 (zero on entry) += down_proj(SiLU(gate) x up of RMSNorm(x)) in fp32, unrounded; x [1, H];
    gate_up_weight the fused [2I, H]; down_t = down_proj.weight.t() contiguous [I, H]. Static shapes, no host
    sync: safe inside CUDA graphs (once autotuned outside capture)."""
    if triton is None:
        raise RuntimeError("fused_mlp needs triton")
    problem = _problem(x, norm_weight, gate_up_weight, down_t, pending)
    if problem:
        raise ValueError(f"fused_mlp: {problem}")
    I, H = down_t.shape
    args = (x, norm_weight, gate_up_weight, down_t, pending, I, H, gate_up_weight.stride(0), down_t.stride(0),
            float(eps))
    pdl = launch_options()
    flags = dict(ON_GPU=not _INTERPRET, H_P2=triton.next_power_of_2(H), USE_PDL=pdl.use_pdl, PDL_LATE=pdl.late,
                 **pdl.kwargs)
    if _INTERPRET:
        blocks = triton.cdiv(I, INTERPRET_BLOCK_C)
        _kernel[(min(blocks, INTERPRET_PROGRAMS),)](*args, **flags, BLOCK_C=INTERPRET_BLOCK_C, BLOCK_K=64)
        return
    sms = _sms(x.device.index or 0)
    _kernel[lambda meta: (min(triton.cdiv(I, meta["BLOCK_C"]), sms * meta["PER_SM"]),)](*args, **flags)


def _register_op():
    @torch.library.custom_op("specpilot::fused_mlp", mutates_args=("pending",))
    def fused_mlp_op(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor,
                     down_t: torch.Tensor, pending: torch.Tensor) -> None:
        fused_mlp(x, norm_weight, eps, gate_up_weight, down_t, pending)

    @fused_mlp_op.register_fake
    def _(x, norm_weight, eps, gate_up_weight, down_t, pending):
        return None

    return fused_mlp_op


fused_mlp_op = _register_op() if triton is not None else None

__all__ = ["fused_mlp", "fused_mlp_op", "fused_mlp_reference", "settle"]
