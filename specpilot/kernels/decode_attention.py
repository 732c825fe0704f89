"""Attention for decode and verification steps (T <= 16 new tokens) over the KV pool, split along the keys.

Why: the step's queries are few, so SDPA with a boolean mask keeps only a handful of thread blocks busy per layer
and reads the whole pool even where the causal mask hides it. Measured on the H200: 0.08 ms per layer for
B 1, T 1 over a 4096-slot pool (28 layers: ~2.3 ms, three times the 1.5B step's bandwidth floor; BENCHMARKS.md).
Here each program takes one KV head, all the query heads that share it (GQA: K/V are read once for the group)
and all T tokens, over one slice of the keys ("split-KV", as in flash-decoding); slices entirely above the
largest query position exit at once, so the work follows the real context length although the pool's shape is
static (CUDA graphs). A second kernel merges the slices' partial softmaxes (two launches per layer in all),
looping over the slices below the largest position only (session 9 measured the kernel slower than SDPA at
T = 1 on the H200, 512 tokens in a 4096-slot pool, when the merge still walked all 32 slices serially).

One launch (`one_launch=True`): at 1.5B-class shapes a bs-1 step is launch/latency bound, and the merge kernel
(~5.9 us at the 0.5B shape: B * Hkv = 2 programs, serial over the slices) costs more than the split kernel
(~3.7 us). So each working program publishes its partial and counts itself in with an atomic on a per-(b, kv head)
counter; the one that arrives last merges (the same code, so the same numbers) and zeroes the counter again. The
counters are one zero-initialised buffer per device, allocated on first use, never per call (see `_counters`).

Cluster (EngineConfig.attn_cluster, 8 by default on CUDA since session 42): on Hopper a one-token call of the one-launch
path goes to kernels/cluster_attention.py instead, whose slices of a KV head merge inside a thread-block cluster
through distributed shared memory (no partials in global memory, no atomic).

The Triton pieces (a program's queries, a slice's partial softmax, the merge in slice order) are
kernels/attention_parts.py's, shared with the cluster kernel, RoPE + attention and the one-launch step.

Mask: key slot j is visible to a query at position p iff j <= p (slot p = position p, models/cache.py), the
DenseLM's positional causal mask, computed in the kernel from `positions` instead of read from a mask tensor.

`decode_attention_reference` is the plain-PyTorch twin the tests compare against (TRITON_INTERPRET=1 runs the
kernel on CPU).
"""

from __future__ import annotations

import math
import os

import torch

from specpilot.kernels import trace  # per-program timelines (a diagnostic, off)
from specpilot.kernels.attention_parts import MAX_T  # the most new tokens a call takes
from specpilot.kernels.scratch import DeviceBuffers

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.attention_parts import (_kv_l2_hint, _merge_store, _preload_slice, _queries,
                                                   _slice_partial, _slice_partial_preloaded, _store_partial,
                                                   _store_single)  # a slice's softmax, the merge
    from specpilot.kernels.gemv_parts import _L2_CHUNK_C, _l2_prefetch_bytes  # bulk L2 prefetches, their size
    from specpilot.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options  # PDL (kernels/pdl.py)
    from specpilot.kernels.trace import cycles as _tr_cycles, now as _tr_now, record as _tr_record  # TRACE
except ImportError:  # CPU-only installs: the reference path only
    triton = None

