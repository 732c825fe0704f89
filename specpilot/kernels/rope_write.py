"""Qwen3's q/k RMSNorm, RoPE of q and k, and the KV-cache write of k and v, in one Triton launch.

Why: a bs-1 decode step at 1.5B shapes is launch/latency bound on the H200. Per layer the eager path runs the
RoPE kernel (kernels/rope.py, one launch), then `KVCache.write` (two `index_copy_` launches), and on Qwen3 the two
q/k norms before them (kernels/rmsnorm.py: two more launches). Here one launch does all of it: each program reads
its (batch row, token)'s heads once, normalises and rotates them, and stores rotated q into a fresh tensor and
rotated k and plain v straight into their slots of the cache, slot = position (models/cache.py).

Numbers: exactly the eager path's. The optional per-head RMSNorm over D rounds as `RMSNorm.forward` does (fp32
statistics, the normalised value rounded to the dtype, times the weight in the dtype; only the sum of squares is
a tree here, so fp32 agrees to ~1e-6); RoPE then rounds as `apply_rope` does (both products, then their sum,
rounded to the dtype; see kernels/rope.py). v is copied bit for bit.

Layout: grid (B * T, 3): program (b * T + t, 0) takes q's heads of that token, (.., 1) k's, (.., 2) v's, all heads
at once ([heads, D] block). With Q_HEADS_PER_PROGRAM = n > 0, q's heads are split over cdiv(H, n) programs of n
heads each (grid (B * T, cdiv(H, n) + 2); k and v follow them): at Qwen3-8B's 32 q heads, each with its own norm,
one program for all of them was 5.1 us of a 117 us layer on the H200 (session 26), latency on one SM. Each head's
numbers are computed alone either way, so the output is the same bits. A token whose position lies outside [0, S)
is not written (the eager `index_copy_` would fail on it instead).

`rope_write_reference` is the plain-PyTorch twin (TRITON_INTERPRET=1 runs the kernel on CPU); `rope_write_op` the
kernel as the torch custom op "specpilot::rope_write", which declares the two caches as mutated.
"""

from __future__ import annotations

import torch

from specpilot.kernels.rmsnorm import rmsnorm_reference
from specpilot.kernels.rope import rope_reference

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options  # PDL (kernels/pdl.py)
    from specpilot.kernels.rope import _cos_sin_row, _norm_rope_rows  # the per-row math, shared with the RoPE kernel
except ImportError:  # CPU-only installs: the reference path only
    triton = None

Q_HEADS_PER_PROGRAM = 0  # q heads a program takes (a power of two); 0: all of them in one program (see the module
# docstring). Off until the H200 times it (scripts/gpu_step_timing.py --variants=fuseddecode,fusedropesplit)


def rope_write_reference(q, k, v, cos, sin, positions, k_cache, v_cache, q_norm_weight=None, k_norm_weight=None,
                         eps: float = 1e-6) -> torch.Tensor:
    """The eager path of `Attention.forward` (models/dense.py): q/k RMSNorm per head, `apply_rope`, then
    `KVCache.write` into k_cache/v_cache [B, Hkv, S, D] (in place). -> rotated q [B, H, T, D]."""
    if q_norm_weight is not None:
        q = rmsnorm_reference(q, q_norm_weight, eps)
    if k_norm_weight is not None:
        k = rmsnorm_reference(k, k_norm_weight, eps)
    q, k = rope_reference(q, k, cos, sin)
    if positions.shape[0] == 1:  # as KVCache.write
        k_cache.index_copy_(2, positions[0], k)
        v_cache.index_copy_(2, positions[0], v)
    else:
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        k_cache[rows, :, positions] = k.transpose(1, 2)
        v_cache[rows, :, positions] = v.transpose(1, 2)
    return q


