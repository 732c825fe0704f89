"""Skinny matmul for decode and verification: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M <= 16 tokens.

Why: at bs 1 a decode or verify step is a chain of weight-bound GEMVs, and cuBLAS reaches only ~1.7 TB/s of weights
at 1.5B-class shapes on an H200 whose HBM does ~4.2 TB/s (BENCHMARKS.md).

v1 measured *slower* than cuBLAS everywhere (e.g. 1.5B gate_up M=1: 0.76 vs 1.71 TB/s; M=5: 0.31 vs 1.70). Its inner
loop reduced a 3-D broadcast product `tl.sum(x[:, None, :] * w[None, :, :], axis=2)` every K step (a reduction per
iteration and heavy register pressure), and it capped M at 8, too few for a 16-token block-drafter verify step.

v2 (this file; its speed on the H200 is whatever scripts/gpu_gemv_check.py reports, nothing here is a claim):
- M == 1: each program owns BLOCK_N output rows and accumulates an fp32 [BLOCK_N, BLOCK_K] tile of elementwise
  products over K, reducing it once after the loop. Narrow N (e.g. the 1.5B "down" projection, N = 1536) is served
  by small BLOCK_N (down to 1 row per program) in the tuning list instead of split-K: no atomics, no zero-fill,
  deterministic, one launch.
- 2 <= M <= 16: `tl.dot` on a 16-row tile (rows >= M masked to zero); each [BLOCK_N, BLOCK_K] weight tile is loaded
  once and used for every row. fp32 inputs use IEEE precision (no TF32), so the numbers match the reference
  (the CPU interpreter always takes that fp32 path: its bf16 tl.dot is broken, so CPU tests do not cover bf16 dots).
- Split-K (opt-in, `gemv(..., split_k=S)` / `gemv_split_k`; the dispatch does not use it until a GPU measurement
  says so): the narrow-N shapes where the tl.dot path lost (N <= 2048 gives 48-128 output tiles for 132 SMs) get a
  (cdiv(N, BLOCK_N), S) grid; program (n, s) runs the same tl.dot loop over its K slice (a whole number of BLOCK_K
  blocks) and writes an fp32 partial tile to a workspace [S, M, N] (no atomics, no zero-fill); a second small kernel
  sums the S partials in fixed order (deterministic), adds the bias and casts. S defaults to `choose_split_k`.
- The single-kernel paths store in x's dtype with the bias fused. On a GPU the tile sizes, warps and stages are autotuned once per
  (N, K) (and dtype) outside CUDA-graph capture (the engine warms every step up first); under TRITON_INTERPRET=1
  (CPU tests) one fixed configuration runs.

`gemv_reference` is the plain-PyTorch twin the tests compare against.
"""

from __future__ import annotations

import os

import torch

from specpilot.kernels import tuned  # autotuning kept on disk

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path only
    triton = None

MAX_M = 16
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], weight [N, K] -> [M, N], fp32 accumulation, output in x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


