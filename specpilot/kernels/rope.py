"""Rotate-half RoPE of q and k in one Triton launch.

Why: the eager `apply_rope` (models/dense.py) is 5 kernels (neg, cat, 2 mul, add) each for q and k, every layer;
in a CUDA-graphed decode step each costs >= ~1.1 us plus its memory traffic.

Numbers: exactly `apply_rope`'s, `x * cos + rotate_half(x) * sin` in the input dtype: both products are rounded to
the input dtype, then their sum (the product of two 16-bit floats is exact in fp32, so computing it in fp32 and
rounding once equals the eager dtype multiply; the sum of two 16-bit values rounded once from fp32 likewise). In
fp32 the GPU compiler may contract a product and the sum into an FMA: ~1 ulp.

Layout: one program per (batch row, token) and tensor (q or k), all heads of it at once ([heads, D] block); the
cos/sin row is read once per program. Outputs are contiguous [B, H, T, D] / [B, Hkv, T, D]; inputs may be any
strided views with a unit-stride last dimension (q/k straight out of the projection, transposed).

`rope_reference` is the plain-PyTorch twin (TRITON_INTERPRET=1 runs the kernel on CPU); `rope_op` the kernel as
the torch custom op "specpilot::rope" (opaque to torch.compile).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.rmsnorm import _to_dtype  # fp32 -> dtype, round to nearest even (interpreter too)
except ImportError:  # CPU-only installs: the reference path only
    triton = None


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Exactly `apply_rope` (models/dense.py) on q and k."""

    def one(x):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    return one(q), one(k)


if triton is not None:

    @triton.jit
    def _cos_sin_row(cos_ptr, sin_ptr, b, t, scb, sct, ssb, sst, D: tl.constexpr):
        """-> (cos, sin with rotate_half's sign folded in, cols, partner) of token (b, t), fp32 [D] each."""
        HALF: tl.constexpr = D // 2
        cols = tl.arange(0, D)
        partner = (cols + HALF) % D  # rotate_half: [-x2, x1]
        c = tl.load(cos_ptr + b * scb + t * sct + cols).to(tl.float32)
        s = tl.load(sin_ptr + b * ssb + t * sst + cols).to(tl.float32)
        return c, tl.where(cols < HALF, -s, s), cols, partner  # the sign of -x2 moved onto sin: exact

    @triton.jit
    def _norm_rope_rows(base, w_ptr, n_heads, sxh, c, s_signed, cols, partner, eps, D: tl.constexpr,
                        BLOCK_H: tl.constexpr, NORM: tl.constexpr, CG: tl.constexpr = False):
        """Heads [BLOCK_H, D] at base + head * sxh + col: optionally RMSNormed (kernels/rope_write.py, Qwen3's q/k
        norm), then rotated; in the input dtype. -> (rotated heads, the valid-head mask [BLOCK_H, 1]). CG: the
        loads read L2 only (".cg"), for heads other programs of the launch just wrote (kernels/qkv_rope.py)."""
        heads = tl.arange(0, BLOCK_H)
        valid = heads[:, None] < n_heads
        rows = base + heads[:, None] * sxh
        if CG:
            x = tl.load(rows + cols[None, :], mask=valid, other=0.0, cache_modifier=".cg").to(tl.float32)
            xp = tl.load(rows + partner[None, :], mask=valid, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
            x = tl.load(rows + cols[None, :], mask=valid, other=0.0).to(tl.float32)
            xp = tl.load(rows + partner[None, :], mask=valid, other=0.0).to(tl.float32)  # rotate_half's partner
        dtype = base.dtype.element_ty
        if NORM:  # RMSNorm.forward per head: fp32 statistics, round to dtype, times the weight, round again
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]  # the partner is in the same head: same rstd
            w = tl.load(w_ptr + cols).to(tl.float32)[None, :]
            wp = tl.load(w_ptr + partner).to(tl.float32)[None, :]
            x = _to_dtype(_to_dtype(x * rstd, dtype).to(tl.float32) * w, dtype).to(tl.float32)
            xp = _to_dtype(_to_dtype(xp * rstd, dtype).to(tl.float32) * wp, dtype).to(tl.float32)
        a = _to_dtype(x * c[None, :], dtype).to(tl.float32)  # x * cos in the input dtype
        r = _to_dtype(xp * s_signed[None, :], dtype).to(tl.float32)  # rotate_half(x) * sin in the input dtype
        return _to_dtype(a + r, dtype), valid

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
                     sqb, sqh, sqt, skb, skh, skt, sqob, sqoh, sqot, skob, skoh, skot, scb, sct, ssb, sst,
                     T, H, HKV, D: tl.constexpr, BLOCK_H: tl.constexpr):
        bt = tl.program_id(0)
        b = (bt // T).to(tl.int64)
        t = (bt % T).to(tl.int64)
        c, s_signed, cols, partner = _cos_sin_row(cos_ptr, sin_ptr, b, t, scb, sct, ssb, sst, D)
        heads = tl.arange(0, BLOCK_H)
        if tl.program_id(1) == 0:
            out, valid = _norm_rope_rows(q_ptr + b * sqb + t * sqt, q_ptr, H, sqh, c, s_signed, cols, partner, 0.0,
                                         D, BLOCK_H, False)
            tl.store(qo_ptr + b * sqob + t * sqot + heads[:, None] * sqoh + cols[None, :], out, mask=valid)
        else:
            out, valid = _norm_rope_rows(k_ptr + b * skb + t * skt, k_ptr, HKV, skh, c, s_signed, cols, partner, 0.0,
                                         D, BLOCK_H, False)
            tl.store(ko_ptr + b * skob + t * skot + heads[:, None] * skoh + cols[None, :], out, mask=valid)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q, k) rotated: q [B, H, T, D], k [B, Hkv, T, D], cos/sin [B, 1, T, D] (or broadcastable [1, 1, T, D]) ->
    contiguous outputs of q's and k's shapes and dtypes. D a power of two; unit stride along D. Static shapes, no
    host sync: safe inside CUDA graphs."""
    if triton is None:
        raise RuntimeError("rope needs triton")
    B, H, T, D = q.shape
    if (k.dim() != 4 or (k.shape[0], k.shape[2], k.shape[3]) != (B, T, D) or q.dtype != k.dtype or D < 2
            or D & (D - 1) or cos.shape != sin.shape or cos.dim() != 4 or cos.shape[1] != 1
            or cos.shape[0] not in (1, B) or tuple(cos.shape[2:]) != (T, D)):
        raise ValueError(f"rope: unsupported shapes q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}")
    Hkv = k.shape[1]
    q, k, cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, cos, sin))
    qo, ko = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.numel() == 0:
        return qo, ko
    scb = cos.stride(0) if cos.shape[0] == B else 0
    ssb = sin.stride(0) if sin.shape[0] == B else 0
    _rope_kernel[(B * T, 2)](
        q, k, cos, sin, qo, ko,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
        scb, cos.stride(2), ssb, sin.stride(2),
        T, H, Hkv, D=D, BLOCK_H=triton.next_power_of_2(max(H, Hkv)),
    )
    return qo, ko


def _register_op():
    """The kernel as a torch custom op: one opaque call under torch.compile (as kernels/decode_attention.py)."""

    @torch.library.custom_op("specpilot::rope", mutates_args=())
    def rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return rope(q, k, cos, sin)

    @rope_op.register_fake
    def _(q, k, cos, sin):
        return (torch.empty_like(q, memory_format=torch.contiguous_format),
                torch.empty_like(k, memory_format=torch.contiguous_format))

    return rope_op


rope_op = _register_op() if triton is not None else None
