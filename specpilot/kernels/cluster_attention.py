"""The one-token decode attention with its key slices merged inside a thread-block cluster (Hopper, sm_90+).

Why: the one-launch kernel (kernels/decode_attention.py) publishes each slice's partial softmax to global memory,
counts itself in with a gpu-scope atomic, and the last program to arrive reads every partial back from L2 and
merges them. At the 1.5B shape that chain is ~3.2 us of the attention's ~8.3 us a layer on an H100 (session 41's
trace: stores, barrier and atomic 1.15, merge 2.0), three L2 round trips in a row that do not shrink with HBM
bandwidth, so they weigh more on an H200. Here the programs of one KV head's slices form a cluster of C CTAs
(C = CLUSTER: 4, 8 or 16), which Hopper schedules together on one GPC. Each CTA puts its partial (the running max,
sum and fp32 accumulator of the query rows) in its own shared memory; one cluster barrier; then CTA r reads the
partials of all C CTAs through distributed shared memory (`ld.shared::cluster`, SM to SM inside the GPC) for its
D / C columns only, merges them and stores those columns of the output. A second cluster barrier (arrival once the
reads are done, the wait just before the CTA ends) keeps every CTA, and so its shared memory, alive until the
others have read it. No global partials, no atomic, no L2 round trip.

When the context needs more slices than a cluster holds (more than C * SPLIT_S keys), the working clusters each
merge into one partial, publish it as the one-launch kernel's slices do (global stores, CTA barrier, acq_rel
atomic: every CTA counts itself in, C a cluster), and the last CTA to arrive merges the clusters' partials. So any
context length works in one static launch (a CUDA graph), and a context within one cluster takes no atomic.

Scope: one token (T == 1), one row block (G <= 16 query heads a KV head), D <= 256, a CUDA GPU of compute
capability 9.0+ and a Triton whose compiled kernels carry `packed_metadata` (num_warps, num_ctas, shared): the
launch asks for the cluster through that tuple (`_cluster_launch`), because Triton's own `num_ctas` changes how a
program's tensors are laid out over CTAs. Anything else takes decode_attention's kernel (`applies`).

Measured (session 42, H100s, graphed one-token step, random bf16 weights, BENCHMARKS.md): the 1.5B attention 8.3 ->
5.5 us a layer; with C = 8 the step 4.2-5.2% faster at 512 tokens, 1.4-2.0% at 2048, Qwen3-8B 1.2-1.7% (C = 16:
-4.8% at 2048 tokens, but slower at 512 and +1.6% at Qwen3-8B, whose 8 KV heads make 8 clusters of 16; C = 4:
+3.2% at 512). EngineConfig.attn_cluster: 8. Not yet timed on an H200.

Numbers: the slice sums are decode_attention's (`_slice_partial`, the same code); the merge adds the C partials of a
cluster as a tree (tl.sum) where the one-launch kernel adds its slices in order, so results may differ from it in
the last fp32 bits (not bit-identical; tokens are checked by the GPU engine check's `attn_cluster` section).
Nothing here runs under the Triton interpreter (inline PTX): tests/cluster_ptx.py compiles it for sm_90 on CPU.
"""

from __future__ import annotations

import os
import warnings

import torch

from specpilot.kernels import trace

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.attention_parts import (_kv_l2_hint, _preload_slice, _queries, _slice_partial,
                                                   _slice_partial_preloaded, _store_out)
    from specpilot.kernels.pdl import gdc_launch_dependents, gdc_wait
    from specpilot.kernels.trace import cycles as _tr_cycles, now as _tr_now, record as _tr_record
except ImportError:  # CPU-only installs
    triton = None

