"""Skinny matmul for decode and verification: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M <= 8 tokens.

Why: at bs 1 a decode step is a chain of GEMVs, and cuBLAS reaches only ~1.7 TB/s of weights at 1.5B-class shapes
on an H200 (40% of the copy bandwidth, BENCHMARKS.md). Here each program streams a [BLOCK_N, K] slab of W once with
wide loads and reuses it for all M rows; split-K adds programs when N alone cannot fill the GPU, combining the
partial sums with fp32 atomics into a zeroed fp32 output (order of additions may vary between runs: results are
within fp32 rounding, not bitwise fixed — fine for a drafter, which never changes outputs; the target keeps the
deterministic path unless `EngineConfig.gemv_kernel` asks otherwise).

v1 (split-K into a zeroed fp32 buffer, then a cast) measured *slower* than cuBLAS on the H200 (0.09 vs 0.23 TB/s
at the 1.5B qkv shape: too few programs, plus two extra launches per call). So when N alone gives enough output
tiles (N >= 8 x SMs: every 1.5B/8B projection), `gemv_direct` runs instead: one launch, output in the input
dtype with the bias fused, and its tile sizes and warps autotuned per shape on the GPU. Split-K stays for narrow N.

`gemv_reference` is the plain-PyTorch twin the tests compare against (TRITON_INTERPRET=1 runs the kernel on CPU).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path only
    triton = None

MAX_M = 8


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], weight [N, K] -> [M, N], fp32 accumulation, output in x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n_offs < N
        k_start = pid_k * k_per_split
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        m_offs = tl.arange(0, BLOCK_M)
        for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
            k_offs = k0 + tl.arange(0, BLOCK_K)
            k_mask = k_offs < K
            w = tl.load(w_ptr + n_offs[:, None] * stride_wn + k_offs[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)  # [BN, BK]
            x = tl.load(x_ptr + m_offs[:, None] * stride_xm + k_offs[None, :],
                        mask=(m_offs[:, None] < M) & k_mask[None, :], other=0.0).to(tl.float32)  # [BM, BK]
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)  # [BM, BN]
        ptrs = y_ptr + m_offs[:, None] * stride_ym + n_offs[None, :]
        mask = (m_offs[:, None] < M) & n_mask[None, :]
        if SPLIT == 1:
            tl.store(ptrs, acc, mask=mask)
        else:
            tl.atomic_add(ptrs, acc, mask=mask)


    @triton.jit
    def _gemv_direct_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        # one program: BLOCK_N outputs for all M rows over the whole K; stores in y's dtype, bias fused (one
        # launch per projection: at decode, launches and zero-fills cost as much as small weight reads)
        pid_n = tl.program_id(0)
        n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n_offs < N
        m_offs = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_offs = k0 + tl.arange(0, BLOCK_K)
            k_mask = k_offs < K
            w = tl.load(w_ptr + n_offs[:, None] * stride_wn + k_offs[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_ptr + m_offs[:, None] * stride_xm + k_offs[None, :],
                        mask=(m_offs[:, None] < M) & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n_offs, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        ptrs = y_ptr + m_offs[:, None] * stride_ym + n_offs[None, :]
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=(m_offs[:, None] < M) & n_mask[None, :])

    # On a GPU the direct kernel's tile sizes are chosen by timing, once per (M, N, K) (outside any CUDA-graph
    # capture: the engine warms every step up first); the CPU interpreter runs one fixed configuration.
    _DIRECT_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
                       for bn in (4, 8, 16, 32) for bk in (128, 256, 512) for w in (2, 4, 8)
                       if bn * bk <= 8192]
    if os.environ.get("TRITON_INTERPRET") == "1":
        _gemv_direct = None
    else:
        _gemv_direct = triton.autotune(configs=_DIRECT_CONFIGS, key=["M", "N", "K"])(_gemv_direct_kernel)


def gemv_direct(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The single-pass kernel (no split-K): x [M, K] (M <= 8), weight [N, K] contiguous -> [M, N] in x's dtype."""
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    bm = 1 if M == 1 else (2 if M == 2 else (4 if M <= 4 else 8))
    args = (x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0))
    if _gemv_direct is None:  # interpreter: a fixed configuration
        _gemv_direct_kernel[(triton.cdiv(N, 16),)](*args, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=16,
                                                   BLOCK_K=128)
    else:
        _gemv_direct[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](*args, HAS_BIAS=bias is not None, BLOCK_M=bm)
    return y


def _blocks(M: int, N: int, K: int, num_sms: int) -> tuple[int, int, int, int]:
    block_m = 1 if M == 1 else (2 if M == 2 else (4 if M <= 4 else 8))
    block_n = 16 if block_m <= 2 else 8
    block_k = 512 if block_m <= 2 else 256
    tiles = triton.cdiv(N, block_n)
    split = 1
    while tiles * split < 2 * num_sms and K // (split * 2) >= 4 * block_k:  # fill every SM at least twice
        split *= 2
    return block_m, block_n, block_k, split


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= 8), weight [N, K] contiguous -> [M, N] in x's dtype."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    M, K = x.shape
    N, K2 = weight.shape
    if K != K2 or M > MAX_M or not weight.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"gemv: need x [M<={MAX_M}, K] with unit stride and contiguous weight [N, K]; "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    if N >= 8 * num_sms:  # enough output tiles to fill the GPU without splitting K
        return gemv_direct(x, weight, bias)
    bm, bn, bk, split = _blocks(M, N, K, num_sms)
    y = torch.zeros(M, N, device=x.device, dtype=torch.float32)
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    grid = (triton.cdiv(N, bn), split)
    _gemv_kernel[grid](x, weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0), k_per_split,
                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


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


class SkinnyLinear(torch.nn.Linear):
    """nn.Linear that routes inputs of at most MAX_M tokens to the Triton GEMV (same parameters, same numbers up
    to fp32 rounding order); larger inputs (prefill) keep the library GEMM."""

    force_kernel = False  # tests: use the kernel on CPU too (interpreted)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        tokens = x.numel() // x.shape[-1]
        if gemv_op is None or tokens > MAX_M or not (x.is_cuda or self.force_kernel):
            return super().forward(x)
        return gemv_op(x.reshape(tokens, x.shape[-1]), self.weight, self.bias).reshape(*lead, -1)
