"""qkv GEMM + RoPE + K/V cache write of a verify block (2 to 16 tokens), in one launch (EngineConfig.verify_rope_in_qkv).

Why: a fused verify layer (models/fused_decode.py with fused_verify) runs its qkv as the M-row GEMM
(kernels/gemv_fused.py) and then RoPE + the K/V write as a launch of its own (kernels/rope_write.py): on an H100 at
the Qwen2.5-1.5B shape that launch is 2.7 us of kernel a layer plus its boundary (session 50: 75 us of a 2.18 ms
16-token step, every byte of it activations). The one-token path already does it in its qkv GEMV's epilogue
(kernels/qkv_rope.py); this is the same for T rows.

The pairing, as kernels/qkv_rope.py: RoPE (rotate-half) mixes output column j of a head with column j + D/2. A
program owns BLOCK_P pairs of one head (BLOCK_P divides D/2) and multiplies the T-row input tile with two weight
tiles, rows j and rows j + D/2 (two tl.dot accumulators, as the M-row GEMM's SiLU x up takes gate and up rows), so
after the K loop it holds both halves of its columns for every token. The epilogue adds the bias, rounds (nn.Linear's
output), rotates q and k heads with each token's cos / sin and stores: q into a fresh [1, H, T, D] (rope_write's
layout, which the attention reads), k and v into their cache slots (slot = the token's position; a position outside
[0, S) is not written). Heads [0, H) are q, [H, H + Hkv) k, the rest v (stored as they are).

Input norm: none (x already normed: models/fused_decode.py's PRENORM_ROWS launch), or norm_weight with the rows' sums
of squares handed over by the previous layer's down GEMM (kernels/norm_handoff.py, EngineConfig.norm_handoff), or
(other callers) the M-row kernel's serial prologue. Models with a per-head q/k norm (Qwen3) keep rope_write's launch:
a program holds only BLOCK_P of a head's pairs.

Numbers: the two launches' own: the M-row GEMM's (tl.dot, fp32 sums, + bias in fp32, one rounding) then
`apply_rope`'s (each product rounded to the dtype, then their sum; kernels/rope.py). The same K loop and tile shapes
as the GEMM give its sums only when the tiles match; in general the dot products' summation order may differ (as
between any two GEMM tilings), so token forcing judges the tokens.

PDL (kernels/pdl.py): as the M-row GEMM's, nothing read or written before the wait.
"""

from __future__ import annotations

import os

import torch

from specpilot.kernels import tuned
from specpilot.kernels.gemv_fused import MAX_ROWS, gemv_fused_reference
from specpilot.kernels.norm_handoff import check_norm_ss, handoff_args
from specpilot.kernels.qkv_rope import fused_qkv_problem
from specpilot.kernels.rope_write import rope_write_reference

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.gemv_parts import _dot_acc, _norm_h, _norm_rstds  # the M-row GEMM's K loop pieces
    from specpilot.kernels.norm_handoff import rstd_from_ss  # SS_IN
    from specpilot.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options  # PDL (kernels/pdl.py)
    from specpilot.kernels.rmsnorm import _to_dtype  # fp32 -> dtype, round to nearest even (interpreter too)
except ImportError:  # CPU-only installs: the reference path only
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
MIN_PAIRS = 16  # tl.dot's smallest N on a GPU: a head needs D / 2 >= 16 pairs there (the interpreter takes fewer)


def qkv_rope_rows_reference(x, weight, bias, norm_weight, eps, cos, sin, positions, k_cache, v_cache,
                            num_heads: int) -> torch.Tensor:
    """The two launches this one replaces, in plain PyTorch: the fused qkv GEMM (its norm and bias) at T rows, then
    RoPE + K/V write (kernels/rope_write.py's reference) -> rotated q [1, H, T, D]; k/v written in place."""
    D, Hkv = k_cache.shape[-1], k_cache.shape[1]
    T = x.shape[0]
    qkv = gemv_fused_reference(x, weight, bias, norm_weight=norm_weight, eps=eps)  # [T, (H + 2 Hkv) D]
    q, k, v = qkv.split((num_heads * D, Hkv * D, Hkv * D), dim=-1)
    q, k, v = (t.view(1, T, -1, D).transpose(1, 2) for t in (q, k, v))
    return rope_write_reference(q, k, v, cos, sin, positions, k_cache, v_cache)


