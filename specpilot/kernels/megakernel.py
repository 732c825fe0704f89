"""A whole one-token decode step of a dense model (every layer, the final norm and the LM head) in ONE persistent
Triton launch, its phases separated by grid-wide barriers: an experiment towards issue 3's AR-step bars.

Why: the fused decode step (models/fused_decode.py, six launches a layer) sits at 1.97x the bytes/bandwidth floor at
the Qwen2.5-1.5B shape and 1.27x at Qwen3-8B's on the H200 (session 21). Per launch it pays the graph's ~1.1 us
kernel boundary, then a ramp (every program issues its first loads at once and waits a DRAM latency) and a tail
(the last programs finish alone); the small launches (qkv 6 MB, o_proj 5 MB, attention, RoPE) are almost nothing
else. Micro-fusions inside the six launches, PDL with a weight prefetch and L2 warming on a side stream all lost
(BENCHMARKS.md sessions 13-21). Here the launch boundaries go: one program per SM stays resident for the whole
step and walks the phases

    per layer:  [input RMSNorm + qkv GEMV (+ bias)]
                [q/k norm + RoPE + K/V write + attention slices; the last slice of a head merges]
                [o_proj GEMV + residual]
                [post-attention RMSNorm + gate/up GEMV + SiLU(gate) * up]
                [down GEMV + residual]
    then:       [final RMSNorm + LM head GEMV]

with a barrier after each phase (an atomic count at gpu scope, then a spin on it: `_grid_sync`). Each GEMV phase
gives every program one contiguous range of ceil(N / programs) output rows, so the work is balanced to a row
whatever N is (a grid of BLOCK_N tiles leaves a partial last wave: gate/up's 560 tiles of 16 on 132 SMs are 4.24
waves).

Exactness: every phase reuses the six-launch path's own Triton helpers (`_norm_rstd`/`_norm_h`/`_epilogue` of
kernels/gemv_parts.py, `_cos_sin_row`/`_norm_rope_rows` of kernels/rope.py, `_slice_partial`/`_store_partial`/
`_merge_store` of kernels/attention_parts.py), so the eager modules' rounding points are the same; only the GEMVs'
fp32 summation order may differ (as any GEMV's).

Memory ordering: every intermediate (the residual stream after each layer, qkv, attention output, h, SiLU*up, the
attention partials) has one buffer PER LAYER, so within a launch each address is written once and only read after
the barrier that follows its write: no SM can hold a stale L1 line of it (L1 starts empty each launch). The
barrier is the CTA-barrier-then-release / acquire pattern of the attention's one-launch merge; the spin reads the
counter with volatile loads (L2), then one acquire atomic orders what follows.

L2 warming (`prefetch_gu` >= 0, off by default): the attention phase keeps only H_kv x slices programs busy (8 of
132 at the 1.5B shape and a 512-token context) and HBM idles; with it every program first issues L2 prefetches
(`prefetch.global.L2::evict_last` per 128-byte line, as kernels/l2_prefetch.py "prefetch") for the o_proj rows it
will compute next and the first `prefetch_gu` bytes of its gate rows and of its up rows, so those loads hit L2.
(As a side stream, l2_prefetch lost: it competed with the layer's own launches for SMs; here it runs on programs
that would otherwise wait at the barrier.)

Co-residency: a grid barrier needs every program resident at once, so the grid is at most one program per SM
(`DecodeMegakernel(programs=...)` defaults to the SM count) and nothing else may occupy the GPU's SMs meanwhile
(inside the engine's CUDA graph nothing does). On the CPU interpreter (TRITON_INTERPRET=1), which runs programs one
after another, only a grid of ONE program can pass a barrier: the tests run it so (every phase's code, the barrier
included), and the GPU scripts check the 132-program grid against the six-launch step (scripts/gpu_megakernel.py).

Register preload, a one-dimensional accumulator, acquire polling (`preload`, `acc_1d`, `acquire_poll`, `preload_kv`;
off, after session 23's measurements, until the H200 times them): each GEMV phase's first weight tile is loaded into
registers BEFORE the barrier that opens the phase (weights do not depend on what the barrier waits for), so its DRAM
latency overlaps the barrier and, where a program's rows fit one tile (qkv, o_proj at the 1.5B shape), the whole
phase's weights are there when it opens; a GEMV can sum each K step's products at once into [BLOCK_N] fp32 instead of
a [BLOCK_N, BLOCK_K] fp32 tile (twice the weight tile's registers), leaving room for wider tiles, i.e. more bytes in
flight per SM; and the barrier's spin can poll with acquire loads, so the separate acquire round trip after it goes
(~0.7 us of the ~2.5 a barrier costs; 140 barriers a 1.5B step); `preload_kv`: a program's first attention slice (keys
and values below the new position, which this step does not change) is loaded before the barrier that opens the
attention phase and attended as one block (the new token's slot from registers). Session 23 also tried L2 prefetch
instructions a few tiles ahead of the loads, the next phase's first tiles before each barrier and the attention
slices: every phase got slower, more distance slower still (removed).

Status, measured on the H200 (session 23, BENCHMARKS.md): exact (argmax 8/8, barriers all counted) and SLOWER than
the six-launch step, so `EngineConfig.megakernel` stays off: 1.75 ms vs 1.45 ms a step at the 1.5B shape (2.37x the
floor vs 1.97x), 7.15 ms vs 4.66 ms at Qwen3-8B's. Per phase (1.5B): qkv 5.75 us for 1.3 us of weights (a grid
barrier plus a ramp costs ~4 us, a graphed kernel boundary ~1.1 us), gate/up 25.75 us for 11.5 (one program per SM
holding two register tiles waits a DRAM latency per K step), attention 10.75. What it would take: weights staged through shared memory
(cp.async / TMA, several stages per SM) and barriers overlapped with the next phase's weight loads.
"""