# Rows (query head in the GQA group x token) one program takes: a 16-token verify block of a 1.5B-class model has
# 6 x 16 = 96 rows per KV head, and one program holding them all (128-row q tile and fp32 accumulator) took 22 us a
# layer on the H200 against 9 us for one token (session 15; ~0.37 ms of a 2.4 ms 16-token step). Row blocks of 32
# spread them over more programs, each re-reading its slice's K/V (from L2). One token (<= 16 rows) is unchanged.
ROWS_PER_PROGRAM = 32
# Under PDL the one-launch kernel (the fused one-token path's) asks L2 for its slice's K and V rows before its wait
# (EngineConfig.pdl_kv_l2): its programs launch as soon as RoPE + K/V write starts, and the keys below the new
# token's slot were written by earlier steps, so they can stream from HBM into L2 while RoPE runs; after the wait
# the slice's loads are L2 hits instead of DRAM round trips. A hint only: the range comes from a read of the
# positions before the wait, clamped to the pool, and nothing read before the wait is used after it (the kernel
# re-reads the positions, then every K/V row, behind the wait as before), so the numbers cannot change. Off:
# SLOWER on the H200 (session 27, graphed one-token step: Qwen3-8B +1.5% / +1.6%, 1.5B +6%; exact).
PDL_KV_L2 = False
# Under PDL the one-launch kernel reads the positions before its wait (EngineConfig.attn_early_pos) and takes from
# them which slices hold visible keys, so its K/V loads need not wait one DRAM round trip for the positions after the
# wait. Why that read may precede the wait (kernels/pdl.py's rule keeps activations, the KV cache and positions
# behind it): the positions are the step's input, written before the CUDA graph is launched (engine/runner.py:
# a device-side add on the stream ahead of the replay) and by no kernel of the step, so no predecessor can still be
# writing them; the buffer is a static graph input, never one the allocator hands a later kernel. The kernel still
# reads them again behind the wait for the masks. Same numbers. The engine turns it on with PDL (session 28, H200:
# 1.5B one-token step -0.6 to -1.4%, Qwen3-8B within noise); this module default stays off, as PDL's.
PDL_EARLY_POS = False
# The one-launch kernel at T = 1 loads its slice's OLDER K/V rows (key slots below the token's own) into registers
# first thing, before its PDL wait (EngineConfig.attn_kv_preload), and after the wait only q and the new token's
# own K/V row, written by the kernel ahead (kernels/qkv_rope.py or rope_write.py), which replaces slot p in the
# preloaded tiles. Why: the older rows were written by earlier steps, so their DRAM round trips need not sit between
# the wait and the softmax; session 27's L2 hint for the same rows (PDL_KV_L2) left an L2 round trip there and was
# no faster. Why the early read is safe: it needs every kernel before the one ahead to have completed, which the late
# trigger guarantees (kernels/pdl.py: the GEMV ahead triggers after its own wait, so everything before it is done;
# RoPE + K/V write, which triggers first thing, only follows the qkv GEMV); with the "start" trigger a deep chain of
# early launches could still be running, so the host turns the preload off there. Rows at or above p are masked to
# 0 before the wait (the cache's stale rows there only ever meet a zero softmax weight), so the numbers equal the
# loop's. With qkv + RoPE triggering first (kernels/qkv_rope.py TRIGGER_FIRST) the attention is resident while qkv
# and the down GEMV ahead of it may still run: neither writes a slot below p (qkv writes slot p, down the residual),
# and down triggers late, so everything before it has completed. Off: not faster on the H200 (session 35, graphed
# one-token step: 1.5B with 8 warps +1.3 / +2.4% in a steady 8-round call, Qwen3-8B -0.6 to -0.8%, within that
# call's drift of 0.8%), but its programs were resident only after qkv's last end there (session 37 trace); the
# loop searches it (`attn_kv_preload`).
KV_PRELOAD = False
# Warps a program of the one-launch kernel runs (0: Triton's default, 4). Compiled for sm_90 it holds 255 registers
# a thread with 4 warps and spills (32 B a thread; 1.4 KB with KV_PRELOAD's two blocks, 0.3 KB with one); with 8:
# no spill (209 registers with one preloaded block, 200 B spilled with two). EngineConfig.attn_warps. 8 is no faster
# on the H200 (session 35: 1.5B +0.3%, Qwen3-8B -0.7%, within the drift): the spill was not what the time is.
ONE_LAUNCH_WARPS = 0
# Software-pipeline stages of the one-launch kernel's (and the cluster kernel's) slice loop (0: Triton's default, 3;
# EngineConfig.attn_stages). Why: compiled for sm_90 with the JIT's alignment facts, the loop's K and V tiles go to
# shared memory by cp.async, one buffer a stage, so the default's 3 stages take 136 KB of shared memory a program
# (2: 72 KB, 1: 40 KB, with K and V loaded through registers) for a loop that runs once at 128 keys a program: room
# the qkv and o_proj programs around it under PDL, and a cluster's 8 SMs, must leave free. Same sums in the same
# order whatever the stages. Off until a GPU times it (session 42, compiled only)
ONE_LAUNCH_STAGES = 0
# The last-arriving program of the one-launch kernel reads the slices' accumulators MERGE_CHUNK at a time (one L2
# round trip a chunk: `_merge_chunks`) instead of one slice at a time (one round trip a slice: at 512 tokens and
# 64 keys a program, 8 dependent L2 reads before the output is stored). EngineConfig.attn_merge_chunk; 0: the loop.
# Another summation order of the same fp32 partials. H200 (session 28): 8 faster at Qwen3-8B (-1.5 to -2.9%), slower
# at 1.5B (+1.6 to +3.5%): off by default, searched by the loop.
MERGE_CHUNK = 0
# The last-arriving program's merge loop issues MERGE_UNROLL slices' loads (their maxima and [rows, D] accumulators,
# plain 2-D tiles as the loop's) before it sums the first of them, then sums them in slice order
# (EngineConfig.attn_merge_unroll; 0: the loop, one slice an iteration). Why: the session-39 traces put the merge at
# 2.4-2.6 us a layer at both shapes (H100, 4-5 slices at 512 tokens): a slice's L2 round trip each, because each
# iteration's sum waits for its loads before the next iteration's are issued. MERGE_CHUNK's [chunk, rows, D] tiles
# cost more than that at 1.5B in every form (+2 to +14%), and they sum in another order; here every slice is added
# to the accumulator in the same order with the same operations as the loop (a slice past the last used adds
# 0 x e^-inf = 0), so the output is the loop's, bit for bit (tests). MERGE_CHUNK, when set, takes precedence.
# The engine sets 4 on CUDA (the EngineConfig default since session 40, H100: the merge 2.43 -> 2.08 us a layer,
# the 1.5B step -0.2 to -2.9% at 256-2048 tokens, Qwen3-8B -0.1 / -0.4%); this module default stays the loop.
MERGE_UNROLL = 0
# The one-token attention issues loads ahead of the reductions that do not feed them (EngineConfig.attn_loads_first):
# a block's V rows together with its K rows, before the scores' row maxima (`_slice_partial`; otherwise V is asked
# for only after them: a second DRAM round trip in every slice), and, with MERGE_UNROLL, the merge's first slices'
# partials together with the maxima and sums, before their reductions (a third L2 round trip otherwise). Why: a
# reduction across warps goes through shared memory behind a barrier, and no load after it is issued before it. The
# same operations on the same values in the same order, so the same bits (tests).
LOADS_FIRST = False
# A verify block's attention (the two-launch split + merge path, T > 1) warms the NEXT GEMV's weight (o_proj, which
# the caller hands over as `warm`) in L2 when it is at most this many bytes: every split program issues bulk L2
# prefetches of its share of it first thing, so the weight streams in while the attention (latency-bound: HBM
# mostly idle) runs, and o_proj's M-row GEMV reads it from L2. The one-token path does this from o_proj's side
# (kernels/gemv_fused.py PDL_L2_MAX_BYTES: its programs are resident under PDL); the verify path's attention pair
# launches without PDL, so o_proj cannot. A hint: nothing comes back, the numbers cannot change.
# EngineConfig.verify_l2_mb sets it (engine._apply_program_splits); 0: off. Neutral on the H200 (session 29, 1.5B
# graphed verify steps: 5 tokens +0.3%, 16 tokens +0.4%): off, searched by the loop.
VERIFY_WARM_MAX_BYTES = 0
# A verify block's attention (T > 1) runs the one-launch kernel instead of the split + merge pair
# (EngineConfig.verify_one_launch): the last program of each (KV head, row block) to finish merges, and under PDL the
# launch follows RoPE + K/V write early, as the one-token path's does. Why: the one-token step has had PDL and one
# launch a layer for its attention since sessions 12 and 26, the T-row path has not, and on an H100 (session 50) the
# real 1.5B's 16-token verify took 2.07 ms against 1.48 ms for a whole AR token. The same 128-key slices in 64-key
# steps and the same merge code as the pair: the same numbers (tests/test_decode_attention.py). VERIFY_WARM_MAX_BYTES
# (the pair's split kernel warming o_proj) does not apply then. H100, session 50: the 1.5B 16-token step -4.4% (two
# calls), 5 tokens -4.1%, Qwen3-8B -0.9%; off until a GPU engine check compares its tokens; the loop searches it.
VERIFY_ONE_LAUNCH = False
# The one-launch kernel's only working slice (the context fits in one program's keys: n_used == 1) stores the output
# itself, without publishing a partial, the atomic arrival and the merge's reads of what it just wrote
# (EngineConfig.attn_single_direct). Why: the session-37 trace put the 1.5B one-token attention at 8.1 us a layer
# for a 0.17 us floor, nearly all of it the chain after the slices' loads (stores, a gpu-scope release, the atomic,
# the last arrival's L2 reads); with one slice that chain merges one partial into itself. With attn_split_keys
# 256-512 a context up to that many keys takes this path (one program a KV head streams the whole slice, its loads
# pipelined by the tl.dot loop). The same operations on the same values as the merge (e^(m - m) = 1 scalings),
# so the same bits (tests). Off: SLOWER on an H100 (session 39, graphed one-token step: 1.5B +14.2% with 512
# keys, +5.5% with 256; Qwen3-8B +3.1%): the one program took 13.3 us to its store, a 128-key slice 4.9 plus a 2.5 us
# merge; a program's K/V loads are latency-bound, so more programs beat no merge.
SINGLE_DIRECT = False