SIZES = (4, 8, 16)  # CTAs a cluster may hold (16: non-portable, allowed on H100 / H200)
CLUSTER = 0  # EngineConfig.attn_cluster (8 by default, set on CUDA by the engine): CTAs a cluster; 0: decode_attention's
# kernel (this module's default, as the CPU tests run)
# Bytes of each CTA's shared buffer for its partial: rows x (D + 2) fp32 (accumulator, max, sum). Two static sizes,
# because PTX declares the buffer with a literal size: SMALL covers 8 rows of 128 (the 1.5B and 8B shapes), LARGE
# 16 rows of 256.
SMALL_BYTES = 4352
LARGE_BYTES = 16 * 258 * 4
PUSH_SMALL_BYTES = 5120  # PUSH's buffer: rows x (D + 2 C) fp32 (C slots of D / C columns, max and sum); 16 x 288 large
PUSH = False  # EngineConfig.attn_cluster_push: each CTA stores its partial's columns into the CTA that merges them
# (`st.shared::cluster`, not waited for), so after the one barrier every read is of the CTA's own shared memory: no
# distributed-memory read round trip and no second barrier. Off: one H100 call (session 42) put it at -0.7 / -0.2 /
# -0.4% (1.5B at 512 / 2048 tokens, Qwen3-8B), inside a round's spread; searched by the loop
EVEN = False  # EngineConfig.attn_cluster_even: one cluster takes every visible key, each CTA ceil(tiles / C) whole
# BLOCK_S tiles (attn_split_keys unused), so no context needs a second cluster or the atomic merge across clusters.
# Off: SLOWER on an H100 (session 42: 1.5B +2.1 to +4.6%; a CTA walks its tiles one after the other)
_unsupported = False  # set once this Triton's compiled kernels turn out to carry no launch tuple (`_cluster_launch`)


def applies(T: int, G: int, D: int, nrb: int, device: torch.device) -> bool:
    """Whether the cluster kernel can take this call (see the module docstring's scope)."""
    if (not CLUSTER or _unsupported or triton is None or device.type != "cuda" or T != 1 or nrb != 1 or G > 16
            or D > 256):
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0) and D % CLUSTER == 0