if triton is not None:

    @triton.jit
    def _gemv_m1_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        n_offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n_offs < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_offs = k0 + tl.arange(0, BLOCK_K)
            k_mask = k_offs < K
            x = tl.load(x_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + n_offs[:, None] * stride_wn + k_offs[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)  # one reduction, after the loop
        if HAS_BIAS:
            y += tl.load(b_ptr + n_offs, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + n_offs, y.to(y_ptr.dtype.element_ty), mask=n_mask)

    @triton.jit
    def _gemv_dot_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                         HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        n_offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n_offs < N
        m_offs = tl.arange(0, BLOCK_M)
        m_mask = m_offs < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_offs = k0 + tl.arange(0, BLOCK_K)
            k_mask = k_offs < K
            w = tl.load(w_ptr + n_offs[:, None] * stride_wn + k_offs[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BN, BK], read once for all rows
            x = tl.load(x_ptr + m_offs[:, None] * stride_xm + k_offs[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(w.dtype)  # [BM, BK]
            if IEEE:  # fp32 inputs (and the CPU interpreter, whose bf16 tl.dot returns garbage in Triton 3.x)
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        if HAS_BIAS:
            acc += tl.load(b_ptr + n_offs, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + m_offs[:, None] * stride_ym + n_offs[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _gemv_splitk_kernel(x_ptr, w_ptr, ws_ptr, M, N, K, SPLIT_K, stride_xm, stride_wn,
                            IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (n, s): the fp32 partial of output tile n over K slice s -> ws[s, :M, tile n]."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        blocks_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)  # slices are whole BLOCK_K blocks; the last may
        k_start = pid_k * blocks_per_split * BLOCK_K  # be short or empty (then its partial is zeros)
        k_end = tl.minimum(k_start + blocks_per_split * BLOCK_K, K)
        n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n_offs < N
        m_offs = tl.arange(0, BLOCK_M)
        m_mask = m_offs < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k_offs = k0 + tl.arange(0, BLOCK_K)
            k_mask = k_offs < k_end
            w = tl.load(w_ptr + n_offs[:, None] * stride_wn + k_offs[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptr + m_offs[:, None] * stride_xm + k_offs[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(w.dtype)
            if IEEE:
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        tl.store(ws_ptr + pid_k * M * N + m_offs[:, None] * N + n_offs[None, :], acc,
                 mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _splitk_reduce_kernel(ws_ptr, b_ptr, y_ptr, M, N, SPLIT_K, stride_ym, HAS_BIAS: tl.constexpr,
                              BLOCK: tl.constexpr):
        """y[m, n] = sum over s = 0, 1, ... of ws[s, m, n] (fixed order: bit-reproducible) + bias[n], cast."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(0, SPLIT_K):
            acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
        n = offs % N
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + (offs // N) * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)

    _M1_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                   for bn, bk in ((1, 1024), (2, 512), (2, 1024), (4, 256), (4, 512), (8, 256), (8, 512), (16, 256))
                   for w in (2, 4) for s in (1, 3)]
    _DOT_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                    for bn, bk in ((16, 128), (16, 256), (32, 128), (32, 256), (64, 128))
                    for w in (4,) for s in (2, 3, 4)] + [
                    triton.Config({"BLOCK_N": 16, "BLOCK_K": 512}, num_warps=4, num_stages=2),
                    triton.Config({"BLOCK_N": 32, "BLOCK_K": 128}, num_warps=2, num_stages=4)]
    # split-K: K slices are short, so smaller BLOCK_K too; kept small (autotuned per (N, K, SPLIT_K) key)
    _SPLITK_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=4, num_stages=s)
                       for bn, bk in ((16, 128), (16, 256), (32, 64), (32, 128), (64, 64)) for s in (2, 3)]
    if _INTERPRET:  # CPU tests: one fixed configuration each (small, so masks on N and K get exercised)
        _m1, _dot, _splitk = _gemv_m1_kernel, _gemv_dot_kernel, _gemv_splitk_kernel
    else:
        _m1 = tuned.autotune(_gemv_m1_kernel, _M1_CONFIGS, ["N", "K"])
        _dot = tuned.autotune(_gemv_dot_kernel, _DOT_CONFIGS, ["N", "K"])
        _splitk = tuned.autotune(_gemv_splitk_kernel, _SPLITK_CONFIGS, ["N", "K", "SPLIT_K"])


_H200_SMS = 132
_SPLITK_TILE_N = 32  # nominal BLOCK_N for the split choice (the autotuner picks 16-64)
_SPLITK_MIN_SLICE = 256  # K per split at least this (shorter slices are all prologue)
MAX_SPLIT_K = 16


def sm_count(device: torch.device | None = None) -> int:
    """Streaming multiprocessors of `device` (a CUDA device), else the H200's 132."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _H200_SMS


def choose_split_k(n: int, k: int, sms: int = _H200_SMS) -> int:
    """SPLIT_K for the split-K path: enough K slices that output tiles x slices >= ~2 x SMs, each slice at least
    _SPLITK_MIN_SLICE long, at most MAX_SPLIT_K (1.5B down 1536x8960 -> 6, 0.5B down 896x4864 -> 10,
    1.5B qkv 2048x1536 -> 5 on an H200). 1 = no split."""
    tiles = -(-n // _SPLITK_TILE_N)
    want = -(-2 * sms // tiles)
    return max(1, min(want, k // _SPLITK_MIN_SLICE, MAX_SPLIT_K))


def _check(x, weight, bias):
    """Validate shapes/strides (ValueError); the bias made contiguous."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    if x.dim() != 2 or weight.dim() != 2 or (bias is not None and bias.shape != (weight.shape[0],)):
        raise ValueError(f"gemv: need x [M, K], weight [N, K], bias [N]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {None if bias is None else tuple(bias.shape)}")
    M, K = x.shape
    N, K2 = weight.shape
    if K != K2 or not 1 <= M <= MAX_M or not weight.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"gemv: need x [1<=M<={MAX_M}, K] with unit stride and contiguous weight [N, K]; "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    return x, weight, bias


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (1 <= M <= 16, unit stride along K), weight [N, K] contiguous -> [M, N] in x's dtype.

    split_k None: the single-launch kernels (M == 1: the GEMV kernel, else tl.dot); an int >= 2: the split-K tl.dot
    path with that many K slices (any M; `gemv_split_k`); 1: the same as None."""
    if split_k is not None and split_k >= 2:
        return gemv_split_k(x, weight, bias, split_k)
    x, weight, bias = _check(x, weight, bias)
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    b = bias if bias is not None else weight  # dummy pointer when HAS_BIAS is off
    if M == 1:
        args = (x, weight, b, y, N, K, weight.stride(0))
        if _INTERPRET:
            _m1[(triton.cdiv(N, 4),)](*args, HAS_BIAS=bias is not None, BLOCK_N=4, BLOCK_K=64)
        else:
            _m1[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](*args, HAS_BIAS=bias is not None)
        return y
    ieee = _INTERPRET or torch.float32 in (x.dtype, weight.dtype)
    args = (x, weight, b, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0))
    if _INTERPRET:
        _dot[(triton.cdiv(N, 16),)](*args, HAS_BIAS=bias is not None, IEEE=ieee, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32)
    else:
        _dot[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](*args, HAS_BIAS=bias is not None, IEEE=ieee,
                                                              BLOCK_M=16)
    return y


def gemv_split_k(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 split_k: int | None = None) -> torch.Tensor:
    """`gemv` through the split-K tl.dot path: grid (cdiv(N, BLOCK_N), split_k), fp32 partials in a workspace
    [split_k, M, N], summed in fixed order by a second launch (deterministic: no atomics). split_k None:
    `choose_split_k(N, K, SMs)`. Same shapes as `gemv` (1 <= M <= 16)."""
    x, weight, bias = _check(x, weight, bias)
    M, K = x.shape
    N = weight.shape[0]
    if split_k is None:
        split_k = choose_split_k(N, K, sm_count(x.device))
    if not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"gemv_split_k: split_k must be an int >= 1, got {split_k!r}")
    ws = torch.empty(split_k, M, N, device=x.device, dtype=torch.float32)  # every element written: no zero-fill
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    ieee = _INTERPRET or torch.float32 in (x.dtype, weight.dtype)
    args = (x, weight, ws, M, N, K, split_k, x.stride(0), weight.stride(0))
    if _INTERPRET:
        _splitk[(triton.cdiv(N, 16), split_k)](*args, IEEE=ieee, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32)
    else:
        _splitk[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), split_k)](*args, IEEE=ieee, BLOCK_M=16)
    block = 256 if _INTERPRET else 1024
    _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](ws, bias if bias is not None else ws, y, M, N, split_k,
                                                       y.stride(0), HAS_BIAS=bias is not None, BLOCK=block)
    return y


def _register_op():
    """Expose the kernel as a torch custom op so torch.compile treats it as one opaque call (no graph break)."""

    @torch.library.custom_op("specpilot::gemv", mutates_args=())
    def gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return gemv(x, weight, bias)

    @gemv_op.register_fake
    def _(x, weight, bias):
        return x.new_empty(x.shape[0], weight.shape[0])

    return gemv_op


gemv_op = _register_op() if triton is not None else None


# Below this many outputs the tl.dot path (2 <= M <= 16) has too few output tiles to fill an H200 and loses to
# cuBLAS (1.5B qkv 2048 x 1536 and down 1536 x 8960 at M = 16: 1.29 / 1.48 vs 1.37 / 2.28 TB/s); from 4096 up it
# won at every measured shape; M = 1 won at every shape (BENCHMARKS.md, session 11).
MIN_N_MULTI = 4096


def uses_kernel(tokens: int, n: int) -> bool:
    """Whether a projection of `tokens` rows and `n` outputs goes through the Triton GEMV (the measured wins)."""
    return tokens == 1 or (2 <= tokens <= MAX_M and n >= MIN_N_MULTI)


class SkinnyLinear(torch.nn.Linear):
    """nn.Linear that routes few-token inputs to the Triton GEMV where it measured faster than cuBLAS
    (`uses_kernel`; same parameters, same numbers up to fp32 rounding order); the rest (prefill, narrow
    multi-token projections) keep the library GEMM."""

    force_kernel = False  # tests: use the kernel on CPU too (interpreted)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        tokens = x.numel() // x.shape[-1]
        if gemv_op is None or not uses_kernel(tokens, self.out_features) or not (x.is_cuda or self.force_kernel):
            return super().forward(x)
        return gemv_op(x.reshape(tokens, x.shape[-1]), self.weight, self.bias).reshape(*lead, -1)