if triton is not None:

    @triton.jit
    def _rope_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, qo_ptr, qw_ptr, kw_ptr,
                           sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, scb, sct, ssb, sst, spb, spt,
                           skcb, skch, skcs, svcb, svch, svcs, sqob, sqoh, sqot, T, H, HKV, S, eps,
                           D: tl.constexpr, BLOCK_H: tl.constexpr, Q_NORM: tl.constexpr, K_NORM: tl.constexpr,
                           USE_PDL: tl.constexpr = False, Q_BLOCK: tl.constexpr = 0, QP: tl.constexpr = 1):
        # USE_PDL (launched with PDL, kernels/pdl.py): the next kernel may launch now; then wait for the previous
        # one before the first load. Everything this kernel reads (q/k/v from the qkv GEMV, cos/sin, positions) is
        # written by earlier kernels, and nothing may be stored before the wait: the predecessor may still be
        # running, still reading the buffer the allocator handed us as the rotated-q output
        if USE_PDL:
            gdc_launch_dependents()
            gdc_wait()
        bt = tl.program_id(0)
        which = tl.program_id(1)  # < QP: a block of q's heads (all of them when QP is 1), QP: k, QP + 1: v
        b = (bt // T).to(tl.int64)
        t = (bt % T).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)
        p = tl.load(pos_ptr + b * spb + t * spt).to(tl.int64)  # the cache slot of token (b, t)
        slot = tl.full([BLOCK_H, 1], 0, tl.int64) + p  # as a tensor: the interpreter rejects tensor & scalar masks
        in_pool = (slot >= 0) & (slot < S)
        if which == QP + 1:  # v: copied into its slot as is
            cols = tl.arange(0, D)
            valid = (heads[:, None] < HKV) & in_pool
            x = tl.load(v_ptr + b * svb + t * svt + heads[:, None] * svh + cols[None, :], mask=valid)
            tl.store(vc_ptr + b * svcb + p * svcs + heads[:, None] * svch + cols[None, :], x, mask=valid)
        else:
            c, s_signed, cols, partner = _cos_sin_row(cos_ptr, sin_ptr, b, t, scb, sct, ssb, sst, D)
            if which < QP:
                # (q's own names: a block of q heads may have another shape than k's, which the else branch sets)
                if Q_BLOCK:  # heads [which * Q_BLOCK, + Q_BLOCK) of q
                    h0 = which * Q_BLOCK
                    qh = h0 + tl.arange(0, Q_BLOCK)
                    q_out, q_valid = _norm_rope_rows(q_ptr + b * sqb + t * sqt + h0 * sqh, qw_ptr, H - h0, sqh, c,
                                                     s_signed, cols, partner, eps, D, Q_BLOCK, Q_NORM)
                else:
                    qh = heads
                    q_out, q_valid = _norm_rope_rows(q_ptr + b * sqb + t * sqt, qw_ptr, H, sqh, c, s_signed, cols,
                                                     partner, eps, D, BLOCK_H, Q_NORM)
                tl.store(qo_ptr + b * sqob + t * sqot + qh[:, None] * sqoh + cols[None, :], q_out, mask=q_valid)
            else:
                out, valid = _norm_rope_rows(k_ptr + b * skb + t * skt, kw_ptr, HKV, skh, c, s_signed, cols,
                                             partner, eps, D, BLOCK_H, K_NORM)
                tl.store(kc_ptr + b * skcb + p * skcs + heads[:, None] * skch + cols[None, :], out,
                         mask=valid & in_pool)