def decode_attention_reference(q, k, v, positions, scale: float | None = None) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, Hkv, S, D], positions [B, T] -> [B, H, T, D] (fp32 math, q's dtype out)."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = H // Hkv
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    scores = (q.float() @ kf.transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)
    visible = torch.arange(S, device=q.device)[None, None, :] <= positions[:, :, None]  # [B, T, S]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return (scores.softmax(-1) @ vf).to(q.dtype)


if triton is not None:

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, m_ptr, l_ptr,
                      sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sp_b,
                      H_KV, S, T, G, SPLIT_S, NUM_SPLITS, NUM_RB, scale, warm_ptr, warm_span, warm_bytes,
                      D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, PREC: tl.constexpr,
                      UPCAST: tl.constexpr, WARM: tl.constexpr = False):
        # operands stay in the model's dtype (bf16: tensor cores, exact products), accumulation is fp32; PREC
        # "ieee" keeps fp32 models exact instead of TF32. UPCAST (the CPU interpreter only, whose dot mishandles
        # bf16) computes in fp32. WARM (VERIFY_WARM_MAX_BYTES): first, this program's warm_span bytes of the next
        # GEMV's weight (warm_bytes in all, 16-byte multiples) asked of L2 -- every program, those that exit early too.
        pid_bh = tl.program_id(0)  # (b, kv head, row block)
        pid_s = tl.program_id(1)
        if WARM:
            lo = (pid_bh * tl.num_programs(1) + pid_s).to(tl.int64) * warm_span
            n = tl.minimum(warm_bytes - lo, warm_span)
            if n > 0:
                _l2_prefetch_bytes(warm_ptr + lo, n, _L2_CHUNK_C)
        b = pid_bh // NUM_RB // H_KV
        hk = pid_bh // NUM_RB % H_KV
        row0 = pid_bh % NUM_RB * BLOCK_R
        q, pos, max_pos = _queries(q_ptr, pos_ptr, b, hk, row0, sq_b, sq_h, sq_t, sp_b, T, G, D, BLOCK_R, UPCAST)
        start = pid_s * SPLIT_S
        if start <= max_pos:  # a slice wholly above every query position holds nothing visible
            m_i, l_i, acc = _slice_partial(q, pos, k_ptr, v_ptr, b, hk, start, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
                                           S, SPLIT_S, scale, D, BLOCK_R, BLOCK_S, PREC, UPCAST)
            # slices above max_pos store nothing: never merged
            _store_partial(o_ptr, m_ptr, l_ptr, (pid_bh * NUM_SPLITS + pid_s) * BLOCK_R, m_i, l_i, acc, D, BLOCK_R)

    @triton.jit
    def _combine_kernel(o_ptr, m_ptr, l_ptr, pos_ptr, out_ptr, so_b, so_h, so_t, sp_b, H_KV, T, G, SPLIT_S,
                        NUM_SPLITS, NUM_RB, D: tl.constexpr, BLOCK_R: tl.constexpr, SPLITS_P2: tl.constexpr):
        pid_bh = tl.program_id(0)  # (b, kv head, row block)
        b = pid_bh // NUM_RB // H_KV
        row0 = pid_bh % NUM_RB * BLOCK_R
        r = row0 + tl.arange(0, BLOCK_R)  # this block's rows: the split kernel's max_pos is over their tokens
        max_pos = tl.max(tl.load(pos_ptr + b * sp_b + r % T, mask=r < G * T, other=-1), axis=0)
        n_used = tl.minimum(max_pos // SPLIT_S + 1, NUM_SPLITS)
        _merge_store(o_ptr, m_ptr, l_ptr, out_ptr, b, pid_bh // NUM_RB % H_KV, row0, pid_bh, n_used, so_b, so_h,
                     so_t, T, G, NUM_SPLITS, D, BLOCK_R, "", SPLITS_P2)

    @triton.jit
    def _split_merge_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, m_ptr, l_ptr, out_ptr, cnt_ptr,
                            sq_b, sq_h, sq_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sp_b, so_b, so_h, so_t,
                            H_KV, S, T, G, SPLIT_S, NUM_SPLITS, NUM_RB, scale,
                            D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, PREC: tl.constexpr,
                            UPCAST: tl.constexpr, SPLITS_P2: tl.constexpr, USE_PDL: tl.constexpr = False,
                            KV_L2: tl.constexpr = False, MERGE_CH: tl.constexpr = 0, MERGE_R: tl.constexpr = 16,
                            EARLY_POS: tl.constexpr = False, PRELOAD: tl.constexpr = False,
                            PRE_NB: tl.constexpr = 1, SINGLE: tl.constexpr = False, MERGE_UN: tl.constexpr = 0,
                            FIRST: tl.constexpr = False, TRACE: tl.constexpr = False, tr_ptr=None):
        # `_split_kernel`, then the last program of each (b, hk) to finish merges (one launch instead of two)
        # USE_PDL (launched with PDL, kernels/pdl.py; the fused one-token path): the next kernel may launch now;
        # then wait for the previous one before the first load. q, positions and the K/V just written by
        # rope_write all come from earlier kernels; and nothing may be stored (partials, counters, the output)
        # before the wait: the predecessor may still be running, still reading a buffer the allocator handed us.
        # Every program waits, even those that exit early, so the counters of this launch are never touched
        # before the previous attention launch (which left them at zero) has completed.
        # KV_L2 (PDL_KV_L2): before the wait, an L2 prefetch of this slice's K/V rows (a hint: see PDL_KV_L2).
        # EARLY_POS (PDL_EARLY_POS): the positions are read before the wait and decide which slices work, so a
        # working program issues its K/V loads right behind the wait, together with q's, instead of one round trip
        # later (see PDL_EARLY_POS for why that read may precede the wait).
        # MERGE_CH / MERGE_R / MERGE_UN: `_merge_store`.
        # PRELOAD (KV_PRELOAD; T == 1, SPLIT_S = PRE_NB * BLOCK_S): the slice's older K/V rows into registers before
        # the wait (with or without PDL: the same numbers), slot p's row after it (`_slice_partial_preloaded`).
        # SINGLE (SINGLE_DIRECT): the only working slice (n_used == 1) stores the output itself (`_store_single`).
        # FIRST (LOADS_FIRST): loads ahead of the reductions that do not feed them (`_slice_partial`, `_merge_store`).
        # TRACE (kernels/trace.py, a diagnostic): each program's timeline row at its end, tagged 0 (exited early),
        # 1 (a partial) or 2 (a partial and the merge); "looped": when its partial was published (SINGLE: when
        # its sums were done; tagged 2); "summed": when its slice's sums were issued, before the stores.
        if TRACE:
            t_start = _tr_now()
        pid_bh = tl.program_id(0)  # (b, kv head, row block): one counter each
        pid_s = tl.program_id(1)
        b = pid_bh // NUM_RB // H_KV
        hk = pid_bh // NUM_RB % H_KV
        row0 = pid_bh % NUM_RB * BLOCK_R
        if USE_PDL:
            gdc_launch_dependents()
            if KV_L2:
                _kv_l2_hint(k_ptr, v_ptr, pos_ptr, b, hk, pid_s * SPLIT_S, sk_b, sk_h, sv_b, sv_h, sp_b, S, T,
                            SPLIT_S, D)
            if EARLY_POS:
                r = row0 + tl.arange(0, BLOCK_R)
                early_max = tl.max(tl.load(pos_ptr + b * sp_b + r % T, mask=r < G * T, other=-1), axis=0)
        if PRELOAD:  # older rows only: see KV_PRELOAD for why they may be read before the wait
            if USE_PDL and EARLY_POS:
                p_pre = early_max  # T == 1: b's one position, read above
            else:
                p_pre = tl.load(pos_ptr + b * sp_b)  # (a static graph input, see PDL_EARLY_POS)
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
        q, pos, max_pos = _queries(q_ptr, pos_ptr, b, hk, row0, sq_b, sq_h, sq_t, sp_b, T, G, D, BLOCK_R, UPCAST)
        if USE_PDL and EARLY_POS:
            max_pos = early_max  # the same values (nothing writes the positions during the step)
        # Who counts: only the n_used slices that do work (pid_s < n_used <=> pid_s * SPLIT_S <= max_pos, the
        # split kernel's own test), so the expected total is n_used, computed as `_combine_kernel` does; slices
        # above max_pos exit without touching the counter. (Counting every grid program instead would make the
        # early exits pay an atomic each and let a program without a partial do the merge.)
        n_used = tl.minimum(max_pos // SPLIT_S + 1, NUM_SPLITS)
        if pid_s < n_used:
            if PRELOAD:
                m_i, l_i, acc = _slice_partial_preloaded(q, pos, ka, va, kb2, vb2, k_ptr, v_ptr, b, hk,
                                                         pid_s * SPLIT_S, max_pos, sk_b, sk_h, sk_s, sv_b, sv_h,
                                                         sv_s, S, scale, D, BLOCK_R, BLOCK_S, PREC, UPCAST, PRE_NB)
            else:
                m_i, l_i, acc = _slice_partial(q, pos, k_ptr, v_ptr, b, hk, pid_s * SPLIT_S, sk_b, sk_h, sk_s,
                                               sv_b, sv_h, sv_s, S, SPLIT_S, scale, D, BLOCK_R, BLOCK_S, PREC,
                                               UPCAST, V_FIRST=FIRST)
            if TRACE:  # the slice's sums issued (before the partial's stores and the arrival)
                t_summed = _tr_now()
            if SINGLE and n_used == 1:  # the only slice: no partial, no arrival, no merge reads
                if TRACE:
                    t_looped = _tr_now()
                    tag = tl.full([], 2, tl.int32)
                _store_single(out_ptr, m_i, l_i, acc, b, hk, row0, so_b, so_h, so_t, T, G, D, BLOCK_R)
            else:
                _store_partial(o_ptr, m_ptr, l_ptr, (pid_bh * NUM_SPLITS + pid_s) * BLOCK_R, m_i, l_i, acc, D,
                               BLOCK_R)
                # Publish: every thread's partial stores happen before the barrier; the one thread that performs
                # the scalar atomic then releases them at gpu scope (acq_rel: release for ours, acquire for the
                # others' when we are last) -- the CTA-barrier-then-release pattern of split-K semaphores.
                # (Compiled for sm_90 with Triton 3.9: st.global partials; bar.sync; @tid0
                # atom.global.gpu.acq_rel.add; the old value broadcast through shared memory behind another
                # bar.sync; then the branch and ld.global.cg.)
                tl.debug_barrier()
                arrived = tl.atomic_add(cnt_ptr + pid_bh, 1, sem="acq_rel", scope="gpu")
                if TRACE:
                    t_looped = _tr_now()
                    tag = tl.full([], 1, tl.int32)
                if arrived == n_used - 1:  # the last of the n_used: every partial of this (b, hk) is published
                    # The partials are read with ".cg" (cached in L2 only, the point of coherence across SMs),
                    # never from this SM's non-coherent L1, so no line cached before the acquire can be served stale.
                    _merge_store(o_ptr, m_ptr, l_ptr, out_ptr, b, hk, row0, pid_bh, n_used, so_b, so_h, so_t, T,
                                 G, NUM_SPLITS, D, BLOCK_R, ".cg", SPLITS_P2, MERGE_CH, MERGE_R, MERGE_UN, FIRST)
                    # back to zero for the next launch (a later layer, a graph replay): every arrival of this
                    # launch is in, so nothing else touches this counter before the kernel ends
                    tl.store(cnt_ptr + pid_bh, 0)
                    if TRACE:
                        tag = tl.full([], 2, tl.int32)
        if TRACE:
            _tr_record(tr_ptr, pid_bh * tl.num_programs(1) + pid_s, t_start, t_waited, t_looped, c_waited, tag,
                       t_summed)


def _bulk_rows(t: torch.Tensor) -> bool:
    """The K/V hint's layout: each (b, head) row block [S, D] contiguous, every address and size a bulk prefetch
    takes 16-byte aligned."""
    item = t.element_size()
    return (t.stride(2) == t.shape[3] and t.data_ptr() % 16 == 0
            and all(n * item % 16 == 0 for n in (t.shape[3], t.stride(0), t.stride(1))))


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


# the one-launch path's arrival counters: one zero buffer per device, shared by every call (kernels/scratch.py)
_COUNTERS = DeviceBuffers("decode_attention(one_launch=True) arrival counters", torch.int32)


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """>= n zero int32 counters on `device`, shared by every call (every layer) on that device: each launch's
    merging programs reset theirs before it ends. Grown only eagerly (kernels/scratch.py says why)."""
    return _COUNTERS.at_least(device, n)


def warm_args(warm: torch.Tensor | None, programs: int, dummy: torch.Tensor) -> tuple:
    """The split kernel's L2 warming arguments for `warm` (the next GEMV's weight, or None) over `programs`
    programs -> (pointer, bytes a program, bytes in all, WARM): on where VERIFY_WARM_MAX_BYTES is set, the weight
    is at most that, contiguous, 16-byte aligned and a whole number of 16-byte granules, on `dummy`'s device (the
    kernel's), and the kernel is compiled (the interpreter has no inline PTX); else `dummy` (never read: no
    allocation a call) and WARM False."""
    nbytes = 0 if warm is None else warm.numel() * warm.element_size()
    on = (warm is not None and 0 < nbytes <= VERIFY_WARM_MAX_BYTES and warm.is_contiguous()
          and warm.device == dummy.device and warm.data_ptr() % 16 == 0 and nbytes % 16 == 0
          and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))
    if not on:
        return dummy, 0, 0, False
    span = -(-nbytes // (16 * programs)) * 16  # each program's share, whole granules
    return warm.view(-1).view(torch.int8), span, nbytes, True


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     scale: float | None = None, *, split_s: int = 128, block_s: int = 64,
                     one_launch: bool = False, token_major: bool = False,
                     warm: torch.Tensor | None = None) -> torch.Tensor:
    """Masked (key slot <= query position) attention of q [B, H, T, D] over k/v [B, Hkv, S, D] -> [B, H, T, D].

    T <= MAX_T, H a multiple of Hkv, D a power of two >= 16; `split_s` keys per program (a multiple of
    `block_s`); positions [B, T] >= 0. `one_launch`: the slices are merged by the last program of each (b, kv head)
    to finish instead of a second kernel (same numbers; see `_counters` for the one rule it adds). `token_major`:
    the output lies in memory as [B, T, H, D] (returned as its [B, H, T, D] transpose), so the o_proj input
    `out.transpose(1, 2).reshape(B * T, H * D)` is a view, not a copy kernel (models/fused_decode.py, T > 1).
    `warm` (the two-launch path): the next GEMV's weight, warmed in L2 by the split kernel where
    VERIFY_WARM_MAX_BYTES allows (`warm_args`). Static shapes, no host sync: safe inside CUDA graphs."""
    if triton is None:
        raise RuntimeError("decode_attention needs triton")
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if (T > MAX_T or H % Hkv or D < 16 or D & (D - 1) or split_s % block_s or k.shape != v.shape
            or (one_launch and S < 1)):
        raise ValueError(f"decode_attention: unsupported shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, split {split_s}/{block_s}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("decode_attention needs unit stride along head_dim")
    G = H // Hkv
    rows = max(16, min(_pow2(G * T), ROWS_PER_PROGRAM))  # a program's row block (tl.dot's smallest M: 16)
    nrb = triton.cdiv(G * T, rows)
    splits = triton.cdiv(S, split_s)
    pos = positions if positions.is_contiguous() else positions.contiguous()
    if token_major:  # the kernels store through out's strides
        out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    else:
        out = torch.empty(B, H, T, D, dtype=q.dtype, device=q.device)
    scale = D ** -0.5 if scale is None else scale
    if one_launch:  # the fused one-token path's attention: launched with PDL when the switch is on
        pdl = launch_options()
        kv_l2 = pdl.use_pdl and PDL_KV_L2 and _bulk_rows(k) and _bulk_rows(v)
        pre_nb = split_s // block_s
        preload = KV_PRELOAD and T == 1 and pre_nb in (1, 2) and (pdl.late or not pdl.use_pdl)  # see KV_PRELOAD
        launch = {"num_warps": ONE_LAUNCH_WARPS} if ONE_LAUNCH_WARPS else {}  # (0: Triton's default)
        if ONE_LAUNCH_STAGES:
            launch["num_stages"] = ONE_LAUNCH_STAGES
        from specpilot.kernels import cluster_attention  # (imports this module)

        if cluster_attention.applies(T, G, D, nrb, q.device) and cluster_attention.cluster_attention(
                q, k, v, pos, out, _counters(q.device, B * Hkv), split_s, block_s, scale, pdl,
                early_pos=PDL_EARLY_POS, preload=preload, loads_first=LOADS_FIRST, kv_l2=kv_l2,
                launch=launch) is not None:
            return out  # the slices merged inside a CTA cluster (its own partials)
    # the slices' partials: row (b * Hkv + hk, slice, r) of o [.., D], m, l (fp32)
    o = torch.empty(B * Hkv * nrb * splits * rows, D, dtype=torch.float32, device=q.device)
    m = torch.empty(B * Hkv * nrb * splits * rows, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), pos.stride(0))
    consts = dict(D=D, BLOCK_R=rows, BLOCK_S=block_s, PREC="ieee" if q.dtype == torch.float32 else "tf32",
                  UPCAST=os.environ.get("TRITON_INTERPRET") == "1")
    if one_launch:
        chunk = min(MERGE_CHUNK, _pow2(splits))  # no wider than the slices there are
        unroll = MERGE_UNROLL if MERGE_UNROLL in (2, 4) else 0  # (the config allows only these)
        tr = trace.launch_args(q.device, "attention Hkv={} splits={}".format, Hkv, splits)  # a diagnostic (off)
        _split_merge_kernel[(B * Hkv * nrb, splits)](
            q, k, v, pos, o, m, l, out, _counters(q.device, B * Hkv * nrb), *strides,
            out.stride(0), out.stride(1), out.stride(2), Hkv, S, T, G, split_s, splits, nrb, scale, **consts,
            SPLITS_P2=_pow2(splits), USE_PDL=pdl.use_pdl, KV_L2=kv_l2, MERGE_CH=chunk,
            MERGE_R=min(rows, _pow2(G * T)), EARLY_POS=pdl.use_pdl and PDL_EARLY_POS, PRELOAD=preload,
            PRE_NB=pre_nb if preload else 1, SINGLE=SINGLE_DIRECT, MERGE_UN=unroll, FIRST=LOADS_FIRST, **pdl.kwargs,
            **launch, **tr)
        return out
    w_ptr, w_span, w_bytes, w_on = warm_args(warm, B * Hkv * nrb * splits, q)
    _split_kernel[(B * Hkv * nrb, splits)](q, k, v, pos, o, m, l, *strides, Hkv, S, T, G, split_s, splits, nrb, scale,
                                           w_ptr, w_span, w_bytes, **consts, WARM=w_on)
    _combine_kernel[(B * Hkv * nrb,)](o, m, l, pos, out, out.stride(0), out.stride(1), out.stride(2), pos.stride(0),
                                      Hkv, T, G, split_s, splits, nrb, D=D, BLOCK_R=rows, SPLITS_P2=_pow2(splits))
    return out