if triton is not None:

    @triton.jit
    def _part_base(LARGE: tl.constexpr):
        """The shared-memory address (shared window) of this CTA's partial buffer, a static PTX declaration."""
        if LARGE:
            return tl.inline_asm_elementwise("{ .shared .align 16 .b8 spc_part_l[16512]; mov.u32 $0, spc_part_l; }",
                                             "=r", [], dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("{ .shared .align 16 .b8 spc_part_s[4352]; mov.u32 $0, spc_part_s; }",
                                             "=r", [], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _st_shared(addr, val, keep):
        """Store fp32 `val` at shared address `addr` where `keep` != 0 (elementwise)."""
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.shared.f32 [$1], $2; } mov.u32 $0, 0;",
            "=r,r,f,r", [addr, val, keep], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _ld_peer(addr, peer):
        """fp32 at shared address `addr` of cluster CTA `peer` (elementwise; `peer` may be this CTA)."""
        return tl.inline_asm_elementwise(
            "{ .reg .u32 ra; mapa.shared::cluster.u32 ra, $1, $2; ld.shared::cluster.f32 $0, [ra]; }",
            "=f,r,r", [addr, peer], dtype=tl.float32, is_pure=False, pack=1)

    @triton.jit
    def _push_base(LARGE: tl.constexpr):
        """The shared buffer the other CTAs push their partials' columns into (PUSH), a static PTX declaration."""
        if LARGE:
            return tl.inline_asm_elementwise("{ .shared .align 16 .b8 spc_push_l[18432]; mov.u32 $0, spc_push_l; }",
                                             "=r", [], dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("{ .shared .align 16 .b8 spc_push_s[5120]; mov.u32 $0, spc_push_s; }",
                                             "=r", [], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _st_peer(addr, peer, val, keep):
        """Store fp32 `val` at shared address `addr` of cluster CTA `peer` where `keep` != 0 (elementwise; a remote
        store is not waited for: the next cluster barrier's release orders it)."""
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 ra; setp.ne.s32 p, $4, 0; mapa.shared::cluster.u32 ra, $1, $2; "
            "@p st.shared::cluster.f32 [ra], $3; } mov.u32 $0, 0;",
            "=r,r,r,f,r", [addr, peer, val, keep], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _ld_shared(addr):
        """fp32 at shared address `addr` of this CTA (elementwise)."""
        return tl.inline_asm_elementwise("ld.shared.f32 $0, [$1];", "=f,r", [addr], dtype=tl.float32, is_pure=False,
                                         pack=1)

    @triton.jit
    def _cluster_sync():
        """Every thread of the cluster arrives (release) and waits (acquire): shared stores before it are seen by
        every CTA's loads after it."""
        return tl.inline_asm_elementwise(
            "barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; mov.u32 $0, 0;",
            "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _cluster_arrive():
        """This thread's arrival at the cluster barrier (release: its loads and stores before it are done first)."""
        return tl.inline_asm_elementwise("barrier.cluster.arrive.release.aligned; mov.u32 $0, 0;", "=r", [],
                                         dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _cluster_arrive_relaxed():
        """This thread's arrival at the cluster barrier, with no memory ordering (a "the CTA is running" signal)."""
        return tl.inline_asm_elementwise("barrier.cluster.arrive.relaxed.aligned; mov.u32 $0, 0;", "=r", [],
                                         dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _cluster_wait():
        """Wait until every thread of the cluster has arrived (acquire)."""
        return tl.inline_asm_elementwise("barrier.cluster.wait.acquire.aligned; mov.u32 $0, 0;", "=r", [],
                                         dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _cluster_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, m_ptr, l_ptr, out_ptr, cnt_ptr,
                        sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sp_b, so_b, so_h, so_t,
                        H_KV, S, G, SPLIT_S, NUM_SPLITS, NUM_GROUPS, scale,
                        D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, PREC: tl.constexpr,
                        C: tl.constexpr, MR: tl.constexpr, GROUPS_P2: tl.constexpr, LARGE: tl.constexpr,
                        USE_PDL: tl.constexpr = False, EARLY_POS: tl.constexpr = False,
                        PRELOAD: tl.constexpr = False, PRE_NB: tl.constexpr = 1, FIRST: tl.constexpr = False,
                        EVEN: tl.constexpr = False, KV_L2: tl.constexpr = False, PUSH: tl.constexpr = False,
                        TRACE: tl.constexpr = False, tr_ptr=None):
        # grid (B * H_KV * C, NUM_GROUPS), launched as clusters of C consecutive programs along x: the cluster
        # (pid_bh, grp) holds slices grp * C .. grp * C + C - 1 of (b, hk), CTA rank r (= %cluster_ctarank) slice
        # grp * C + r. USE_PDL / EARLY_POS / PRELOAD / PRE_NB / FIRST: decode_attention's `_split_merge_kernel`.
        if TRACE:
            t_start = _tr_now()
        pid_x = tl.program_id(0)
        grp = tl.program_id(1)
        rank = pid_x % C
        pid_bh = pid_x // C
        b = pid_bh // H_KV
        hk = pid_bh % H_KV
        pid_s = grp * C + rank
        if PUSH:  # "started": a CTA may store into another's shared memory only once that one runs (CUDA's rule);
            _cluster_arrive_relaxed()  # waited for just before the pushes, long after every CTA has arrived here
        if USE_PDL:
            gdc_launch_dependents()
            if KV_L2:  # this slice's K/V rows asked of L2 before the wait (decode_attention.PDL_KV_L2: a hint)
                _kv_l2_hint(k_ptr, v_ptr, pos_ptr, b, hk, pid_s * SPLIT_S, sk_b, sk_h, sv_b, sv_h, sp_b, S, 1, SPLIT_S,
                            D)
            if EARLY_POS:
                early_max = tl.load(pos_ptr + b * sp_b)  # T == 1 (see decode_attention.PDL_EARLY_POS)
        if PRELOAD:
            if USE_PDL and EARLY_POS:
                p_pre = early_max
            else:
                p_pre = tl.load(pos_ptr + b * sp_b)
            ka, va, kb2, vb2 = _preload_slice(k_ptr, v_ptr, b, hk, pid_s * SPLIT_S, p_pre, S, sk_b, sk_h, sk_s,
                                              sv_b, sv_h, sv_s, D, BLOCK_S, PRE_NB)
        if USE_PDL:
            gdc_wait()
        if TRACE:
            t_waited = _tr_now()
            c_waited = _tr_cycles()
            t_looped = t_waited
            t_summed = t_waited
            tag = tl.full([], 0, tl.int32)
        q, pos, max_pos = _queries(q_ptr, pos_ptr, b, hk, 0, sq_b, sq_h, sq_t, sp_b, 1, G, D, BLOCK_R, False)
        if USE_PDL and EARLY_POS:
            max_pos = early_max
        if EVEN:  # one cluster (grid y 1): the visible keys' BLOCK_S tiles dealt out evenly, whole tiles a CTA
            tiles = max_pos // BLOCK_S + 1
            split = (tiles + C - 1) // C * BLOCK_S
            n_used = max_pos // split + 1
        else:
            split = SPLIT_S
            n_used = tl.minimum(max_pos // SPLIT_S + 1, NUM_SPLITS)  # slices at or below the position
        n_grp = (n_used + C - 1) // C  # clusters holding them; the others exit (no barrier waits on them)
        if grp < n_grp:
            r = tl.arange(0, BLOCK_R)
            d = tl.arange(0, D)
            if pid_s < n_used:
                if PRELOAD:
                    m_i, l_i, acc = _slice_partial_preloaded(q, pos, ka, va, kb2, vb2, k_ptr, v_ptr, b, hk,
                                                             pid_s * SPLIT_S, max_pos, sk_b, sk_h, sk_s, sv_b,
                                                             sv_h, sv_s, S, scale, D, BLOCK_R, BLOCK_S, PREC,
                                                             False, PRE_NB)
                else:
                    m_i, l_i, acc = _slice_partial(q, pos, k_ptr, v_ptr, b, hk, pid_s * split, sk_b, sk_h, sk_s,
                                                   sv_b, sv_h, sv_s, S, split, scale, D, BLOCK_R, BLOCK_S, PREC,
                                                   False, V_FIRST=FIRST)
            else:  # a CTA of a working cluster past the last slice: an empty partial (weight e^-inf = 0)
                m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_R], tl.float32)
                acc = tl.zeros([BLOCK_R, D], tl.float32)
            if TRACE:
                t_summed = _tr_now()
            DC: tl.constexpr = D // C
            rr = tl.arange(0, MR)
            dc = rank * DC + tl.arange(0, DC)
            j = tl.arange(0, C)
            keep = r < MR
            if PUSH:  # each CTA sends CTA t its columns [t * DC, t * DC + DC) and its max and sum, slot `rank`
                base = _push_base(LARGE)
                ml = C * MR * DC  # the maxima's slots [C, MR] follow the accumulators' [C, MR, DC], then the sums'
                t = d // DC
                _cluster_wait()  # every CTA of the cluster has started (arrived first thing)
                _st_peer(base + ((rank * MR + r[:, None]) * DC + (d % DC)[None, :]) * 4, t[None, :] + r[:, None] * 0,
                         acc, (keep[:, None] & (d[None, :] >= 0)).to(tl.int32))
                peer_t = j[None, :] + r[:, None] * 0  # [BLOCK_R, C]: every CTA gets every row's max and sum
                _st_peer(base + (ml + rank * MR + r[:, None] + j[None, :] * 0) * 4, peer_t,
                         m_i[:, None] + (j * 0).to(tl.float32)[None, :], (keep[:, None] & (j >= 0)[None, :]).to(tl.int32))
                _st_peer(base + (ml + C * MR + rank * MR + r[:, None] + j[None, :] * 0) * 4, peer_t,
                         l_i[:, None] + (j * 0).to(tl.float32)[None, :], (keep[:, None] & (j >= 0)[None, :]).to(tl.int32))
                _cluster_sync()  # every push has landed; the reads below are this CTA's own memory
                c3 = tl.arange(0, DC)
                o_c = _ld_shared(base + ((j[:, None, None] * MR + rr[None, :, None]) * DC + c3[None, None, :]) * 4)
                m_c = _ld_shared(base + (ml + j[:, None] * MR + rr[None, :]) * 4)
                l_c = _ld_shared(base + (ml + C * MR + j[:, None] * MR + rr[None, :]) * 4)
            else:
                # this CTA's partial into its shared buffer: acc rows [0, MR) at (r * D + d) * 4, then m and l
                base = _part_base(LARGE)
                _st_shared(base + (r[:, None] * D + d[None, :]) * 4, acc,
                           (keep[:, None] & (d[None, :] >= 0)).to(tl.int32))
                _st_shared(base + (MR * D + r) * 4, m_i, keep.to(tl.int32))
                _st_shared(base + (MR * D + MR + r) * 4, l_i, keep.to(tl.int32))
                _cluster_sync()
                # columns [rank * DC, rank * DC + DC) of every CTA's partial, in one elementwise load each
                peer3 = j[:, None, None] + (rr[None, :, None] + dc[None, None, :]) * 0  # [C, MR, DC]
                o_c = _ld_peer(base + (rr[None, :, None] * D + dc[None, None, :]) * 4 + peer3 * 0, peer3)
                peer2 = j[:, None] + rr[None, :] * 0  # [C, MR]
                m_c = _ld_peer(base + (MR * D + rr[None, :]) * 4 + peer2 * 0, peer2)
                l_c = _ld_peer(base + (MR * D + MR + rr[None, :]) * 4 + peer2 * 0, peer2)
            m_max = tl.max(m_c, axis=0)  # [MR]
            m_use = tl.where(m_max == float("-inf"), 0.0, m_max)  # rows that see nothing (padding rows)
            w = tl.exp(m_c - m_use[None, :])
            l_run = tl.sum(l_c * w, axis=0)
            acc_c = tl.sum(o_c * w[:, :, None], axis=0)  # [MR, DC]
            if not PUSH:
                # this CTA's reads of the others' buffers are done (the sums used them): it says so now and waits
                # for the others' word only before it leaves (a CTA's shared memory must outlive the reads of it),
                # so the barrier's round trip overlaps the output's stores. (PUSH: no CTA reads another's memory
                # after the one barrier, so none waits for another to leave.)
                _cluster_arrive()
            if TRACE:
                t_looped = _tr_now()
                tag = tl.full([], 1, tl.int32)
            if n_grp == 1:  # the whole context in this cluster: its columns of the output
                _store_out(out_ptr, acc_c, l_run, rr, dc, b, hk, 0, so_b, so_h, so_t, 1, G)
                if TRACE:
                    tag = tl.full([], 2, tl.int32)
            else:  # publish the cluster's partial (its columns; rank 0 the max and sum) and count in
                part = (pid_bh * NUM_GROUPS + grp) * MR
                tl.store(o_ptr + (part + rr)[:, None] * D + dc[None, :], acc_c)
                if rank == 0:
                    tl.store(m_ptr + part + rr, m_max)
                    tl.store(l_ptr + part + rr, l_run)
                tl.debug_barrier()  # (decode_attention's publish pattern: CTA barrier, then the acq_rel atomic)
                arrived = tl.atomic_add(cnt_ptr + pid_bh, 1, sem="acq_rel", scope="gpu")
                if arrived == n_grp * C - 1:  # every CTA of every working cluster has published its columns
                    g = tl.arange(0, GROUPS_P2)
                    used = g < n_grp
                    rows = (pid_bh * NUM_GROUPS + g)[:, None] * MR + rr[None, :]  # [GROUPS_P2, MR]
                    m_g = tl.load(m_ptr + rows, mask=used[:, None], other=float("-inf"), cache_modifier=".cg")
                    l_g = tl.load(l_ptr + rows, mask=used[:, None], other=0.0, cache_modifier=".cg")
                    o_g = tl.load(o_ptr + rows[:, :, None] * D + d[None, None, :], mask=used[:, None, None],
                                  other=0.0, cache_modifier=".cg")
                    g_max = tl.max(m_g, axis=0)
                    g_use = tl.where(g_max == float("-inf"), 0.0, g_max)
                    wg = tl.exp(m_g - g_use[None, :])
                    _store_out(out_ptr, tl.sum(o_g * wg[:, :, None], axis=0), tl.sum(l_g * wg, axis=0), rr, d, b,
                               hk, 0, so_b, so_h, so_t, 1, G)
                    tl.store(cnt_ptr + pid_bh, 0)  # back to zero for the next launch
                    if TRACE:
                        tag = tl.full([], 2, tl.int32)
            if not PUSH:
                _cluster_wait()
        if TRACE:
            _tr_record(tr_ptr, pid_bh * (NUM_GROUPS * C) + pid_s, t_start, t_waited, t_looped, c_waited, tag,
                       t_summed)


def _pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def _cluster_launch(kernel, grid, args, kwargs, ctas: int) -> bool:
    """Launch `kernel` over `grid` programs as clusters of `ctas` consecutive programs along x -> whether it did.
    Triton's launcher asks for a cluster when the compiled kernel's packed metadata says num_ctas > 1 (and multiplies
    grid x by it), so the kernel is compiled first (`warmup`, no launch) and its tuple (num_warps, num_ctas, shared)
    rewritten. A Triton without that tuple launches nothing: a warning, once, and the caller's one-launch kernel from
    then on (the switch is on by default, so where it cannot work it must not fail)."""
    global _unsupported
    compiled = kernel.warmup(*args, grid=(grid[0] // ctas, grid[1]), **kwargs)
    meta = getattr(compiled, "packed_metadata", None)
    if not (isinstance(meta, tuple) and len(meta) == 3):
        _unsupported = True
        warnings.warn("attn_cluster: this Triton's compiled kernels carry no (num_warps, num_ctas, shared) launch "
                      "tuple, so no cluster can be asked for; the one-token attention merges without one", stacklevel=3)
        return False
    if meta[1] != ctas:
        compiled.packed_metadata = (meta[0], ctas, meta[2])
    kernel[(grid[0] // ctas, grid[1])](*args, **kwargs)
    return True


def cluster_attention(q, k, v, pos, out, counters, split_s: int, block_s: int, scale: float, pdl, *,
                      early_pos: bool, preload: bool, loads_first: bool, kv_l2: bool = False,
                      launch: dict | None = None) -> torch.Tensor | None:
    """decode_attention(one_launch=True) for one token through `_cluster_kernel` (the caller checked `applies`);
    None where the launch could not ask for a cluster (`_cluster_launch`): the caller runs its own kernel then.
    q [B, H, 1, D], k / v [B, Hkv, S, D], pos [B, 1] contiguous, out [B, H, 1, D] (written), `counters` >= B * Hkv
    zero int32 (decode_attention's, left at zero), `pdl` kernels/pdl.py's launch options, `launch`
    the num_warps / num_stages the one-launch kernel takes."""
    B, H, _, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    C = CLUSTER
    rows = 16 if G <= 16 else 32
    mr = _pow2(G)
    splits = triton.cdiv(S, split_s)
    groups = 1 if EVEN else triton.cdiv(splits, C)
    o = torch.empty(B * Hkv * groups * mr, D, dtype=torch.float32, device=q.device)
    m = torch.empty(B * Hkv * groups * mr, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    preload = preload and not EVEN  # (EVEN: a CTA's key count is known only behind the wait)
    pre_nb = split_s // block_s
    tr = trace.launch_args(q.device, "attention Hkv={} splits={}".format, Hkv, splits)
    args = (q, k, v, pos, o, m, l, out, counters, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
            k.stride(2), v.stride(0), v.stride(1), v.stride(2), pos.stride(0), out.stride(0), out.stride(1),
            out.stride(2), Hkv, S, G, split_s, splits, groups, scale)
    kwargs = dict(D=D, BLOCK_R=rows, BLOCK_S=block_s, PREC="ieee" if q.dtype == torch.float32 else "tf32", C=C,
                  MR=mr, GROUPS_P2=_pow2(groups),
                  LARGE=mr * (D + 2 * C) * 4 > PUSH_SMALL_BYTES if PUSH else mr * (D + 2) * 4 > SMALL_BYTES,
                  USE_PDL=pdl.use_pdl,
                  EARLY_POS=pdl.use_pdl and early_pos, PRELOAD=preload, PRE_NB=pre_nb if preload else 1,
                  FIRST=loads_first, EVEN=EVEN, KV_L2=kv_l2 and not EVEN, PUSH=PUSH, **pdl.kwargs, **tr)
    kwargs.update(launch or {})  # num_warps / num_stages, as decode_attention launches its own kernel
    return out if _cluster_launch(_cluster_kernel, (B * Hkv * C, groups), args, kwargs, C) else None
