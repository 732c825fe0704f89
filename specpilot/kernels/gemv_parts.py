"""The Triton building blocks of the fused GEMVs, shared by every kernel built like them.

Why a module of its own: the one-row GEMV (kernels/gemv_fused.py), the M-row GEMM (kernels/gemm_rows.py), the
12-bit GEMV (kernels/gemv12.py), qkv + RoPE (kernels/qkv_rope.py, qkv_rope_rows.py), the fused MLP
(kernels/fused_mlp.py), the one-launch step (kernels/megakernel.py) and the decode attention's L2 warming
(kernels/decode_attention.py) all round where the eager modules round, so they share these pieces rather than
each keeping a copy that could drift a rounding point apart:
- the RMSNorm prologue (`_norm_rstd`, `_norm_rstds`, `_norm_h`);
- the epilogue: bias, nn.Linear's rounding, SiLU(gate) x up, the residual add (`_epilogue*`, `_silu_times_up`);
- the one-row K loop's body (`_w_tiles`, `_acc_block`) and the M-row one's tensor-core product (`_dot_acc`);
- bulk L2 prefetches (`_l2_prefetch_bytes`, `_l2_prefetch_rows`: sm_90's cp.async.bulk.prefetch.L2, a hint).
kernels/gemv_fused.py's docstring gives the rounding points these helpers keep.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from specpilot.kernels.rmsnorm import _to_dtype  # fp32 -> dtype, round to nearest even (also interpreted)
except ImportError:  # CPU-only installs: nothing to share
    triton = None

L2_CHUNK = 64 * 1024  # bytes a bulk prefetch asks for (a multiple of 16)

if triton is not None:

    @triton.jit
    def _norm_rstd(x_ptr, K, eps, K_P2: tl.constexpr):
        """1 / RMS of the row x[:K]: recomputed by every program (the row is L2-resident) from ONE load of the
        whole row (K_P2 = next power of two >= K): a loop over K blocks here was a serial pass ahead of the weight
        stream (H200: the norm + qkv GEMV took 1.4x cuBLAS's plain GEMV at 8B shapes)."""
        kk = tl.arange(0, K_P2)
        xk = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        return tl.rsqrt(tl.sum(xk * xk, axis=0) / K + eps)  # as torch.rsqrt(mean + eps) (the sum is a tree)

    # one bulk L2 prefetch of $2 bytes at $1, issued by the program's thread 0 only (a scalar runs in every thread)
    _L2_BULK_PTX = tl.constexpr("{\n\t.reg .pred %l2p;\n\t.reg .b32 %l2t;\n\tmov.u32 %l2t, %tid.x;\n\t"
                                "setp.eq.u32 %l2p, %l2t, 0;\n\t@%l2p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t"
                                "mov.u32 $0, 0;\n\t}")
    _L2_CHUNK_C = tl.constexpr(L2_CHUNK)

    @triton.jit
    def _l2_prefetch_bytes(base, nbytes, CHUNK: tl.constexpr):
        """Ask L2 for the nbytes (a multiple of 16) at the byte pointer `base` (16-byte aligned), CHUNK bytes per
        bulk prefetch; nothing comes back."""
        for off in range(0, nbytes, CHUNK):
            size = tl.minimum(nbytes - off, CHUNK).to(tl.int32)
            tl.inline_asm_elementwise(_L2_BULK_PTX, "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False,
                                      pack=1)

    @triton.jit
    def _l2_prefetch_rows(w_ptr, row0, rows, K, CHUNK: tl.constexpr, PART: tl.constexpr = 64):
        """Ask L2 for weight rows [row0, row0 + rows) of a contiguous [*, K] matrix (K * itemsize a multiple of 16:
        the host checks), CHUNK bytes per bulk prefetch. PART < 64: only the first PART / 64 of those bytes
        (rounded down to 16, the bulk prefetch's granule)."""
        base = (w_ptr + row0.to(tl.int64) * K).to(tl.pointer_type(tl.int8), bitcast=True)
        nbytes = rows.to(tl.int64) * K * w_ptr.dtype.element_ty.primitive_bitwidth // 8
        if PART < 64:
            nbytes = nbytes * PART // 64 // 16 * 16
        _l2_prefetch_bytes(base, nbytes, CHUNK)

    @triton.jit
    def _norm_h(h, nw, rstd, dt: tl.constexpr, ON_GPU: tl.constexpr):
        """RMSNorm.forward on fp32 inputs h with fp32 norm weights nw: normalized, rounded to the dtype, times the
        weight, rounded (returned in fp32)."""
        if ON_GPU:  # the GPU's cvt rounds to nearest even: one instruction (this runs per program and K block; the
            # by-hand rounding cost ~8 integer ops an element, as much as the weight's FMAs when a program owns
            # few rows)
            h = ((h * rstd).to(dt).to(tl.float32) * nw).to(dt).to(tl.float32)
        else:  # the interpreter truncates fp32 -> bf16: round by hand
            h = _to_dtype(_to_dtype(h * rstd, dt).to(tl.float32) * nw, dt).to(tl.float32)
        return h

    @triton.jit
    def _norm_rstds(x_ptr, stride_xm, M, K, eps, K_P2: tl.constexpr, BLOCK_M: tl.constexpr):
        """[BLOCK_M] 1 / RMS of rows m < M (0 for the masked rows): `_norm_rstd` row by row, so each row's value is
        the one-row kernel's bit for bit (a [BLOCK_M, K_P2] tile at once would not fit in registers at K ~ 4k)."""
        rows = tl.arange(0, BLOCK_M)
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for m in range(0, M):
            rstd = tl.where(rows == m, _norm_rstd(x_ptr + m * stride_xm, K, eps, K_P2), rstd)
        return rstd

    @triton.jit
    def _epilogue_loads(n_offs, n_mask, N, b_ptr, r_ptrs, mask, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                        SILU_MUL: tl.constexpr):
        """The epilogue's operands -> (bias of the columns n_offs, bias of their up rows (SILU_MUL), residual at
        r_ptrs under mask), fp32; 0.0 for those the flags leave out. Split from `_epilogue_apply` so that the
        one-row kernel can issue them before its K loop (EARLY_EPI)."""
        b = 0.0
        bu = 0.0
        r = 0.0
        if HAS_BIAS:
            b = tl.load(b_ptr + n_offs, mask=n_mask, other=0.0).to(tl.float32)
            if SILU_MUL:
                bu = tl.load(b_ptr + N + n_offs, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        return b, bu, r

    @triton.jit
    def _silu_times_up(y, u, dt: tl.constexpr, ON_GPU: tl.constexpr):
        """The eager MLP's SiLU(gate) x up on gate y and up u, both fp32 holding dtype values: silu rounded to the
        dtype, times up, in fp32 (the caller rounds the product once). kernels/fused_mlp.py shares it."""
        if ON_GPU:  # torch's silu: g / (1 + exp(-g)), IEEE division, CUDA's expf (as kernels/silu_mul.py)
            e = libdevice.exp(-y)
        else:  # the interpreter has no libdevice: numpy's exp
            e = tl.exp(-y)
        return _to_dtype(tl.math.div_rn(y, 1.0 + e), dt).to(tl.float32) * u  # silu rounded, then times up

    @triton.jit
    def _epilogue_apply(y, u, b, bu, r, y_ptrs, mask, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                        SILU_MUL: tl.constexpr, ON_GPU: tl.constexpr):
        """fp32 sums y (gate with SILU_MUL) and u (up; unused otherwise) -> the stored outputs: + bias b (bu for
        up), nn.Linear's rounding, SiLU(gate) x up, + residual r, each rounded where the eager modules round;
        stored at y_ptrs under mask. -> the stored values (the norm handoff sums their squares)."""
        dt = y_ptrs.dtype.element_ty
        if HAS_BIAS:
            y += b
        y = _to_dtype(y, dt).to(tl.float32)  # nn.Linear's output in the dtype
        if SILU_MUL:
            if HAS_BIAS:
                u += bu
            y = _silu_times_up(y, _to_dtype(u, dt).to(tl.float32), dt, ON_GPU)
        if HAS_RES:
            y += r  # the eager add, rounded below
        out = _to_dtype(y, dt)
        tl.store(y_ptrs, out, mask=mask)
        return out

    @triton.jit
    def _epilogue_tile(y, u, n_offs, n_mask, N, b_ptr, r_ptrs, y_ptrs, mask, HAS_BIAS: tl.constexpr,
                       HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr, ON_GPU: tl.constexpr):
        """fp32 sums y (gate with SILU_MUL) and u (up; unused otherwise), [BN] or [rows, BN] -> the stored
        outputs: + bias (columns n_offs, the same for every row), nn.Linear's rounding, SiLU(gate) x up,
        + residual (read at r_ptrs), each rounded where the eager modules round; stored at y_ptrs under mask.
        -> the stored values."""
        b, bu, r = _epilogue_loads(n_offs, n_mask, N, b_ptr, r_ptrs, mask, HAS_BIAS, HAS_RES, SILU_MUL)
        return _epilogue_apply(y, u, b, bu, r, y_ptrs, mask, HAS_BIAS, HAS_RES, SILU_MUL, ON_GPU)

    @triton.jit
    def _epilogue(y, u, n_offs, n_mask, N, b_ptr, r_ptr, y_ptr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                  SILU_MUL: tl.constexpr, ON_GPU: tl.constexpr):
        """`_epilogue_tile` for one row: y and u [BN] at columns n_offs."""
        _epilogue_tile(y, u, n_offs, n_mask, N, b_ptr, r_ptr + n_offs, y_ptr + n_offs, n_mask, HAS_BIAS, HAS_RES,
                       SILU_MUL, ON_GPU)

    @triton.jit
    def _w_tiles(w_ptr, rows, m_rows, k0, K, up_off, UP: tl.constexpr, BLOCK_K: tl.constexpr):
        """K block k0's weight tile at the row offsets `rows` [R, 1] (rows masked by m_rows [R]) and, with UP (the
        two-tile SiLU x up), the up tile up_off elements further on -> (w, wu); wu is w without UP (unused)."""
        k_offs = k0 + tl.arange(0, BLOCK_K)
        mask = m_rows[:, None] & (k_offs < K)[None, :]
        w = tl.load(w_ptr + rows + k_offs[None, :], mask=mask, other=0.0)  # [BN or 2 BN, BK]
        wu = w
        if UP:
            wu = tl.load(w_ptr + rows + up_off + k_offs[None, :], mask=mask, other=0.0)
        return w, wu

    @triton.jit
    def _acc_block(acc, acc_up, w, wu, x_ptr, nw_ptr, k0, K, rstd, dt: tl.constexpr, HAS_NORM: tl.constexpr,
                   UP: tl.constexpr, ON_GPU: tl.constexpr, BLOCK_K: tl.constexpr):
        """The one-row K loop's body for block k0 with its weight tiles already loaded: x's block (normed with
        HAS_NORM) times w into acc, and times wu into acc_up with UP (two-tile SiLU x up) -> (acc, acc_up)."""
        k_offs = k0 + tl.arange(0, BLOCK_K)
        k_mask = k_offs < K
        h = tl.load(x_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32)  # [BK]
        if HAS_NORM:
            h = _norm_h(h, tl.load(nw_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32), rstd, dt, ON_GPU)
        acc += w.to(tl.float32) * h[None, :]
        if UP:
            acc_up += wu.to(tl.float32) * h[None, :]
        return acc, acc_up

    @triton.jit
    def _dot_acc(h, w, acc, ON_GPU: tl.constexpr):
        """acc [BM, BN] + h [BM, BK] @ w [BN, BK]^T, fp32 sums. On the GPU 16-bit operands go in as they are (exact
        products, fp32 sums: nn.Linear's numbers) and fp32 ones at IEEE precision, not TF32. The interpreter's dot
        gets both upcast to fp32: a 16-bit product is exact in fp32, so the numbers are the same."""
        if ON_GPU:
            if h.dtype == tl.float32:
                acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(h, tl.trans(w), acc)
        else:
            acc = tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        return acc