def _check_shapes(q, k, v, cos, sin, positions, k_cache, v_cache, q_norm_weight, k_norm_weight) -> str | None:
    """-> what is wrong with the arguments, or None."""
    if q.dim() != 4:
        return f"q must be [B, H, T, D], got {tuple(q.shape)}"
    B, H, T, D = q.shape
    if k.dim() != 4 or (k.shape[0], k.shape[2], k.shape[3]) != (B, T, D) or v.shape != k.shape:
        return f"k and v must both be [B, Hkv, T, D] = [{B}, Hkv, {T}, {D}], got {tuple(k.shape)}, {tuple(v.shape)}"
    if D < 2 or D & (D - 1):
        return f"head_dim must be a power of two, got {D}"
    if cos.shape != sin.shape or cos.dim() != 4 or cos.shape[0] not in (1, B) or tuple(cos.shape[1:]) != (1, T, D):
        return f"cos and sin must be [B or 1, 1, T, D] = [{B}, 1, {T}, {D}], got {tuple(cos.shape)}, {tuple(sin.shape)}"
    if tuple(positions.shape) != (B, T) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        return f"positions must be integer [B, T] = [{B}, {T}], got {positions.dtype} {tuple(positions.shape)}"
    S = k_cache.shape[2] if k_cache.dim() == 4 else -1
    if k_cache.dim() != 4 or tuple(k_cache.shape) != (B, k.shape[1], S, D) or v_cache.shape != k_cache.shape:
        return (f"k_cache and v_cache must both be [B, Hkv, S, D] = [{B}, {k.shape[1]}, S, {D}], "
                f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return "k_cache and v_cache must have unit stride along head_dim (they are written in place)"
    tensors = dict(k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, q_norm_weight=q_norm_weight,
                   k_norm_weight=k_norm_weight)
    for name, x in tensors.items():
        if x is not None and x.dtype != q.dtype:
            return f"{name} must have q's dtype {q.dtype} (the eager path's numbers), got {x.dtype}"
    for name in ("q_norm_weight", "k_norm_weight"):
        if tensors[name] is not None and tuple(tensors[name].shape) != (D,):
            return f"{name} must be [D] = [{D}], got {tuple(tensors[name].shape)}"
    return None


def rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
               eps: float = 1e-6) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, Hkv, T, D] (any strided views, e.g. of the projection output), cos/sin [B or 1, 1,
    T, D], positions [B, T], k_cache/v_cache [B, Hkv, S, D] (one layer of the pool): writes rotate(norm(k)) and v
    into slot positions[b, t] of row b, returns rotate(norm(q)) as a new contiguous [B, H, T, D]. Norm weights [D]
    optional (Qwen3). One dtype throughout. Static shapes, no host sync: safe inside CUDA graphs."""
    if triton is None:
        raise RuntimeError("rope_write needs triton")
    problem = _check_shapes(q, k, v, cos, sin, positions, k_cache, v_cache, q_norm_weight, k_norm_weight)
    if problem:
        raise ValueError(f"rope_write: {problem}")
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k_cache.shape[2]
    q, k, v, cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, cos, sin))
    qw, kw = (w.contiguous() if w is not None else q for w in (q_norm_weight, k_norm_weight))  # q: never read
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [B, H, T, D]
    if B * T == 0:
        return qo
    scb = cos.stride(0) if cos.shape[0] == B else 0
    ssb = sin.stride(0) if sin.shape[0] == B else 0
    pdl = launch_options()  # launch_pdl=True with USE_PDL when the PDL switch is on
    q_block = min(triton.next_power_of_2(Q_HEADS_PER_PROGRAM), triton.next_power_of_2(H)) if Q_HEADS_PER_PROGRAM else 0
    qp = triton.cdiv(H, q_block) if q_block else 1
    block_h = triton.next_power_of_2(Hkv if q_block else max(H, Hkv))  # k / v (and q when it is one program)
    _rope_write_kernel[(B * T, qp + 2)](
        q, k, v, cos, sin, positions, k_cache, v_cache, qo, qw, kw,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), scb, cos.stride(2), ssb, sin.stride(2),
        positions.stride(0), positions.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), qo.stride(0), qo.stride(1), qo.stride(2), T, H, Hkv, S, eps,
        D=D, BLOCK_H=block_h, Q_NORM=q_norm_weight is not None, K_NORM=k_norm_weight is not None,
        USE_PDL=pdl.use_pdl, Q_BLOCK=q_block, QP=qp, **pdl.kwargs,
    )
    return qo


def _register_op():
    """The kernel as a torch custom op: one opaque call under torch.compile (as kernels/decode_attention.py); the
    caches are declared mutated so functionalization keeps the writes."""

    @torch.library.custom_op("specpilot::rope_write", mutates_args=("k_cache", "v_cache"))
    def rope_write_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                      eps: float = 1e-6) -> torch.Tensor:
        return rope_write(q, k, v, cos, sin, positions, k_cache, v_cache, q_norm_weight, k_norm_weight, eps)

    @rope_write_op.register_fake
    def _(q, k, v, cos, sin, positions, k_cache, v_cache, q_norm_weight=None, k_norm_weight=None, eps=1e-6):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    return rope_write_op


rope_write_op = _register_op() if triton is not None else None
