"""One token's q/k norm (Qwen3), RoPE, K/V-cache write and attention over the cache, in one Triton launch.

Why: a fused one-token decode layer (models/fused_decode.py) spent a launch on kernels/rope_write.py between the qkv
GEMV and the one-launch attention (kernels/decode_attention.py): ~2.4 us of a ~54 us layer at the Qwen2.5-1.5B
shape on the H200, pure launch latency (EngineConfig.rope_in_attention). Here the attention launch takes the qkv
GEMV's raw q, k, v of the new token and does both jobs.

Layout and the one hazard: the attention's grid (b, kv head hk, row block) x key slice, slices merged by the last
program to finish (decode_attention.py `_split_merge_kernel`, whose code this reuses). Every program rotates its
own query rows (a [rows, D] block: the q heads of its GQA group). The new token's slot p = its position is read by
the slice that holds it while the program that writes it runs in parallel, so no program reads slot p from the
cache: every program of that slice computes rotate(norm(k)) of head hk and v itself (one [1, D] row each, tiny)
and substitutes them for slot p's load (`_slice_partial` NEW_KV). Exactly one program writes the slot: row block 0
of the slice holding p, for its head hk; positions outside [0, S) are not written (as rope_write). The rotated q
is not returned: fused_decode's layer used rope_write's only as the attention's input.

Numbers: rope_write's then decode_attention's, bit for bit on CPU (TRITON_INTERPRET=1): the same `_norm_rope_rows`
(RMSNorm.forward's and apply_rope's rounding to the dtype) on the same values, the same slice loop and merge. On
the GPU the q/k norms' fp32 sum of squares is a tree over a block of another shape than rope_write's, so with
Qwen3's norms an element may rarely differ by an ulp (rope_write's own docstring: ~1e-6 against eager); without
norms (Qwen2, Llama) nothing rounds differently.

`rope_attention_reference` is the plain-PyTorch twin (rope_write_reference, then decode_attention_reference);
`rope_attention_op` the kernel as the torch custom op "specpilot::rope_attention" (declares the caches mutated).
"""

from __future__ import annotations

import os

import torch

import specpilot.kernels.decode_attention as da
from specpilot.kernels.decode_attention import _counters, _pow2, decode_attention_reference
from specpilot.kernels.rope_write import _check_shapes, rope_write_reference

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.attention_parts import _merge_store, _slice_partial, _store_partial
    from specpilot.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options  # PDL (kernels/pdl.py)
    from specpilot.kernels.rope import _cos_sin_row, _norm_rope_rows
except ImportError:  # CPU-only installs: the reference path only
    triton = None


def rope_attention_reference(q, k, v, cos, sin, positions, k_cache, v_cache, q_norm_weight=None, k_norm_weight=None,
                             eps: float = 1e-6, scale: float | None = None) -> torch.Tensor:
    """rope_write, then the attention over the written caches: q [B, H, 1, D], k/v [B, Hkv, 1, D], k_cache/v_cache
    [B, Hkv, S, D] (written in place) -> [B, H, 1, D]."""
    rq = rope_write_reference(q, k, v, cos, sin, positions, k_cache, v_cache, q_norm_weight, k_norm_weight, eps)
    return decode_attention_reference(rq, k_cache, v_cache, positions, scale)