if triton is not None:

    @triton.jit
    def _qkv_rope_rows_kernel(x_ptr, w_ptr, b_ptr, nw_ptr, si_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, kc_ptr, vc_ptr,
                              M, K, stride_xm, stride_wn, eps, sct, sst, spt, sqh, sqt, skc_h, skc_s, svc_h, svc_s,
                              S, H, HKV, M_BUCKET, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr,
                              SS_IN: tl.constexpr, SS_P2: tl.constexpr, K_P2: tl.constexpr, ON_GPU: tl.constexpr,
                              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                              USE_PDL: tl.constexpr = False, PDL_LATE: tl.constexpr = False):
        """Program p: pairs [p BLOCK_P, (p + 1) BLOCK_P) of the (H + 2 HKV) D / 2, for rows m < M (tokens). M_BUCKET
        is never read: the autotuner's key (M rounded up to a power of two)."""
        HALF: tl.constexpr = D // 2
        if USE_PDL:
            if not PDL_LATE:
                gdc_launch_dependents()
            gdc_wait()
        dt = qo_ptr.dtype.element_ty
        p0 = tl.program_id(0) * BLOCK_P  # this program's first pair; BLOCK_P divides D / 2: one head
        head = p0 // HALF
        j = p0 % HALF + tl.arange(0, BLOCK_P)  # the pairs' first-half columns within the head
        rows_a = (head * D + j).to(tl.int64)[:, None] * stride_wn  # [BP, 1]: weight rows j
        rows_b = rows_a + HALF * stride_wn  # rows j + D / 2
        m = tl.arange(0, BLOCK_M)
        m_mask = m < M
        x_rows = m.to(tl.int64)[:, None] * stride_xm
        if HAS_NORM:
            if SS_IN:  # the previous down GEMM's sums of squares (kernels/norm_handoff.py)
                rstd = rstd_from_ss(si_ptr, K, eps, BLOCK_M, SS_P2)[:, None]  # [BM, 1]
            else:
                rstd = _norm_rstds(x_ptr, stride_xm, M, K, eps, K_P2, BLOCK_M)[:, None]
        acc_a = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
        acc_b = acc_a
        for k0 in range(0, K, BLOCK_K):  # the M-row GEMM's loop with two weight tiles (its SiLU x up's)
            k_offs = k0 + tl.arange(0, BLOCK_K)
            k_mask = k_offs < K
            h = tl.load(x_ptr + x_rows + k_offs[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if HAS_NORM:  # the normed values are dtype values: casting them back is exact
                nw = tl.load(nw_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32)
                h = _norm_h(h.to(tl.float32), nw[None, :], rstd, dt, ON_GPU).to(dt)
            wa = tl.load(w_ptr + rows_a + k_offs[None, :], mask=k_mask[None, :], other=0.0)  # [BP, BK]
            wb = tl.load(w_ptr + rows_b + k_offs[None, :], mask=k_mask[None, :], other=0.0)
            acc_a = _dot_acc(h, wa, acc_a, ON_GPU)
            acc_b = _dot_acc(h, wb, acc_b, ON_GPU)
        if USE_PDL and PDL_LATE:  # this program's K loop is done
            gdc_launch_dependents()
        if HAS_BIAS:
            acc_a += tl.load(b_ptr + head * D + j).to(tl.float32)[None, :]
            acc_b += tl.load(b_ptr + head * D + HALF + j).to(tl.float32)[None, :]
        ya = _to_dtype(acc_a, dt).to(tl.float32)  # nn.Linear's output in the dtype, [BM, BP]
        yb = _to_dtype(acc_b, dt).to(tl.float32)
        pos = tl.load(pos_ptr + m * spt, mask=m_mask, other=-1).to(tl.int64)  # each token's cache slot
        ok = (m_mask & (pos >= 0) & (pos < S))[:, None]  # [BM, 1]: a slot outside the pool is not written
        cols_a = j[None, :]
        if head < H + HKV:  # q or k: apply_rope, x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
            cs = m[:, None] * sct
            ss = m[:, None] * sst
            mm = m_mask[:, None]
            ca = tl.load(cos_ptr + cs + cols_a, mask=mm, other=0.0).to(tl.float32)
            cb = tl.load(cos_ptr + cs + HALF + cols_a, mask=mm, other=0.0).to(tl.float32)
            sa = tl.load(sin_ptr + ss + cols_a, mask=mm, other=0.0).to(tl.float32)
            sb = tl.load(sin_ptr + ss + HALF + cols_a, mask=mm, other=0.0).to(tl.float32)
            oa = _to_dtype(_to_dtype(ya * ca, dt).to(tl.float32) + _to_dtype(-yb * sa, dt).to(tl.float32), dt)
            ob = _to_dtype(_to_dtype(yb * cb, dt).to(tl.float32) + _to_dtype(ya * sb, dt).to(tl.float32), dt)
            if head < H:
                dst = qo_ptr + head * sqh + m[:, None] * sqt
                tl.store(dst + cols_a, oa, mask=mm)
                tl.store(dst + HALF + cols_a, ob, mask=mm)
            else:
                dst = kc_ptr + (head - H).to(tl.int64) * skc_h + pos[:, None] * skc_s
                tl.store(dst + cols_a, oa, mask=ok)
                tl.store(dst + HALF + cols_a, ob, mask=ok)
        else:  # v: into its slots as it is
            dst = vc_ptr + (head - H - HKV).to(tl.int64) * svc_h + pos[:, None] * svc_s
            tl.store(dst + cols_a, _to_dtype(ya, dt), mask=ok)
            tl.store(dst + HALF + cols_a, _to_dtype(yb, dt), mask=ok)

    # the M-row GEMM's tiles, counted in pairs (a program reads 2 BLOCK_P weight rows)
    _CONFIGS = [triton.Config({"BLOCK_P": bp, "BLOCK_K": bk}, num_warps=w, num_stages=3)
                for bp, bk in ((16, 128), (16, 256), (32, 64), (32, 128), (64, 64)) for w in (4, 8)]
    _KEY = ["K", "H", "HKV", "HAS_BIAS", "HAS_NORM", "D", "M_BUCKET"]

    def _prune(configs, named_args, **kwargs):  # a program's pairs stay within one head (+ a pinned pick: tuned.py)
        half = kwargs.get("D", named_args.get("D")) // 2
        configs = [c for c in configs if half % c.kwargs["BLOCK_P"] == 0]
        return tuned.narrow("_qkv_rope_rows_kernel", configs, named_args, kwargs, _KEY)

    _kernel = _qkv_rope_rows_kernel if _INTERPRET else tuned.autotune(_qkv_rope_rows_kernel, _CONFIGS, _KEY, _prune)


def _problem(x, weight, bias, norm_weight, cos, sin, positions, k_cache, v_cache, num_heads) -> str | None:
    """-> what is wrong with the arguments, or None."""
    if x.dim() != 2 or not 2 <= x.shape[0] <= MAX_ROWS or x.stride(-1) != 1:
        return f"x must be [T, K] with 2 <= T <= {MAX_ROWS} rows and unit stride, got {tuple(x.shape)}"
    problem = fused_qkv_problem(x, weight, bias, norm_weight, k_cache, v_cache, num_heads, cos=cos, sin=sin)
    if problem:
        return problem
    T, D = x.shape[0], k_cache.shape[-1]
    if not _INTERPRET and D // 2 < MIN_PAIRS:
        return f"head_dim must be >= {2 * MIN_PAIRS} on a GPU (tl.dot's smallest tile), got {D}"
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (1, 1, T, D) or t.stride(-1) != 1:
            return f"{name} must be [1, 1, T, D] = [1, 1, {T}, {D}] with unit stride, got {tuple(t.shape)}"
    if tuple(positions.shape) != (1, T) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        return f"positions must be integer [1, T] = [1, {T}], got {positions.dtype} {tuple(positions.shape)}"
    return None


def qkv_rope_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
                  eps: float, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, num_heads: int, norm_ss: torch.Tensor | None = None) -> torch.Tensor:
    """T tokens (2..16): q = RoPE(RMSNorm(x) @ Wq^T + bq), k likewise into k_cache[0, :, positions], v into v_cache;
    -> rotated q [1, H, T, D] (a new contiguous tensor). x [T, K]; weight the fused qkv [(H + 2 Hkv) D, K]; bias [N]
    and norm_weight [K] optional; norm_ss (with norm_weight): the rows' handed-over sums of squares
    (kernels/norm_handoff.py); cos/sin [1, 1, T, D]; positions [1, T]; caches [1, Hkv, S, D]. Static shapes, no host
    sync: safe inside CUDA graphs (once autotuned outside capture)."""
    if triton is None:
        raise RuntimeError("qkv_rope_rows needs triton")
    problem = _problem(x, weight, bias, norm_weight, cos, sin, positions, k_cache, v_cache, num_heads)
    if problem:
        raise ValueError(f"qkv_rope_rows: {problem}")
    T, K = x.shape
    check_norm_ss(norm_ss, norm_weight, T, K, MAX_ROWS, "qkv_rope_rows")
    _, Hkv, S, D = k_cache.shape
    q = torch.empty(1, num_heads, T, D, dtype=x.dtype, device=x.device)
    _, (_, si), ss_flags = handoff_args(q, False, norm_ss, K, MAX_ROWS)
    args = (x, weight, weight if bias is None else bias, weight if norm_weight is None else norm_weight, si, cos, sin,
            positions, q, k_cache, v_cache, T, K, x.stride(0), weight.stride(0), float(eps), cos.stride(2),
            sin.stride(2), positions.stride(1), q.stride(1), q.stride(2), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(1), v_cache.stride(2), S, num_heads, Hkv, max(triton.next_power_of_2(T), 2))
    pdl = launch_options()  # launch_pdl=True with USE_PDL when the PDL switch is on
    flags = dict(HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None, SS_IN=ss_flags["SS_IN"],
                 SS_P2=ss_flags["SS_P2"], K_P2=triton.next_power_of_2(K) if norm_weight is not None else 1,
                 ON_GPU=not _INTERPRET, D=D, BLOCK_M=MAX_ROWS, USE_PDL=pdl.use_pdl, PDL_LATE=pdl.late, **pdl.kwargs)
    pairs = (num_heads + 2 * Hkv) * D // 2
    if _INTERPRET:  # CPU tests: a small fixed tile (K's mask exercised: the tests' K is not a multiple of 64)
        bp = min(D // 2, MIN_PAIRS)
        _kernel[(pairs // bp,)](*args, **flags, BLOCK_P=bp, BLOCK_K=64)
    else:
        _kernel[lambda meta: (pairs // meta["BLOCK_P"],)](*args, **flags)
    return q


def _register_op():
    """The kernel as a torch custom op (as kernels/qkv_rope.py's); the caches are declared mutated."""

    @torch.library.custom_op("specpilot::qkv_rope_rows", mutates_args=("k_cache", "v_cache"))
    def qkv_rope_rows_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         norm_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                         positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                         norm_ss: torch.Tensor | None) -> torch.Tensor:
        return qkv_rope_rows(x, weight, bias, norm_weight, eps, cos, sin, positions, k_cache, v_cache, num_heads,
                             norm_ss)

    @qkv_rope_rows_op.register_fake
    def _(x, weight, bias, norm_weight, eps, cos, sin, positions, k_cache, v_cache, num_heads, norm_ss):
        return x.new_empty(1, num_heads, x.shape[0], k_cache.shape[-1])

    return qkv_rope_rows_op


qkv_rope_rows_op = _register_op() if triton is not None else None