from __future__ import annotations

import os

import torch

from specpilot.kernels.decode_attention import _pow2
from specpilot.models.dense import rope_cos_sin

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.attention_parts import _merge_store, _slice_partial, _store_partial
    from specpilot.kernels.gemv_parts import _epilogue, _norm_h, _norm_rstd
    from specpilot.kernels.rope import _cos_sin_row, _norm_rope_rows
except ImportError:  # CPU-only installs
    triton = None

SPLIT_S, BLOCK_S = 128, 64  # attention key slice per task and its inner block (decode_attention's one-launch split)


if triton is not None:

    _LD_ACQUIRE_PTX = tl.constexpr("ld.acquire.gpu.global.u32 $0, [$1];")

    @triton.jit
    def _grid_sync(bar_ptr, target, ACQ_POLL: tl.constexpr = False):
        """Wait until `target` arrivals are counted on bar_ptr (barrier k of a launch: k * programs), counting this
        program in first. Every thread's earlier stores happen before the CTA barrier; thread 0's release atomic
        publishes them at gpu scope; the spin's volatile loads read L2; the acquire atomic orders what follows.
        ACQ_POLL (GPU): the spin's loads are themselves acquire loads (`ld.acquire.gpu`), so the last one orders
        what follows and the separate acquire round trip to L2 (~0.7 us a barrier) goes."""
        tl.debug_barrier()
        tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
        if ACQ_POLL:
            seen = tl.inline_asm_elementwise(_LD_ACQUIRE_PTX, "=r,l", [bar_ptr], dtype=tl.int32, is_pure=False,
                                             pack=1)
            while seen < target:
                seen = tl.inline_asm_elementwise(_LD_ACQUIRE_PTX, "=r,l", [bar_ptr], dtype=tl.int32,
                                                 is_pure=False, pack=1)
        else:
            seen = tl.load(bar_ptr, volatile=True)
            while seen < target:
                seen = tl.load(bar_ptr, volatile=True)
            tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()

    @triton.jit
    def _row_range(N, pid, programs):
        """-> (rows per program, this program's first row, its end): ceil(N / programs) rows each, the last ones
        fewer (or none: end <= first)."""
        per = tl.cdiv(N, programs)
        r0 = pid * per
        return per, r0, tl.minimum(r0 + per, N)

    @triton.jit
    def _stamp(times_ptr, idx, pid, TIMING: tl.constexpr):
        """TIMING (GPU only: inline asm): program 0 writes the global timer (ns) to times[idx] after a barrier."""
        if TIMING:
            if pid == 0:
                t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                              pack=1)
                tl.store(times_ptr + idx, t)

    _PREFETCH_PTX = tl.constexpr("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;")

    @triton.jit
    def _prefetch_l2(b_ptr, nbytes, LINES: tl.constexpr):
        """One `prefetch.global.L2::evict_last` per 128-byte line of bytes [0, nbytes) from byte pointer b_ptr (no
        data comes back: the next phase's loads of these weights then hit L2). -> a dummy sum (keeps the asm)."""
        done = tl.zeros((LINES,), dtype=tl.int32)
        for i in range(0, nbytes, LINES * 128):
            offs = i + tl.arange(0, LINES) * 128
            ptrs = b_ptr + tl.where(offs < nbytes, offs, 0).to(tl.int64)
            done += tl.inline_asm_elementwise(_PREFETCH_PTX, "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
        return tl.sum(done, axis=0)

    @triton.jit
    def _prefetch_next(wo_ptr, wgu_ptr, pid, programs, HID: tl.constexpr, NQ: tl.constexpr, INTER: tl.constexpr,
                       ELT: tl.constexpr, GU_BYTES: tl.constexpr, LINES: tl.constexpr):
        """While the attention phase runs (a few programs busy, HBM idle): this program's o_proj rows and the first
        GU_BYTES of its gate rows and of its up rows into L2 (the ranges `_gemv_range` gives it next)."""
        _, o0, o1 = _row_range(HID, pid, programs)
        wo_b = wo_ptr.to(tl.pointer_type(tl.int8), bitcast=True)
        done = _prefetch_l2(wo_b + o0.to(tl.int64) * NQ * ELT, tl.maximum(o1 - o0, 0) * NQ * ELT, LINES)
        _, g0, g1 = _row_range(INTER, pid, programs)
        gbytes = tl.minimum(tl.maximum(g1 - g0, 0) * HID * ELT, GU_BYTES)
        wgu_b = wgu_ptr.to(tl.pointer_type(tl.int8), bitcast=True)
        done += _prefetch_l2(wgu_b + g0.to(tl.int64) * HID * ELT, gbytes, LINES)
        done += _prefetch_l2(wgu_b + (INTER + g0).to(tl.int64) * HID * ELT, gbytes, LINES)
        return done

    @triton.jit
    def _chunk_rows(N, pid, programs, BLOCK_N: tl.constexpr):
        """-> (first row, end, chunk): a program's rows in equal chunks of at most BLOCK_N (68 rows in tiles of
        64: two of 34, not 64 + 4, whose K loop would stream a tile of 4 rows per DRAM round trip)."""
        per, r0, r1 = _row_range(N, pid, programs)
        return r0, r1, tl.cdiv(per, tl.cdiv(per, BLOCK_N))

    @triton.jit
    def _tile(w_ptr, n0, r1, chunk, N, K, k0, SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The weight tile of rows [n0, min(n0 + chunk, r1)) and columns [k0, k0 + BLOCK_K) (zeros outside W),
        and with SILU_MUL the same rows of the up half (N + n); else the gate tile twice."""
        n_offs = n0 + tl.arange(0, BLOCK_N)
        n_mask = n_offs < tl.minimum(n0 + chunk, r1)
        cols = k0 + tl.arange(0, BLOCK_K)
        ptrs = w_ptr + n_offs.to(tl.int64)[:, None] * K + cols[None, :]
        mask = n_mask[:, None] & (cols < K)[None, :]
        w = tl.load(ptrs, mask=mask, other=0.0)
        wu = w
        if SILU_MUL:
            wu = tl.load(ptrs + N * K, mask=mask, other=0.0)
        return w, wu

    @triton.jit
    def _first_tile(w_ptr, N, K, pid, programs, SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PRELOAD: tl.constexpr):
        """PRELOAD: this program's first tile of a GEMV phase, loaded BEFORE the barrier that opens the phase
        (weights do not depend on the activations the barrier waits for): its DRAM latency overlaps the barrier,
        and where a program's rows fit one tile (qkv, o_proj) the whole phase's weights are in registers when it
        opens. Else a [1, 1] placeholder (nothing loaded)."""
        if PRELOAD:
            r0, r1, chunk = _chunk_rows(N, pid, programs, BLOCK_N)
            return _tile(w_ptr, r0, r1, chunk, N, K, 0, SILU_MUL, BLOCK_N, BLOCK_K)
        else:
            z = tl.zeros((1, 1), dtype=w_ptr.dtype.element_ty)
            return z, z

    @triton.jit
    def _gemv_range(x_ptr, nw_ptr, w_ptr, b_ptr, r_ptr, y_ptr, N, K, eps, pid, programs, w0, wu0,
                    HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SILU_MUL: tl.constexpr,
                    ON_GPU: tl.constexpr, K_P2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRELOADED: tl.constexpr, ACC_1D: tl.constexpr):
        """This program's rows [r0, r1) of y = epilogue(W @ norm(x)), r1 - r0 = ceil(N / programs): the one-row
        loop of kernels/gemv_fused.py's `_gemv_fused_kernel` over equal chunks of <= BLOCK_N rows (W [N, K]
        row-major; with SILU_MUL the fused [2N, K] gate/up weight, gate row n and up row N + n).
        Register double buffering: the next K block's tile is loaded before this one is used (one program per SM has
        no other CTA's loads to overlap with). PRELOADED: the first chunk's first tile is (w0, wu0), loaded by
        `_first_tile` before the phase's barrier. ACC_1D: each K step's products are summed over K at once into
        [BLOCK_N] fp32 instead of kept as a [BLOCK_N, BLOCK_K] fp32 tile (twice the weight tile's registers): room
        for wider tiles, i.e. more bytes in flight per SM."""
        dt = y_ptr.dtype.element_ty
        r0, r1, chunk = _chunk_rows(N, pid, programs, BLOCK_N)
        if HAS_NORM:
            rstd = _norm_rstd(x_ptr, K, eps, K_P2)
        else:
            rstd = 1.0
        kk = tl.arange(0, BLOCK_K)
        for n0 in range(r0, r1, chunk):
            if PRELOADED:
                if n0 == r0:
                    w, wu = w0, wu0
                else:
                    w, wu = _tile(w_ptr, n0, r1, chunk, N, K, 0, SILU_MUL, BLOCK_N, BLOCK_K)
            else:
                w, wu = _tile(w_ptr, n0, r1, chunk, N, K, 0, SILU_MUL, BLOCK_N, BLOCK_K)
            if ACC_1D:
                acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
                acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
            else:
                acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
                acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                w_next, wu_next = _tile(w_ptr, n0, r1, chunk, N, K, k0 + BLOCK_K, SILU_MUL, BLOCK_N, BLOCK_K)
                k_offs = k0 + kk
                k_mask = k_offs < K
                h = tl.load(x_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32)
                if HAS_NORM:
                    h = _norm_h(h, tl.load(nw_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32), rstd, dt,
                                ON_GPU)
                if ACC_1D:
                    acc += tl.sum(w.to(tl.float32) * h[None, :], axis=1)
                    if SILU_MUL:
                        acc_up += tl.sum(wu.to(tl.float32) * h[None, :], axis=1)
                else:
                    acc += w.to(tl.float32) * h[None, :]
                    if SILU_MUL:
                        acc_up += wu.to(tl.float32) * h[None, :]
                w = w_next
                wu = wu_next
            if ACC_1D:
                y = acc
                u = acc_up
            else:
                y = tl.sum(acc, axis=1)
                u = tl.sum(acc_up, axis=1)
            n_offs = n0 + tl.arange(0, BLOCK_N)
            _epilogue(y, u, n_offs, n_offs < tl.minimum(n0 + chunk, r1), N, b_ptr, r_ptr, y_ptr, HAS_BIAS, HAS_RES,
                      SILU_MUL, ON_GPU)

    @triton.jit
    def _preload_kv(kc_ptr, vc_ptr, p, pid, programs, skc_h, skc_s, svc_h, svc_s, S, H_KV: tl.constexpr,
                    D: tl.constexpr, SPLIT_S: tl.constexpr, NUM_SPLITS: tl.constexpr, PRE_KV: tl.constexpr):
        """PRE_KV: the cached keys and values [SPLIT_S, D] of this program's first attention task (task = pid, as
        `_attention_tasks` deals them), slots below p only (already written: the new token's slot p is filled in
        from registers by the task), loaded BEFORE the barrier that opens the attention phase. A program without a
        task loads nothing (all masked). Else [1, 1] placeholders."""
        if PRE_KV:
            n_used = tl.minimum(p // SPLIT_S + 1, NUM_SPLITS)
            hk = pid % H_KV
            slots = (pid // H_KV) * SPLIT_S + tl.arange(0, SPLIT_S)
            d = tl.arange(0, D)
            end = tl.where(pid < H_KV * n_used, p, 0)  # a program without a task loads nothing
            ok = ((slots < end) & (slots < S))[:, None] & (d < D)[None, :]
            kb = tl.load(kc_ptr + hk * skc_h + slots.to(tl.int64)[:, None] * skc_s + d[None, :], mask=ok, other=0.0)
            vb = tl.load(vc_ptr + hk * svc_h + slots.to(tl.int64)[:, None] * svc_s + d[None, :], mask=ok, other=0.0)
            return kb, vb
        else:
            z = tl.zeros((1, 1), dtype=kc_ptr.dtype.element_ty)
            return z, z

    @triton.jit
    def _slice_block(q, pos, kb, vb, start, S, scale, k_new, v_new, new_slot, SPLIT_S: tl.constexpr,
                     PREC: tl.constexpr, UPCAST: tl.constexpr):
        """decode_attention's `_slice_partial` over one slice of SPLIT_S keys as ONE block whose keys and values
        are already in registers (`_preload_kv`; the new token's slot taken from k_new / v_new): -> m, l, acc.
        The same arithmetic as its loop's single iteration."""
        s = start + tl.arange(0, SPLIT_S)
        in_pool = s < S
        kb = tl.where((s == new_slot)[:, None], k_new, kb)
        vb = tl.where((s == new_slot)[:, None], v_new, vb)
        if UPCAST:
            kb = kb.to(tl.float32)
            vb = vb.to(tl.float32)
        scores = tl.dot(q, tl.trans(kb), input_precision=PREC) * scale
        scores = tl.where((s[None, :] <= pos[:, None]) & in_pool[None, :], scores, float("-inf"))
        m_i = tl.max(scores, axis=1)
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        pr = tl.exp(scores - m_use[:, None])
        return m_i, tl.sum(pr, axis=1), tl.dot(pr.to(vb.dtype), vb, input_precision=PREC)

    @triton.jit
    def _attention_tasks(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, kc_ptr, vc_ptr, o_ptr, m_ptr, l_ptr, out_ptr,
                         cnt_ptr, p, pid, programs, skc_h, skc_s, svc_h, svc_s, S, scale, eps,
                         H_Q: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, SPLIT_S: tl.constexpr, PREC: tl.constexpr,
                         UPCAST: tl.constexpr, SPLITS_P2: tl.constexpr, Q_NORM: tl.constexpr,
                         K_NORM: tl.constexpr, times_ptr, t_idx, TIMING: tl.constexpr, kb0, vb0,
                         PRE_KV: tl.constexpr):
        """One layer's attention for the token at position p: tasks (kv head hk, key slice s) for the slices at or
        below p, dealt round-robin to the programs; kernels/rope_attention.py's program body per task (q rotated
        by every task, the new K/V in registers, slot p written once), the last slice of each head merging into
        out [H_Q * D]. TIMING: program 0 stamps times[t_idx] once its slice's partial is stored and
        times[t_idx + 1] once it has published it (and merged, where it was the head's last). PRE_KV: the
        program's first task reads its slice from (kb0, vb0), preloaded before the barrier (`_preload_kv`)."""
        G: tl.constexpr = H_Q // H_KV
        n_used = tl.minimum(p // SPLIT_S + 1, NUM_SPLITS)
        r = tl.arange(0, BLOCK_R)
        pos = tl.where(r < G, p, -1)
        c, s_signed, cols, partner = _cos_sin_row(cos_ptr, sin_ptr, 0, 0, 0, 0, 0, 0, D)
        for task in range(pid, H_KV * n_used, programs):
            hk = task % H_KV
            s = task // H_KV
            q, q_valid = _norm_rope_rows(qkv_ptr + hk * G * D, qw_ptr, G, D, c, s_signed, cols, partner, eps, D,
                                         BLOCK_R, Q_NORM)
            if UPCAST:
                q = q.to(tl.float32)
            k_new, k_valid = _norm_rope_rows(qkv_ptr + (H_Q + hk) * D, kw_ptr, 1, D, c, s_signed, cols, partner,
                                             eps, D, 1, K_NORM)
            v_new = tl.load(qkv_ptr + (H_Q + H_KV + hk) * D + cols)[None, :]
            slot = p.to(tl.int64)
            if (slot < S) & (s == slot // SPLIT_S):  # the one writer of the new token's slot
                tl.store(kc_ptr + hk * skc_h + slot * skc_s + cols[None, :], k_new)
                tl.store(vc_ptr + hk * svc_h + slot * svc_s + cols[None, :], v_new)
            if PRE_KV:
                if task == pid:
                    m_i, l_i, acc = _slice_block(q, pos, kb0, vb0, s * SPLIT_S, S, scale, k_new, v_new, slot,
                                                 SPLIT_S, PREC, UPCAST)
                else:
                    m_i, l_i, acc = _slice_partial(q, pos, kc_ptr, vc_ptr, 0, hk, s * SPLIT_S, 0, skc_h, skc_s, 0,
                                                   svc_h, svc_s, S, SPLIT_S, scale, D, BLOCK_R, BLOCK_S, PREC, UPCAST,
                                                   k_new, v_new, slot, True)
            else:
                m_i, l_i, acc = _slice_partial(q, pos, kc_ptr, vc_ptr, 0, hk, s * SPLIT_S, 0, skc_h, skc_s, 0, svc_h,
                                               svc_s, S, SPLIT_S, scale, D, BLOCK_R, BLOCK_S, PREC, UPCAST, k_new,
                                               v_new, slot, True)
            _store_partial(o_ptr, m_ptr, l_ptr, (hk * NUM_SPLITS + s) * BLOCK_R, m_i, l_i, acc, D, BLOCK_R)
            tl.debug_barrier()
            _stamp(times_ptr, t_idx, pid, TIMING)
            arrived = tl.atomic_add(cnt_ptr + hk, 1, sem="acq_rel", scope="gpu")
            if arrived == n_used - 1:  # the head's last slice: merge its partials (read from L2: ".cg")
                _merge_store(o_ptr, m_ptr, l_ptr, out_ptr, 0, hk, 0, hk, n_used, 0, D, 0, 1, G, NUM_SPLITS, D,
                             BLOCK_R, ".cg", SPLITS_P2)
                tl.store(cnt_ptr + hk, 0)  # back to zero for the next launch
            _stamp(times_ptr, t_idx + 1, pid, TIMING)

    @triton.jit
    def _decode_step_kernel(
            tok_ptr, pos_ptr, emb_ptr, cos_ptr, sin_ptr,
            n1_ptr, wqkv_ptr, bqkv_ptr, qn_ptr, kn_ptr, wo_ptr, n2_ptr, wgu_ptr, wd_ptr, fn_ptr, lm_ptr,
            kc_ptr, vc_ptr, skc_l, skc_h, skc_s, svc_l, svc_h, svc_s, S,
            xs_ptr, qkv_ptr, att_ptr, hs_ptr, act_ptr, po_ptr, pm_ptr, pl_ptr, cnt_ptr, bar_ptr, logits_ptr,
            L, V, eps, scale,
            HID: tl.constexpr, H_Q: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr,
            HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, ON_GPU: tl.constexpr, UPCAST: tl.constexpr,
            PREC: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_S: tl.constexpr, SPLIT_S: tl.constexpr, HID_P2: tl.constexpr, INTER_P2: tl.constexpr,
            BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_D: tl.constexpr,
            BN_LM: tl.constexpr, BK_QKV: tl.constexpr, BK_O: tl.constexpr, BK_GU: tl.constexpr,
            BK_D: tl.constexpr, BK_LM: tl.constexpr, PREFETCH: tl.constexpr = False, PF_GU: tl.constexpr = 0,
            times_ptr=None, TIMING: tl.constexpr = False, PRELOAD: tl.constexpr = False,
            ACC_1D: tl.constexpr = False, ACQ_POLL: tl.constexpr = False, PRE_KV: tl.constexpr = False):
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        NQKV: tl.constexpr = (H_Q + 2 * H_KV) * D
        NQ: tl.constexpr = H_Q * D
        PART: tl.constexpr = H_KV * NUM_SPLITS * BLOCK_R  # one layer's partial rows
        _stamp(times_ptr, 0, pid, TIMING)  # (TIMING: times[k] after barrier k, times[0] at the start)
        tok = tl.load(tok_ptr).to(tl.int64)
        p = tl.load(pos_ptr).to(tl.int64)
        cos_row = cos_ptr + p * D
        sin_row = sin_ptr + p * D
        barrier = 0
        # PRELOAD: each GEMV phase's first tile is loaded before the barrier that opens it (`_first_tile`); the
        # qkv tile is carried from one layer's end to the next layer's start
        q_w, q_wu = _first_tile(wqkv_ptr, NQKV, HID, pid, programs, False, BN_QKV, BK_QKV, PRELOAD)
        for layer in range(0, L):
            li = tl.full([], 0, tl.int64) + layer  # 64-bit layer offsets: Qwen3-8B's gate/up stack is 3.6 G elements
            if layer == 0:
                x_in = emb_ptr + tok * HID
            else:
                x_in = xs_ptr + (li - 1) * HID
            qkv = qkv_ptr + li * NQKV
            att = att_ptr + li * NQ
            hs = hs_ptr + li * HID
            act = act_ptr + li * INTER
            wo = wo_ptr + li * HID * NQ
            wgu = wgu_ptr + li * 2 * INTER * HID
            wd = wd_ptr + li * HID * INTER
            kc = kc_ptr + li * skc_l
            vc = vc_ptr + li * svc_l
            # [input RMSNorm + qkv GEMV (+ bias)]
            _gemv_range(x_in, n1_ptr + li * HID, wqkv_ptr + li * NQKV * HID, bqkv_ptr + li * NQKV, x_in,
                        qkv, NQKV, HID, eps, pid, programs, q_w, q_wu, True, HAS_BIAS, False, False, ON_GPU, HID_P2,
                        BN_QKV, BK_QKV, PRELOAD, ACC_1D)
            kb0, vb0 = _preload_kv(kc, vc, p, pid, programs, skc_h, skc_s, svc_h, svc_s, S, H_KV, D, SPLIT_S,
                                   NUM_SPLITS, PRE_KV)
            barrier += 1
            _grid_sync(bar_ptr, barrier * programs, ACQ_POLL)
            _stamp(times_ptr, barrier, pid, TIMING)
            # [q/k norm + RoPE + K/V write + attention; the last slice of a head merges]
            _attention_tasks(qkv, cos_row, sin_row, qn_ptr + li * D, kn_ptr + li * D, kc, vc,
                             po_ptr + li * PART * D, pm_ptr + li * PART, pl_ptr + li * PART, att, cnt_ptr + li * H_KV,
                             p, pid, programs, skc_h, skc_s, svc_h, svc_s, S, scale, eps, H_Q, H_KV, D, NUM_SPLITS,
                             BLOCK_R, BLOCK_S, SPLIT_S, PREC, UPCAST, SPLITS_P2, QK_NORM, QK_NORM,
                             times_ptr, 5 * L + 2 + 2 * li, TIMING, kb0, vb0, PRE_KV)
            if PREFETCH:  # o_proj's rows and the start of gate/up's into L2 while HBM idles through attention (after
                # this program's own tasks: those with none start at once, those with some are not delayed)
                _prefetch_next(wo, wgu, pid, programs, HID, NQ, INTER, wo_ptr.dtype.element_ty.primitive_bitwidth // 8,
                               PF_GU, 256)
            o_w, o_wu = _first_tile(wo, HID, NQ, pid, programs, False, BN_O, BK_O, PRELOAD)
            barrier += 1
            _grid_sync(bar_ptr, barrier * programs, ACQ_POLL)
            _stamp(times_ptr, barrier, pid, TIMING)
            # [o_proj GEMV + residual]
            _gemv_range(att, n1_ptr, wo, bqkv_ptr, x_in, hs, HID, NQ, eps, pid, programs, o_w, o_wu,
                        False, False, True, False, ON_GPU, HID_P2, BN_O, BK_O, PRELOAD, ACC_1D)
            g_w, g_wu = _first_tile(wgu, INTER, HID, pid, programs, True, BN_GU, BK_GU, PRELOAD)
            barrier += 1
            _grid_sync(bar_ptr, barrier * programs, ACQ_POLL)
            _stamp(times_ptr, barrier, pid, TIMING)
            # [post-attention RMSNorm + gate/up GEMV + SiLU(gate) * up]
            _gemv_range(hs, n2_ptr + li * HID, wgu, bqkv_ptr, hs, act, INTER, HID, eps, pid, programs, g_w, g_wu,
                        True, False, False, True, ON_GPU, HID_P2, BN_GU, BK_GU, PRELOAD, ACC_1D)
            d_w, d_wu = _first_tile(wd, HID, INTER, pid, programs, False, BN_D, BK_D, PRELOAD)
            barrier += 1
            _grid_sync(bar_ptr, barrier * programs, ACQ_POLL)
            _stamp(times_ptr, barrier, pid, TIMING)
            # [down GEMV + residual] -> the next layer's input
            _gemv_range(act, n2_ptr, wd, bqkv_ptr, hs, xs_ptr + li * HID, HID, INTER, eps, pid, programs, d_w, d_wu,
                        False, False, True, False, ON_GPU, INTER_P2, BN_D, BK_D, PRELOAD, ACC_1D)
            # the next layer's qkv tile (after the last layer: layer 0's again, unused; the LM head loads its own)
            q_w, q_wu = _first_tile(wqkv_ptr + ((li + 1) % L) * NQKV * HID, NQKV, HID, pid, programs, False,
                                    BN_QKV, BK_QKV, PRELOAD)
            barrier += 1
            _grid_sync(bar_ptr, barrier * programs, ACQ_POLL)
            _stamp(times_ptr, barrier, pid, TIMING)
        # [final RMSNorm + LM head]
        _gemv_range(xs_ptr + (L - 1) * HID, fn_ptr, lm_ptr, bqkv_ptr, xs_ptr, logits_ptr, V, HID, eps, pid,
                    programs, q_w, q_wu, True, False, False, False, ON_GPU, HID_P2, BN_LM, BK_LM, False, ACC_1D)
        if TIMING:  # the LM head's end as program 0 sees it (its own range done; others may still run)
            _stamp(times_ptr, barrier + 1, pid, TIMING)


def _blocks(n: int, k: int, programs: int, cap_n: int, tile_bytes: int, elt: int, paired: bool) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of a GEMV phase: BLOCK_N the power of two >= a program's rows (at most cap_n: then
    several chunks), BLOCK_K as wide as puts ~tile_bytes of weights in flight per program and K step (gate and up
    count twice). Why wide: one program per SM has only its own loads in flight (the six-launch path has several
    CTAs per SM), and HBM needs ~4.2 TB/s x ~1.5 us / 132 SMs ~ 48 KB in flight per SM to stream at full rate."""
    bn = max(16, min(cap_n, _pow2(-(-n // programs))))
    bk = tile_bytes // (elt * bn * (2 if paired else 1))
    bk = max(64, min(_pow2(k), 1 << max(0, bk.bit_length() - 1)))  # a power of two <= the byte budget
    return bn, bk


class DecodeMegakernel:
    """The one-launch decode step of a DenseLM (models/dense.py; its projections fused) over its KVCache.

    Holds the model's weights stacked per kind ([L, N, K]) and the per-layer scratch. With share_weights (the
    engine's runner, EngineConfig.megakernel) the layers' parameters become views of the stacked tensors, so the
    weights are held once and every other pass (prefill, verify blocks) reads the same memory; without it the
    stacks are copies (~2x the layers' weights while it exists: the GPU script's A/B). `step(token, position)`
    (one-element int64 device tensors: CUDA-graph safe, no host sync) writes the token's K/V into the cache and
    returns its logits [V] in fp32, as `model.logits(model(token, position, cache))` would."""

    def __init__(self, model, cache, *, programs: int | None = None, num_warps: int = 8, tile_bytes: int = 32768,
                 cap_n: int = 128, prefetch_gu: int = -1, split_s: int = SPLIT_S, share_weights: bool = False,
                 preload: bool = False, acc_1d: bool = False, acquire_poll: bool = False, preload_kv: bool = False):
        if triton is None:
            raise RuntimeError("DecodeMegakernel needs triton")
        cfg = model.config
        layers = model.model.layers
        a0 = layers[0].self_attn
        if not hasattr(a0, "qkv_proj") or not hasattr(layers[0].mlp, "gate_up_proj"):
            raise ValueError("DecodeMegakernel needs fused projections (DenseLM.fuse_projections())")
        if cache.batch_size != 1:
            raise ValueError(f"DecodeMegakernel runs batch 1, the cache holds {cache.batch_size} rows")
        dev = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.L, self.H, self.V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
        self.Hq, self.Hkv, self.D, self.I = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                             cfg.intermediate_size)
        if self.Hq % self.Hkv or self.Hq // self.Hkv > 32 or self.D < 16 or self.D & (self.D - 1):
            raise ValueError(f"DecodeMegakernel: heads {self.Hq}/{self.Hkv}, head_dim {self.D} not supported")
        self.eps = layers[0].input_layernorm.eps
        self.has_bias = a0.qkv_proj.bias is not None
        self.qk_norm = a0.q_norm is not None
        # each stacked kind and where a layer holds it (the optional ones only where the model has them)
        fields = {"n1": lambda m: m.input_layernorm.weight, "wqkv": lambda m: m.self_attn.qkv_proj.weight,
                  "wo": lambda m: m.self_attn.o_proj.weight, "n2": lambda m: m.post_attention_layernorm.weight,
                  "wgu": lambda m: m.mlp.gate_up_proj.weight, "wd": lambda m: m.mlp.down_proj.weight}
        if self.has_bias:
            fields["bqkv"] = lambda m: m.self_attn.qkv_proj.bias
        if self.qk_norm:
            fields.update(qn=lambda m: m.self_attn.q_norm.weight, kn=lambda m: m.self_attn.k_norm.weight)
        with torch.no_grad():
            for name, get in fields.items():
                stacked = torch.stack([get(layer).detach() for layer in layers]).contiguous()
                setattr(self, name, stacked)
                if share_weights:  # each layer's parameter now a view of its stack: one copy of the weights
                    for i, layer in enumerate(layers):
                        get(layer).data = stacked[i]
        for name in ("bqkv", "qn", "kn"):  # absent: any tensor as the pointer (never read: HAS_BIAS, QK_NORM)
            if name not in fields:
                setattr(self, name, self.n1)
        self.fn = model.model.norm.weight.detach()
        self.lm = model.lm_head.weight.detach()
        self.emb = model.model.embed_tokens.weight.detach()
        self.cache = cache
        S = cache.max_seq_len
        # every slot's cos / sin row, as DenseLM.forward computes them per step
        self.cos, self.sin = rope_cos_sin(torch.arange(S, device=dev), model.inv_freq, self.dtype)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        programs = sms if programs is None else programs
        if not 1 <= programs <= sms and dev.type == "cuda":  # more than one per SM could leave one unscheduled
            raise ValueError(f"DecodeMegakernel: programs {programs} must be 1..{sms} (one per SM at most)")
        self.programs, self.num_warps = programs, num_warps
        self.interpret = os.environ.get("TRITON_INTERPRET") == "1"
        if split_s % BLOCK_S or split_s < BLOCK_S:
            raise ValueError(f"DecodeMegakernel: split_s {split_s} must be a multiple of {BLOCK_S}")
        self.split_s = split_s
        self.splits = -(-S // split_s)
        # prefetch_gu: bytes of each program's gate rows (and as many of its up rows) warmed in L2 during the
        # attention phase, with all its o_proj rows; -1 = no warming (the interpreter cannot run the asm)
        self.prefetch_gu = prefetch_gu
        # preload: each GEMV phase's first weight tile loaded before the barrier that opens it; acc_1d: GEMV sums
        # per K step into [BLOCK_N] fp32 (room for wider tiles: tile_bytes)
        self.preload, self.acc_1d = preload, acc_1d
        self.acquire_poll = acquire_poll  # barriers poll with acquire loads (GPU; the interpreter has no asm)
        self.preload_kv = preload_kv  # a program's first attention slice loaded before the attention barrier
        self.block_r = max(16, min(_pow2(self.Hq // self.Hkv), 32))
        L, H, D = self.L, self.H, self.D
        f32 = dict(dtype=torch.float32, device=dev)
        new = lambda *shape: torch.zeros(*shape, dtype=self.dtype, device=dev)  # noqa: E731
        self.xs, self.qkv, self.att = new(L, H), new(L, (self.Hq + 2 * self.Hkv) * D), new(L, self.Hq * D)
        self.hs, self.act, self.logits = new(L, H), new(L, self.I), new(self.V)
        part = L * self.Hkv * self.splits * self.block_r
        self.po, self.pm, self.pl = torch.zeros(part, D, **f32), torch.zeros(part, **f32), torch.zeros(part, **f32)
        self.cnt = torch.zeros(L * self.Hkv, dtype=torch.int32, device=dev)
        self.bar = torch.zeros(1, dtype=torch.int32, device=dev)
        P, elt = programs, self.wqkv.element_size()
        self.blocks = {}
        for tag, n, k, paired in (("QKV", (self.Hq + 2 * self.Hkv) * D, H, False), ("O", H, self.Hq * D, False),
                                  ("GU", self.I, H, True), ("D", H, self.I, False), ("LM", self.V, H, False)):
            self.blocks[f"BN_{tag}"], self.blocks[f"BK_{tag}"] = _blocks(n, k, P, cap_n, tile_bytes, elt, paired)
        self.compiled = None  # the launched kernel (registers / spills: `compiled.n_regs`, on a GPU)

    def step(self, token: torch.Tensor, position: torch.Tensor, times: torch.Tensor | None = None) -> torch.Tensor:
        """token, position: [1] int64 on the model's device -> logits [V] fp32 (the K/V of the token written).
        times (a GPU diagnostic, int64 [7 L + 2]): program 0's global timer at the start and after each barrier
        (5 L + 2), then per layer inside its attention phase (2 L), ns (`phase_times_us` reads it per phase)."""
        if token.numel() != 1 or position.numel() != 1:
            raise ValueError("DecodeMegakernel.step takes one token and its position")
        interp = self.interpret
        if interp and self.programs != 1:
            raise ValueError("under TRITON_INTERPRET=1 programs run one after another: only programs=1 passes a "
                             "grid barrier")
        self.bar.zero_()
        c = self.cache
        k, v = c.k[:, 0], c.v[:, 0]  # [L, Hkv, S, D]
        self.compiled = _decode_step_kernel[(self.programs,)](
            token, position, self.emb, self.cos, self.sin,
            self.n1, self.wqkv, self.bqkv, self.qn, self.kn, self.wo, self.n2, self.wgu, self.wd, self.fn, self.lm,
            k, v, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), c.max_seq_len,
            self.xs, self.qkv, self.att, self.hs, self.act, self.po, self.pm, self.pl, self.cnt, self.bar,
            self.logits, self.L, self.V, self.eps, self.D ** -0.5,
            HID=self.H, H_Q=self.Hq, H_KV=self.Hkv, D=self.D, INTER=self.I, HAS_BIAS=self.has_bias,
            QK_NORM=self.qk_norm, ON_GPU=not interp, UPCAST=interp,
            PREC="ieee" if self.dtype == torch.float32 else "tf32", NUM_SPLITS=self.splits,
            SPLITS_P2=_pow2(self.splits), BLOCK_R=self.block_r, BLOCK_S=BLOCK_S, SPLIT_S=self.split_s,
            PREFETCH=self.prefetch_gu >= 0 and not interp, PF_GU=max(self.prefetch_gu, 0),
            times_ptr=times, TIMING=times is not None and not interp,
            PRELOAD=self.preload, ACC_1D=self.acc_1d, ACQ_POLL=self.acquire_poll and not interp,
            PRE_KV=self.preload_kv,
            HID_P2=_pow2(self.H), INTER_P2=_pow2(self.I), num_warps=self.num_warps,
            **self.blocks,
        )
        return self.logits.float()

    def phase_times_us(self, times: torch.Tensor) -> dict:
        """`step(..., times=t)`'s stamps -> the median us per phase over the layers (qkv, attention, o_proj,
        gate_up, down), the LM head (as program 0 saw it) and the whole step; the attention phase also split as
        program 0 saw it: its slice up to the stored partial (`att_slice`), publishing it and any merge
        (`att_merge`), and waiting at the barrier (`att_wait`)."""
        L = self.L
        t = times.double().cpu() / 1e3
        d = (t[1:5 * L + 2] - t[:5 * L + 1])
        layers = d[: 5 * L].view(L, 5)
        out = {name: round(layers[:, i].median().item(), 2)
               for i, name in enumerate(("qkv", "attention", "o_proj", "gate_up", "down"))}
        out["lm_head"] = round(d[5 * L].item(), 2)
        out["step"] = round((t[5 * L + 1] - t[0]).item(), 2)
        if t.numel() >= 7 * L + 2:
            att = t[5 * L + 2: 7 * L + 2].view(L, 2)
            start, end = t[1:5 * L:5], t[2:5 * L + 1:5]  # each layer's attention phase: after barriers 1 and 2
            for name, a, b in (("att_slice", start, att[:, 0]), ("att_merge", att[:, 0], att[:, 1]),
                               ("att_wait", att[:, 1], end)):
                out[name] = round((b - a).median().item(), 2)
        return out