if triton is not None:

    @triton.jit
    def _rope_attention_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, qw_ptr, kw_ptr, kc_ptr, vc_ptr,
                               o_ptr, m_ptr, l_ptr, out_ptr, cnt_ptr,
                               sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sc_b, ss_b, sp_b,
                               skc_b, skc_h, skc_s, svc_b, svc_h, svc_s, so_b, so_h,
                               H_KV, S, G, SPLIT_S, NUM_SPLITS, NUM_RB, scale, eps,
                               D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, PREC: tl.constexpr,
                               UPCAST: tl.constexpr, SPLITS_P2: tl.constexpr, Q_NORM: tl.constexpr,
                               K_NORM: tl.constexpr, USE_PDL: tl.constexpr = False):
        # USE_PDL: as `_split_merge_kernel` (kernels/decode_attention.py): q/k/v come from the qkv GEMV, so wait
        # before the first load; nothing (the K/V slot, partials, counters, the output) is stored before the wait
        if USE_PDL:
            gdc_launch_dependents()
            gdc_wait()
        pid_bh = tl.program_id(0)  # (b, kv head, row block): one counter each
        pid_s = tl.program_id(1)
        b = pid_bh // NUM_RB // H_KV
        hk = pid_bh // NUM_RB % H_KV
        row0 = pid_bh % NUM_RB * BLOCK_R
        # one token per row: row r of the block is query head hk * G + r (decode_attention's `_queries` at T = 1)
        r = row0 + tl.arange(0, BLOCK_R)
        p = tl.load(pos_ptr + b * sp_b)  # the token's position = its cache slot
        pos = tl.where(r < G, p, -1)
        max_pos = tl.max(pos, axis=0)
        c, s_signed, cols, partner = _cos_sin_row(cos_ptr, sin_ptr, b, 0, sc_b, 0, ss_b, 0, D)
        # rope_write's rotated q, as the attention would load it (padding rows: 0)
        q, q_valid = _norm_rope_rows(q_ptr + b * sq_b + (hk * G + row0) * sq_h, qw_ptr, G - row0, sq_h, c,
                                     s_signed, cols, partner, eps, D, BLOCK_R, Q_NORM)
        if UPCAST:
            q = q.to(tl.float32)
        n_used = tl.minimum(max_pos // SPLIT_S + 1, NUM_SPLITS)  # who works and counts: as `_split_merge_kernel`
        if pid_s < n_used:
            # the new token's K (rope_write's rounding) and V of head hk, in registers: [1, D] each
            k_new, k_valid = _norm_rope_rows(k_ptr + b * sk_b + hk * sk_h, kw_ptr, 1, sk_h, c, s_signed, cols,
                                             partner, eps, D, 1, K_NORM)
            v_new = tl.load(v_ptr + b * sv_b + hk * sv_h + cols)[None, :]
            slot = p.to(tl.int64)
            if (row0 == 0) & (slot >= 0) & (slot < S) & (pid_s == slot // SPLIT_S):  # the one writer of the slot
                tl.store(kc_ptr + b * skc_b + hk * skc_h + slot * skc_s + cols[None, :], k_new)
                tl.store(vc_ptr + b * svc_b + hk * svc_h + slot * svc_s + cols[None, :], v_new)
            m_i, l_i, acc = _slice_partial(q, pos, kc_ptr, vc_ptr, b, hk, pid_s * SPLIT_S, skc_b, skc_h, skc_s,
                                           svc_b, svc_h, svc_s, S, SPLIT_S, scale, D, BLOCK_R, BLOCK_S, PREC, UPCAST,
                                           k_new, v_new, slot, True)
            _store_partial(o_ptr, m_ptr, l_ptr, (pid_bh * NUM_SPLITS + pid_s) * BLOCK_R, m_i, l_i, acc, D, BLOCK_R)
            # publish and count in; the last merges (`_split_merge_kernel` says why this ordering is enough)
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pid_bh, 1, sem="acq_rel", scope="gpu")
            if arrived == n_used - 1:
                _merge_store(o_ptr, m_ptr, l_ptr, out_ptr, b, hk, row0, pid_bh, n_used, so_b, so_h, 0, 1, G,
                             NUM_SPLITS, D, BLOCK_R, ".cg", SPLITS_P2)
                tl.store(cnt_ptr + pid_bh, 0)  # back to zero for the next launch


def rope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                   eps: float = 1e-6, scale: float | None = None, *, split_s: int = 128,
                   block_s: int = 64) -> torch.Tensor:
    """One new token per row: q [B, H, 1, D], k/v [B, Hkv, 1, D] (raw projection outputs, any strided views),
    cos/sin [B or 1, 1, 1, D], positions [B, 1], k_cache/v_cache [B, Hkv, S, D] (the layer's cache slots the token
    attends over; written in place) -> attention of rotate(norm(q)) over the cache with rotate(norm(k)) and v
    written at slot positions[b] -> [B, H, 1, D]. Norm weights [D] optional (Qwen3). = rope_write, then
    decode_attention(one_launch=True) (same numbers, one launch). Static shapes, no host sync: CUDA-graph safe."""
    if triton is None:
        raise RuntimeError("rope_attention needs triton")
    problem = _check_shapes(q, k, v, cos, sin, positions, k_cache, v_cache, q_norm_weight, k_norm_weight)
    if problem is None and q.shape[2] != 1:
        problem = f"one token per row (T = 1), got q {tuple(q.shape)}"
    if problem:
        raise ValueError(f"rope_attention: {problem}")
    B, H, _, D = q.shape
    Hkv, S = k.shape[1], k_cache.shape[2]
    if H % Hkv or D < 16 or split_s % block_s or S < 1:
        raise ValueError(f"rope_attention: needs H {H} a multiple of Hkv {Hkv}, D {D} >= 16, S {S} >= 1, and "
                         f"split_s {split_s} a multiple of block_s {block_s}")
    q, k, v, cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, cos, sin))
    qw, kw = (w.contiguous() if w is not None else q for w in (q_norm_weight, k_norm_weight))  # q: never read
    G = H // Hkv
    rows = max(16, min(_pow2(G), 32))  # decode_attention's row block at T = 1 (ROWS_PER_PROGRAM 32)
    nrb = triton.cdiv(G, rows)
    splits = triton.cdiv(S, split_s)
    out = torch.empty(B, H, 1, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    o = torch.empty(B * Hkv * nrb * splits * rows, D, dtype=torch.float32, device=q.device)
    m = torch.empty(B * Hkv * nrb * splits * rows, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    scb = cos.stride(0) if cos.shape[0] == B else 0
    ssb = sin.stride(0) if sin.shape[0] == B else 0
    pdl = launch_options()  # launch_pdl=True with USE_PDL when the PDL switch is on
    _rope_attention_kernel[(B * Hkv * nrb, splits)](
        q, k, v, cos, sin, positions, qw, kw, k_cache, v_cache, o, m, l, out, _counters(q.device, B * Hkv * nrb),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), scb, ssb, positions.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), out.stride(0), out.stride(1), Hkv, S, G, split_s, splits, nrb,
        D ** -0.5 if scale is None else scale, eps,
        D=D, BLOCK_R=rows, BLOCK_S=block_s, PREC="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1", SPLITS_P2=_pow2(splits), Q_NORM=q_norm_weight is not None,
        K_NORM=k_norm_weight is not None, USE_PDL=pdl.use_pdl, **pdl.kwargs,
    )
    return out


def _register_op():
    """The kernel as a torch custom op: one opaque call under torch.compile (as kernels/decode_attention.py); the
    caches are declared mutated so functionalization keeps the writes."""

    @torch.library.custom_op("specpilot::rope_attention", mutates_args=("k_cache", "v_cache"))
    def rope_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                          eps: float = 1e-6) -> torch.Tensor:
        # the slices of the one-launch attention op it replaces (read at call time, as that op does): same numbers
        split_s, block_s = da.ONE_LAUNCH_SPLIT
        return rope_attention(q, k, v, cos, sin, positions, k_cache, v_cache, q_norm_weight, k_norm_weight, eps,
                              split_s=split_s, block_s=block_s)

    @rope_attention_op.register_fake
    def _(q, k, v, cos, sin, positions, k_cache, v_cache, q_norm_weight=None, k_norm_weight=None, eps=1e-6):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    return rope_attention_op


rope_attention_op = _register_op() if triton is not None else None