# keys per program and per inner step of the one-launch op (the fused decode path's attention); the H200 timing
# that chose them: BENCHMARKS.md (session 12). EngineConfig.attn_split_keys sets it (engine._apply_program_splits)
ONE_LAUNCH_SPLIT = (128, 64)


def _register_op():
    """The kernel as torch custom ops, so torch.compile treats it as one opaque call. Inductor otherwise re-compiles
    user Triton kernels itself, and that failed for `_split_kernel` in the loop's `compile` trial on the H200
    (session 10: InductorError in its compile worker), which kept `compile` and the kernel from combining.
    "specpilot::decode_attention_one" is the one-launch path (its counters end every call at zero, as they began:
    no state torch.compile would need to know of); "specpilot::decode_attention_token_major" the two-launch path
    (the one-launch one with VERIFY_ONE_LAUNCH) with its output token-major (a fused verify step's,
    models/fused_decode.py)."""

    @torch.library.custom_op("specpilot::decode_attention", mutates_args=())
    def decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return decode_attention(q, k, v, positions)

    @torch.library.custom_op("specpilot::decode_attention_one", mutates_args=())
    def decode_attention_one_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
                                ) -> torch.Tensor:
        return decode_attention(q, k, v, positions, split_s=ONE_LAUNCH_SPLIT[0], block_s=ONE_LAUNCH_SPLIT[1],
                                one_launch=True)

    @torch.library.custom_op("specpilot::decode_attention_token_major", mutates_args=())
    def decode_attention_token_major_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                                        warm: torch.Tensor | None = None) -> torch.Tensor:
        if VERIFY_ONE_LAUNCH:  # one launch (PDL where on), the pair's slices: the same numbers
            return decode_attention(q, k, v, positions, one_launch=True, token_major=True)
        return decode_attention(q, k, v, positions, token_major=True, warm=warm)

    for op in (decode_attention_op, decode_attention_one_op):
        op.register_fake(lambda q, k, v, positions: torch.empty_like(q, memory_format=torch.contiguous_format))
    decode_attention_token_major_op.register_fake(  # the real output's strides: [B, T, H, D] memory
        lambda q, k, v, positions, warm=None: q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
        .transpose(1, 2))
    return decode_attention_op, decode_attention_one_op, decode_attention_token_major_op


decode_attention_op, decode_attention_one_op, decode_attention_token_major_op = (
    _register_op() if triton is not None else (None, None, None))
