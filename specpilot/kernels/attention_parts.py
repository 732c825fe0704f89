"""The split-KV attention's Triton pieces, shared by every kernel that attends over the KV pool this way.

Why a module of its own: kernels/decode_attention.py's split, merge and one-launch kernels, the cluster kernel
(kernels/cluster_attention.py), RoPE + attention (kernels/rope_attention.py) and the one-launch step
(kernels/megakernel.py) all compute a slice's partial softmax and merge the slices with the same code, so their
numbers are the same bit for bit wherever the same slices meet:
- `_queries`: a program's query rows (query head in the GQA group x token) and their positions;
- `_slice_partial` (and the preloaded variant with its `_preload_slice`): one slice of keys' running max, sum and
  weighted values, the causal mask from the positions (key slot j is visible to a query at position p iff j <= p);
- `_store_partial` / `_merge_store` / `_store_single`: publish a partial, merge a KV head's partials in slice order
  and store the output rows;
- `_kv_l2_hint`: a slice's K/V rows asked of L2 before a PDL wait (a hint).
kernels/decode_attention.py's docstring says how the kernels use them.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.gemv_parts import _L2_CHUNK_C, _l2_prefetch_rows  # bulk L2 prefetches, their size
except ImportError:  # CPU-only installs: nothing to share
    triton = None

MAX_T = 16  # the most new tokens (query rows per query head) a call takes

if triton is not None:
    MAX_T_C = tl.constexpr(MAX_T)

    @triton.jit
    def _queries(q_ptr, pos_ptr, b, hk, row0, sq_b, sq_h, sq_t, sp_b, T, G, D: tl.constexpr, BLOCK_R: tl.constexpr,
                 UPCAST: tl.constexpr):
        """-> q [BLOCK_R, D] (row r = row0 + i = (query head j in the group, token t) = (r // T, r % T)), pos
        [BLOCK_R], max_pos (over this row block's tokens)"""
        r = row0 + tl.arange(0, BLOCK_R)
        valid = r < G * T
        j = r // T
        t = r % T
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * sq_b + (hk * G + j)[:, None] * sq_h + t[:, None] * sq_t + d[None, :],
                    mask=valid[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        pos = tl.load(pos_ptr + b * sp_b + t, mask=valid, other=-1)
        return q, pos, tl.max(pos, axis=0)

    @triton.jit
    def _slice_partial(q, pos, k_ptr, v_ptr, b, hk, start, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, S, SPLIT_S, scale,
                       D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, PREC: tl.constexpr,
                       UPCAST: tl.constexpr, k_new=0, v_new=0, new_slot=0, NEW_KV: tl.constexpr = False,
                       V_FIRST: tl.constexpr = False):
        """Online softmax over keys [start, start + SPLIT_S): -> m [BLOCK_R], l [BLOCK_R], acc [BLOCK_R, D] (fp32).
        NEW_KV (kernels/rope_attention.py): key slot `new_slot` is read as k_new / v_new [1, D] (the new token's,
        computed in registers) instead of from the cache, which another program of the launch is writing.
        V_FIRST (LOADS_FIRST): each block's V rows are asked for before its scores are reduced."""
        d = tl.arange(0, D)
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        for s0 in range(start, start + SPLIT_S, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            in_pool = s < S
            if V_FIRST:  # asked for ahead of K: K's tile goes through shared memory (the dot's operand) first
                vb = tl.load(v_ptr + b * sv_b + hk * sv_h + s[:, None] * sv_s + d[None, :],
                             mask=in_pool[:, None], other=0.0)
            kb = tl.load(k_ptr + b * sk_b + hk * sk_h + s[:, None] * sk_s + d[None, :],
                         mask=in_pool[:, None], other=0.0)
            if NEW_KV:
                kb = tl.where((s == new_slot)[:, None], k_new, kb)
            p, alpha, m_new = _block_scores(q, pos, kb, s, in_pool, m_i, scale, PREC, UPCAST)
            if not V_FIRST:
                vb = tl.load(v_ptr + b * sv_b + hk * sv_h + s[:, None] * sv_s + d[None, :],
                             mask=in_pool[:, None], other=0.0)
            if NEW_KV:
                vb = tl.where((s == new_slot)[:, None], v_new, vb)
            l_i, acc = _block_values(p, alpha, vb, l_i, acc, PREC, UPCAST)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _block_scores(q, pos, kb, s, in_pool, m_i, scale, PREC: tl.constexpr, UPCAST: tl.constexpr):
        """The first half of one block of keys s [BLOCK_S] (rows kb [BLOCK_S, D]) in the online softmax: -> the
        block's weights p [BLOCK_R, BLOCK_S], the running sums' rescale alpha and the new running maximum. The loop
        body of `_slice_partial` (with `_block_values`), shared with `_slice_partial_preloaded`: one order of sums."""
        if UPCAST:
            kb = kb.to(tl.float32)
        scores = tl.dot(q, tl.trans(kb), input_precision=PREC) * scale  # [BLOCK_R, BLOCK_S], fp32
        seen = (s[None, :] <= pos[:, None]) & in_pool[None, :]
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        return tl.exp(scores - m_use[:, None]), tl.exp(m_i - m_use), m_new

    @triton.jit
    def _block_values(p, alpha, vb, l_i, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
        """The second half (see `_block_scores`): the block's values vb [BLOCK_S, D] into the running sums."""
        if UPCAST:
            vb = vb.to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PREC)
        return l_i, acc

    @triton.jit
    def _older_rows(ptr, b, hk, s, p, S, s_b, s_h, s_s, D: tl.constexpr):
        """Rows s [BLOCK_S] of (b, hk)'s K or V below slot p (key slots written by earlier steps: KV_PRELOAD), the
        others (slot p, being written now, and above it) 0."""
        d = tl.arange(0, D)
        return tl.load(ptr + b * s_b + hk * s_h + s[:, None] * s_s + d[None, :], mask=((s < p) & (s < S))[:, None],
                       other=0.0)

    @triton.jit
    def _preload_slice(k_ptr, v_ptr, b, hk, start, p, S, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, D: tl.constexpr,
                       BLOCK_S: tl.constexpr, PRE_NB: tl.constexpr):
        """KV_PRELOAD's loads of the slice starting at `start`: its first block's K and V rows below slot p (ka, va)
        and, when PRE_NB == 2, its second's (kb2, vb2; else ka, va again) -> ka, va, kb2, vb2."""
        s_pre = start + tl.arange(0, BLOCK_S)
        ka = _older_rows(k_ptr, b, hk, s_pre, p, S, sk_b, sk_h, sk_s, D)
        va = _older_rows(v_ptr, b, hk, s_pre, p, S, sv_b, sv_h, sv_s, D)
        kb2 = ka
        vb2 = va
        if PRE_NB == 2:
            kb2 = _older_rows(k_ptr, b, hk, s_pre + BLOCK_S, p, S, sk_b, sk_h, sk_s, D)
            vb2 = _older_rows(v_ptr, b, hk, s_pre + BLOCK_S, p, S, sv_b, sv_h, sv_s, D)
        return ka, va, kb2, vb2

    @triton.jit
    def _slice_partial_preloaded(q, pos, ka, va, kb2, vb2, k_ptr, v_ptr, b, hk, start, p, sk_b, sk_h, sk_s, sv_b,
                                 sv_h, sv_s, S, scale, D: tl.constexpr, BLOCK_R: tl.constexpr,
                                 BLOCK_S: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                                 PRE_NB: tl.constexpr):
        """`_slice_partial` (one token at position p, SPLIT_S = PRE_NB * BLOCK_S keys) over K/V blocks loaded before
        the wait (ka / va, and kb2 / vb2 when PRE_NB == 2: `_older_rows`), with slot p's row read now, behind the
        wait, where the slice holds it. Same sums in the same order as the loop."""
        d = tl.arange(0, D)
        pd = p + d * 0  # [D]: the slot of each lane (a vector mask: the interpreter takes no scalar one)
        mine = (pd >= start) & (pd < start + PRE_NB * BLOCK_S) & (pd < S)  # this slice holds slot p
        k_new = tl.load(k_ptr + b * sk_b + hk * sk_h + pd * sk_s + d, mask=mine, other=0.0)[None, :]
        v_new = tl.load(v_ptr + b * sv_b + hk * sv_h + pd * sv_s + d, mask=mine, other=0.0)[None, :]
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        s = start + tl.arange(0, BLOCK_S)
        w, alpha, m_i = _block_scores(q, pos, tl.where((s == p)[:, None], k_new, ka), s, s < S, m_i, scale, PREC,
                                      UPCAST)
        l_i, acc = _block_values(w, alpha, tl.where((s == p)[:, None], v_new, va), l_i, acc, PREC, UPCAST)
        if PRE_NB == 2:
            s = s + BLOCK_S
            w, alpha, m_i = _block_scores(q, pos, tl.where((s == p)[:, None], k_new, kb2), s, s < S, m_i, scale,
                                          PREC, UPCAST)
            l_i, acc = _block_values(w, alpha, tl.where((s == p)[:, None], v_new, vb2), l_i, acc, PREC, UPCAST)
        return m_i, l_i, acc

    @triton.jit
    def _kv_l2_hint(k_ptr, v_ptr, pos_ptr, b, hk, start, sk_b, sk_h, sv_b, sv_h, sp_b, S, T, SPLIT_S,
                    D: tl.constexpr):
        """Ask L2 for K and V rows [start, min(start + SPLIT_S, p)) of (b, hk), p the largest position of b's
        tokens clamped to [0, S) (slot p itself is the one being written). Rows [*, D] lie contiguous (host check)."""
        t = tl.arange(0, MAX_T_C)
        p = tl.max(tl.load(pos_ptr + b * sp_b + t, mask=t < T, other=0), axis=0)
        n = tl.minimum(tl.minimum(p, S - 1) - start, SPLIT_S)
        if n > 0:
            _l2_prefetch_rows(k_ptr + b * sk_b + hk * sk_h, start, n, D, _L2_CHUNK_C)
            _l2_prefetch_rows(v_ptr + b * sv_b + hk * sv_h, start, n, D, _L2_CHUNK_C)

    @triton.jit
    def _store_partial(o_ptr, m_ptr, l_ptr, part, m_i, l_i, acc, D: tl.constexpr, BLOCK_R: tl.constexpr):
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, D)
        tl.store(m_ptr + part + r, m_i)
        tl.store(l_ptr + part + r, l_i)
        tl.store(o_ptr + (part + r)[:, None] * D + d[None, :], acc)

    @triton.jit
    def _chunk_partials(o_ptr, m_ptr, pid_bh, c, r, d, n_used, NUM_SPLITS, BLOCK_R: tl.constexpr, D: tl.constexpr,
                        CACHE: tl.constexpr):
        """Slices c [MERGE_CH] (those >= n_used masked): their maxima [MERGE_CH, R] (-inf) and accumulators
        [MERGE_CH, R, D] (0) at rows r [R], in one load each."""
        rows = (pid_bh * NUM_SPLITS + c)[:, None] * BLOCK_R + r[None, :]
        m_c = tl.load(m_ptr + rows, mask=(c < n_used)[:, None], other=float("-inf"), cache_modifier=CACHE)
        o_c = tl.load(o_ptr + rows[:, :, None] * D + d[None, None, :], mask=(c < n_used)[:, None, None], other=0.0,
                      cache_modifier=CACHE)
        return m_c, o_c

    @triton.jit
    def _merge_chunks(o_ptr, m_ptr, l_ptr, pid_bh, n_used, NUM_SPLITS, D: tl.constexpr, BLOCK_R: tl.constexpr,
                      CACHE: tl.constexpr, SPLITS_P2: tl.constexpr, MERGE_CH: tl.constexpr, MERGE_R: tl.constexpr):
        """`_merge_store`'s sums with the accumulators read MERGE_CH slices at a time: each chunk is one [MERGE_CH,
        MERGE_R, D] load, and the first is issued together with the maxima and sums (before any reduction), so
        n_used <= MERGE_CH slices cost one L2 round trip instead of one a slice (the loop's loads depend on nothing,
        but each iteration's sum and its CTA barriers kept them apart). MERGE_R (a power of two) >= the block's
        real rows: the rows past them are padding nobody stores. -> acc [MERGE_R, D], l [MERGE_R] (fp32)."""
        r = tl.arange(0, MERGE_R)
        d = tl.arange(0, D)
        sp = tl.arange(0, SPLITS_P2)
        rows = (pid_bh * NUM_SPLITS + sp)[:, None] * BLOCK_R + r[None, :]  # [SPLITS_P2, MERGE_R]
        m_all = tl.load(m_ptr + rows, mask=(sp < n_used)[:, None], other=float("-inf"), cache_modifier=CACHE)
        l_all = tl.load(l_ptr + rows, mask=(sp < n_used)[:, None], other=0.0, cache_modifier=CACHE)
        cs = tl.arange(0, MERGE_CH)
        m_c, o_c = _chunk_partials(o_ptr, m_ptr, pid_bh, cs, r, d, n_used, NUM_SPLITS, BLOCK_R, D, CACHE)
        m_max = tl.max(m_all, axis=0)  # [MERGE_R]
        m_use = tl.where(m_max == float("-inf"), 0.0, m_max)  # rows that see nothing (padding rows)
        l_run = tl.sum(l_all * tl.exp(m_all - m_use[None, :]), axis=0)
        acc = tl.sum(o_c * tl.exp(m_c - m_use[None, :])[:, :, None], axis=0)  # unused slices: e^-inf = 0
        for c0 in range(MERGE_CH, n_used, MERGE_CH):  # (new names: c0 may be int64, the positions' type)
            m_n, o_n = _chunk_partials(o_ptr, m_ptr, pid_bh, c0 + cs, r, d, n_used, NUM_SPLITS, BLOCK_R, D, CACHE)
            acc += tl.sum(o_n * tl.exp(m_n - m_use[None, :])[:, :, None], axis=0)
        return acc, l_run

    @triton.jit
    def _slice_part(o_ptr, m_ptr, pid_bh, s, n_used, NUM_SPLITS, r, d, BLOCK_R: tl.constexpr, D: tl.constexpr,
                    CACHE: tl.constexpr):
        """Slice s's maxima [BLOCK_R] and accumulator [BLOCK_R, D] (-inf and 0 when s >= n_used): loads only, so
        that the caller can have several slices' loads in flight before it uses any (MERGE_UNROLL)."""
        used = (r * 0 + s) < n_used  # [BLOCK_R] (a vector mask: the interpreter takes no scalar one)
        part = (pid_bh * NUM_SPLITS + s) * BLOCK_R
        m_s = tl.load(m_ptr + part + r, mask=used, other=float("-inf"), cache_modifier=CACHE)
        o_s = tl.load(o_ptr + (part + r)[:, None] * D + d[None, :], mask=used[:, None], other=0.0,
                      cache_modifier=CACHE)
        return m_s, o_s

    @triton.jit
    def _merge_store(o_ptr, m_ptr, l_ptr, out_ptr, b, hk, row0, pid_bh, n_used, so_b, so_h, so_t, T, G, NUM_SPLITS,
                     D: tl.constexpr, BLOCK_R: tl.constexpr, CACHE: tl.constexpr, SPLITS_P2: tl.constexpr,
                     MERGE_CH: tl.constexpr = 0, MERGE_R: tl.constexpr = 16, MERGE_UN: tl.constexpr = 0,
                     FIRST: tl.constexpr = False):
        # softmax over all keys from the slices' partials: sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, over
        # the slices at or below the largest query position only (the others exited early). Two passes, so that
        # no step waits on the one before: the slices' maxima and sums in one [SPLITS_P2, BLOCK_R] load (M and
        # the denominator at once), then the weighted sum of the accumulators, whose loads are independent of
        # each other (an online merge chains every slice's exp on the previous running maximum).
        # CACHE: the partials' load cache modifier (".cg" when other programs of the same launch wrote them).
        # MERGE_CH > 0 (MERGE_CHUNK): `_merge_chunks`, a round trip a chunk, instead of the loop below (one a slice).
        # MERGE_UN 2 or 4 (MERGE_UNROLL): the loop with that many slices' loads issued before their sums.
        # FIRST (LOADS_FIRST, with MERGE_UN): the first MERGE_UN slices' loads issued before the maxima's reduction.
        d = tl.arange(0, D)
        if MERGE_CH > 0:
            r = tl.arange(0, MERGE_R)
            acc, l_run = _merge_chunks(o_ptr, m_ptr, l_ptr, pid_bh, n_used, NUM_SPLITS, D, BLOCK_R, CACHE, SPLITS_P2,
                                       MERGE_CH, MERGE_R)
        else:
            r = tl.arange(0, BLOCK_R)
            sp = tl.arange(0, SPLITS_P2)
            used = sp < n_used
            rows = (pid_bh * NUM_SPLITS + sp)[:, None] * BLOCK_R + r[None, :]  # [SPLITS_P2, BLOCK_R]
            m_all = tl.load(m_ptr + rows, mask=used[:, None], other=float("-inf"), cache_modifier=CACHE)
            l_all = tl.load(l_ptr + rows, mask=used[:, None], other=0.0, cache_modifier=CACHE)
            if MERGE_UN >= 2 and FIRST:  # slices 0 .. MERGE_UN - 1 asked for now, summed below
                f_m0, f_o0 = _slice_part(o_ptr, m_ptr, pid_bh, 0, n_used, NUM_SPLITS, r, d, BLOCK_R, D, CACHE)
                f_m1, f_o1 = _slice_part(o_ptr, m_ptr, pid_bh, 1, n_used, NUM_SPLITS, r, d, BLOCK_R, D, CACHE)
                if MERGE_UN == 4:
                    f_m2, f_o2 = _slice_part(o_ptr, m_ptr, pid_bh, 2, n_used, NUM_SPLITS, r, d, BLOCK_R, D, CACHE)
                    f_m3, f_o3 = _slice_part(o_ptr, m_ptr, pid_bh, 3, n_used, NUM_SPLITS, r, d, BLOCK_R, D, CACHE)
            m_max = tl.max(m_all, axis=0)  # [BLOCK_R]
            m_use = tl.where(m_max == float("-inf"), 0.0, m_max)  # rows that see nothing (padding rows)
            l_run = tl.sum(l_all * tl.exp(m_all - m_use[None, :]), axis=0)
            acc = tl.zeros([BLOCK_R, D], tl.float32)
            first = 0
            if MERGE_UN >= 2 and FIRST:  # the same sums in the same order as the loop's first iteration
                acc += f_o0 * tl.exp(f_m0 - m_use)[:, None]
                acc += f_o1 * tl.exp(f_m1 - m_use)[:, None]
                if MERGE_UN == 4:
                    acc += f_o2 * tl.exp(f_m2 - m_use)[:, None]
                    acc += f_o3 * tl.exp(f_m3 - m_use)[:, None]
                first = MERGE_UN
            if MERGE_UN >= 2:  # loads of MERGE_UN slices first, then their sums in slice order (as the loop's)
                for s0 in range(first, n_used, MERGE_UN):
                    m_0, o_0 = _slice_part(o_ptr, m_ptr, pid_bh, s0, n_used, NUM_SPLITS, r, d, BLOCK_R, D, CACHE)
                    m_1, o_1 = _slice_part(o_ptr, m_ptr, pid_bh, s0 + 1, n_used, NUM_SPLITS, r, d, BLOCK_R, D,
                                           CACHE)
                    if MERGE_UN == 4:
                        m_2, o_2 = _slice_part(o_ptr, m_ptr, pid_bh, s0 + 2, n_used, NUM_SPLITS, r, d, BLOCK_R, D,
                                               CACHE)
                        m_3, o_3 = _slice_part(o_ptr, m_ptr, pid_bh, s0 + 3, n_used, NUM_SPLITS, r, d, BLOCK_R, D,
                                               CACHE)
                    acc += o_0 * tl.exp(m_0 - m_use)[:, None]
                    acc += o_1 * tl.exp(m_1 - m_use)[:, None]
                    if MERGE_UN == 4:
                        acc += o_2 * tl.exp(m_2 - m_use)[:, None]
                        acc += o_3 * tl.exp(m_3 - m_use)[:, None]
            else:
                for s in range(0, n_used):
                    part = (pid_bh * NUM_SPLITS + s) * BLOCK_R
                    m_s = tl.load(m_ptr + part + r, cache_modifier=CACHE)
                    o_s = tl.load(o_ptr + (part + r)[:, None] * D + d[None, :], cache_modifier=CACHE)
                    acc += o_s * tl.exp(m_s - m_use)[:, None]
        _store_out(out_ptr, acc, l_run, r, d, b, hk, row0, so_b, so_h, so_t, T, G)

    @triton.jit
    def _store_out(out_ptr, acc, l_run, r, d, b, hk, row0, so_b, so_h, so_t, T, G):
        """The softmax's end for rows r (row0 + r = (query head j, token t)): acc / l_run into the output, rows past
        the group's G * T masked (their l_run may be 0)."""
        valid = row0 + r < G * T
        out = acc / tl.where(valid, l_run, 1.0)[:, None]
        j = (row0 + r) // T
        t = (row0 + r) % T
        tl.store(out_ptr + b * so_b + (hk * G + j)[:, None] * so_h + t[:, None] * so_t + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=valid[:, None])

    @triton.jit
    def _store_single(out_ptr, m_i, l_i, acc, b, hk, row0, so_b, so_h, so_t, T, G, D: tl.constexpr,
                      BLOCK_R: tl.constexpr):
        """`_merge_store` of one slice's partial (m_i, l_i, acc) held in registers (SINGLE_DIRECT): the merge's
        scalings e^(m - M) with M = this slice's maximum (rows that see nothing: M = 0), the same operations on the
        same values, so the same output bits, without the partial's round trip through memory."""
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, D)
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        w = tl.exp(m_i - m_use)
        l_run = l_i * w
        acc = acc * w[:, None]
        _store_out(out_ptr, acc, l_run, r, d, b, hk, row0, so_b, so_h, so_t, T, G)
