"""Input RMSNorm + qkv GEMV (+ bias) + RoPE + K/V cache write of one token, in one launch (EngineConfig.rope_in_qkv).

Why: the fused one-token layer (models/fused_decode.py) is six launches; on the H200 at the Qwen2.5-1.5B shape the
RoPE + K/V write launch between the qkv GEMV and the attention costs 2.6 us + a 0.4 us boundary, every layer, for
no bytes worth the name (BENCHMARKS.md, session 24: the step kernel by kernel). Here the qkv GEMV's epilogue does
it: the GEMV's programs already hold the projection's outputs in registers, so rotating them and storing q into a
fresh tensor and k, v into their cache slots costs a few instructions, not a launch.

The pairing: RoPE (rotate-half) mixes output column j of a head with column j + D/2. A program owns BLOCK_P such
pairs of one head and loads their weight rows as one [2 BLOCK_P, BLOCK_K] tile, interleaved (j, j + D/2, j + 1,
...), as kernels/gemv_fused.py's PAIRED layout does for gate/up; after the K loop the sums split into the two halves
and the epilogue rotates them. Heads [0, H) are q, [H, H + Hkv) k (rotated, then written at slot = position), the
rest v (written as is).

Per-head q/k RMSNorm (Qwen3, QK_NORM): the norm needs the whole head before the rotation, and a program holds only
BLOCK_P of its pairs. So each program of a q or k head stores its un-normed outputs where the head's result goes
(rotated q's tensor, k's cache slot: nothing reads either before this launch ends), then counts itself in on the
head's counter (a CTA barrier, then one acq_rel atomic, as kernels/decode_attention.py's one-launch merge); the
last of the head's D / (2 BLOCK_P) programs reads the whole head back from L2 (".cg") and normalizes, rotates and
stores it over the same place with rope_write's own per-head code (kernels/rope.py `_norm_rope_rows`), then zeroes
the counter for the next launch. The counters are one grow-only buffer per device (kernels/scratch.py), so a
launch inside a CUDA graph needs one eager launch first. Why: at Qwen3-8B the RoPE launch was ~3-5 us of a ~117 us
layer (session 26-27, H200) for no bytes; what replaces it is one L2 round trip in the last program of each head.

PDL (kernels/pdl.py, as gemv_fused's one-row kernel): USE_PDL waits for the previous kernel before anything but
weights is read; PDL_LATE lets the next kernel (the attention) launch once a program's K loop is done; L2_PF warms
the program's two row ranges in L2 before the wait (gemv_fused `l2_warming`: qkv's 6 MiB at 1.5B is under the 8 MiB
default).

Numbers: the eager path's, as the two launches it replaces give them: the GEMV's (gemv_fused: the norm prologue,
fp32 sums, + bias in fp32, one rounding to the dtype) then `apply_rope`'s (each product rounded to the dtype, then
their sum; kernels/rope.py). Only the dot product's summation order differs from cuBLAS's, as for gemv_fused.

`qkv_rope_reference` is the plain-PyTorch twin (TRITON_INTERPRET=1 runs the kernel on CPU); `qkv_rope_op` the
kernel as the torch custom op "specpilot::qkv_rope", which declares the two caches as mutated.
"""

from __future__ import annotations

import os

import torch

from specpilot.kernels import trace, tuned  # per-program timelines (a diagnostic); pinned autotuning picks
from specpilot.kernels.gemv_fused import gemv_fused_reference, l2_warming
from specpilot.kernels.rope_write import rope_write_reference
from specpilot.kernels.scratch import DeviceBuffers

try:
    import triton
    import triton.language as tl

    from specpilot.kernels.gemv_parts import _L2_CHUNK_C, _l2_prefetch_rows, _norm_h, _norm_rstd  # shared with
    # the plain GEMV: its norm prologue and L2 warming
    from specpilot.kernels.fused_mlp import settled_row, settled_rstd  # PENDING: the previous layer's fused MLP
    from specpilot.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options  # PDL (kernels/pdl.py)
    from specpilot.kernels.rmsnorm import _to_dtype  # fp32 -> dtype, round to nearest even (interpreter too)
    from specpilot.kernels.rope import _cos_sin_row, _norm_rope_rows  # rope_write's per-head norm + rotation
    from specpilot.kernels.trace import cycles as _tr_cycles, now as _tr_now, record as _tr_record  # TRACE
except ImportError:  # CPU-only installs: the reference path only
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_COUNTERS = DeviceBuffers("qkv_rope head counters", torch.int32)  # QK_NORM: one arrival counter a q / k head
# The epilogue's loads (bias, the cache slot, RoPE's cos / sin) right after the PDL wait instead of after the K loop
# (EARLY_EPI; EngineConfig.early_epilogue, as kernels/gemv_fused.py EARLY_EPILOGUE says why): their round trip
# then overlaps the weight stream instead of following the last tile. The same values: the same bits. Not in the
# autotuning key (the tiles tuned or pinned without it apply).
EARLY_EPILOGUE = False
# The first K block's weight tile asked for right after the PDL wait, ahead of the norm prologue (TILE_AFTER_WAIT;
# EngineConfig.tile_after_wait, as kernels/gemv_fused.py FIRST_TILE_AFTER_WAIT says why): at Qwen3-8B qkv's 48 MiB
# stream from DRAM behind down_proj's tail (session 26: a ~4 us ramp a layer). The same bits.
FIRST_TILE_AFTER_WAIT = False
# The K loop runs two blocks ahead of its sums (PIPE, EngineConfig.qkv_pipeline): the first two blocks' weight tiles
# are asked for right after the PDL wait, ahead of the norm prologue, and each iteration asks for the block two
# ahead before it sums its own. Why: at the 1.5B shape K is 1536 and the tuned tiles take 1024 keys a block, so a
# program's two blocks were two DRAM round trips one after the other (Triton pipelines only loads that feed a
# tl.dot), with all 512 programs resident at once: the session-42 trace put qkv + RoPE at 4.8 us a layer for a 2.1 us
# floor. A block past K is a fully masked load (no traffic). The same sums in the same order: the same bits.
PIPE = False
# Under the late PDL trigger, qkv + RoPE lets the attention launch first thing anyway (EngineConfig.
# qkv_trigger_first). Why: the late trigger exists for GEMVs of several waves, whose later programs would find their
# slots taken by the next kernel's waiting programs; qkv + RoPE is ONE wave (1.5B: 256 programs, every one past its
# wait within 32 ns; Qwen3-8B 384), so nothing of it can be stranded, while the late trigger kept the attention's
# programs from being resident before qkv's last tile (session 37 trace, H100: the attention's first program started
# 0.2-0.4 us AFTER qkv's last end at 1.5B). Resident early, the attention can load its slice's older K/V rows before
# its wait (EngineConfig.attn_kv_preload): their DRAM round trips overlap qkv's weight stream. Numbers unchanged:
# only when the next grid may start.
TRIGGER_FIRST = False


def qkv_rope_reference(x, weight, bias, norm_weight, eps, cos, sin, positions, k_cache, v_cache, num_heads: int,
                       q_norm_weight=None, k_norm_weight=None, qk_eps: float = 1e-6) -> torch.Tensor:
    """The two launches this one replaces, in plain PyTorch: the fused qkv GEMV (its norm prologue and bias), then
    q/k norm + RoPE + K/V write (kernels/rope_write.py's reference) -> rotated q [1, H, 1, D]; k/v written in
    place."""
    D, Hkv = k_cache.shape[-1], k_cache.shape[1]
    qkv = gemv_fused_reference(x, weight, bias, norm_weight=norm_weight, eps=eps)  # [1, (H + 2 Hkv) D]
    q, k, v = qkv.split((num_heads * D, Hkv * D, Hkv * D), dim=-1)
    q, k, v = (t.view(1, 1, -1, D).transpose(1, 2) for t in (q, k, v))
    return rope_write_reference(q, k, v, cos, sin, positions, k_cache, v_cache, q_norm_weight, k_norm_weight, qk_eps)


if triton is not None:

    @triton.jit
    def _qkv_rope_kernel(x_ptr, w_ptr, b_ptr, nw_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, kc_ptr, vc_ptr,
                         qnw_ptr, knw_ptr, cnt_ptr, K, stride_wn, eps, qk_eps, skc_h, skc_s, svc_h, svc_s, S, H, HKV,
                         HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, ON_GPU: tl.constexpr,
                         K_P2: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                         QK_NORM: tl.constexpr = False, USE_PDL: tl.constexpr = False,
                         PDL_LATE: tl.constexpr = False, L2_PF: tl.constexpr = False, L2_PART: tl.constexpr = 64,
                         EARLY_EPI: tl.constexpr = False, TILE_AFTER_WAIT: tl.constexpr = False,
                         PIPE: tl.constexpr = False, pend_ptr=None, xo_ptr=None, PENDING: tl.constexpr = False,
                         TRACE: tl.constexpr = False, tr_ptr=None):
        HALF: tl.constexpr = D // 2
        if TRACE:  # kernels/trace.py (a diagnostic): this program's timeline row, written at its end
            t_start = _tr_now()
        if USE_PDL and not PDL_LATE:
            gdc_launch_dependents()
        dt = qo_ptr.dtype.element_ty
        p0 = tl.program_id(0) * BLOCK_P  # this program's first pair; BLOCK_P divides D / 2: one head
        head = p0 // HALF
        j = p0 % HALF + tl.arange(0, BLOCK_P)  # the pairs' first-half columns within the head
        pi = tl.arange(0, 2 * BLOCK_P)  # tile row i: column j[i // 2] (+ D / 2 when i is odd)
        cols = p0 % HALF + pi // 2 + (pi % 2) * HALF
        rows = (head * D + cols).to(tl.int64)[:, None] * stride_wn  # [2 BP, 1]
        if USE_PDL and L2_PF:  # weights only, nothing comes back (gemv_fused's warming): the two row ranges
            n_rows = tl.full([], BLOCK_P, tl.int32)
            _l2_prefetch_rows(w_ptr, head * D + p0 % HALF, n_rows, K, _L2_CHUNK_C, L2_PART)
            _l2_prefetch_rows(w_ptr, head * D + HALF + p0 % HALF, n_rows, K, _L2_CHUNK_C, L2_PART)
        if USE_PDL:  # nothing but weights read before it, nothing written (gemv_fused's rule)
            gdc_wait()
        if TRACE:
            t_waited = _tr_now()
            c_waited = _tr_cycles()
        if TILE_AFTER_WAIT or PIPE:  # the first block's weights first (FIRST_TILE_AFTER_WAIT): ahead of the norm
            w0 = tl.load(w_ptr + rows + tl.arange(0, BLOCK_K)[None, :], mask=(tl.arange(0, BLOCK_K) < K)[None, :],
                         other=0.0)
        if PIPE:  # and the second (PIPE): two blocks in flight from the start
            k_1 = BLOCK_K + tl.arange(0, BLOCK_K)
            w1 = tl.load(w_ptr + rows + k_1[None, :], mask=(k_1 < K)[None, :], other=0.0)
        if EARLY_EPI:  # the epilogue's loads (EARLY_EPILOGUE), after the wait: the same values, the same bits
            b1, b2, p = _bias_slot(b_ptr, pos_ptr, head, j, HAS_BIAS, D)
            if not QK_NORM:  # (every program: v's ignore theirs, one round trip with the others)
                c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, j, D)
        rstd = 1.0
        if PENDING:  # x + the previous layer's fused MLP (kernels/fused_mlp.py); program 0 stores the settled row
            rstd = settled_rstd(x_ptr, pend_ptr, xo_ptr, K, eps, K_P2, dt)
        elif HAS_NORM:
            rstd = _norm_rstd(x_ptr, K, eps, K_P2)
        acc = tl.zeros((2 * BLOCK_P, BLOCK_K), dtype=tl.float32)
        if PIPE:  # block k0's tile is in flight since two iterations back; ask for block k0 + 2 first
            for k0 in range(0, K, BLOCK_K):
                k_2 = k0 + 2 * BLOCK_K + tl.arange(0, BLOCK_K)
                w2 = tl.load(w_ptr + rows + k_2[None, :], mask=(k_2 < K)[None, :], other=0.0)
                acc = _qkv_block(acc, w0, x_ptr, nw_ptr, k0, K, rstd, dt, HAS_NORM, ON_GPU, BLOCK_K, pend_ptr, PENDING)
                w0 = w1
                w1 = w2
        else:
            if TILE_AFTER_WAIT:  # block 0 with the tile loaded above (the loop's body: the same order of sums)
                acc = _qkv_block(acc, w0, x_ptr, nw_ptr, 0, K, rstd, dt, HAS_NORM, ON_GPU, BLOCK_K, pend_ptr, PENDING)
            for k0 in range(TILE_AFTER_WAIT * BLOCK_K, K, BLOCK_K):  # gemv_fused's one-row loop
                k_offs = k0 + tl.arange(0, BLOCK_K)
                w = tl.load(w_ptr + rows + k_offs[None, :], mask=(k_offs < K)[None, :], other=0.0)
                acc = _qkv_block(acc, w, x_ptr, nw_ptr, k0, K, rstd, dt, HAS_NORM, ON_GPU, BLOCK_K, pend_ptr, PENDING)
        if TRACE:
            t_looped = _tr_now()
        if USE_PDL and PDL_LATE:  # every weight is in: the attention's programs may take the slots we free
            gdc_launch_dependents()
        y1, y2 = tl.split(tl.reshape(tl.sum(acc, axis=1), (BLOCK_P, 2)))  # columns j and j + D / 2
        if not EARLY_EPI:
            b1, b2, p = _bias_slot(b_ptr, pos_ptr, head, j, HAS_BIAS, D)
        if HAS_BIAS:
            y1 += b1
            y2 += b2
        y1 = _to_dtype(y1, dt).to(tl.float32)  # nn.Linear's output in the dtype
        y2 = _to_dtype(y2, dt).to(tl.float32)
        slot = tl.full([BLOCK_P], 0, tl.int64) + p  # (a tensor: the interpreter rejects scalar & tensor masks)
        in_pool = (slot >= 0) & (slot < S)
        if QK_NORM and head < H + HKV:  # q or k with a per-head norm: the head's last program finishes it
            if head < H:
                dst = qo_ptr + head * D
                nrm = qnw_ptr
                ok = slot == slot  # q is always stored
            else:
                dst = kc_ptr + (head - H).to(tl.int64) * skc_h + p * skc_s
                nrm = knw_ptr
                ok = in_pool
            tl.store(dst + j, _to_dtype(y1, dt), mask=ok)  # un-normed, in the dtype (the linear's output)
            tl.store(dst + HALF + j, _to_dtype(y2, dt), mask=ok)
            tl.debug_barrier()  # every thread's stores, then one release at gpu scope (decode_attention's pattern)
            arrived = tl.atomic_add(cnt_ptr + head, 1, sem="acq_rel", scope="gpu")
            if arrived == HALF // BLOCK_P - 1:  # the head is whole in L2: norm, rotate, store over it
                c, s_signed, dcols, partner = _cos_sin_row(cos_ptr, sin_ptr, 0, 0, 0, 0, 0, 0, D)
                n_ok = tl.max(ok.to(tl.int32), axis=0)  # 1 head, or 0 when k's slot is outside the pool
                out, valid = _norm_rope_rows(dst, nrm, n_ok, D, c, s_signed, dcols, partner, qk_eps, D, 1, True,
                                             True)
                tl.store(dst + tl.arange(0, 1)[:, None] * D + dcols[None, :], out, mask=valid)
                tl.store(cnt_ptr + head, 0)  # every arrival of this launch is in: zero for the next launch
        elif head < H + HKV:  # q or k: apply_rope, x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
            if not EARLY_EPI or QK_NORM:  # (with QK_NORM this branch is compiled but never taken)
                c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, j, D)
            o1 = _to_dtype(_to_dtype(y1 * c1, dt).to(tl.float32) + _to_dtype(-y2 * s1, dt).to(tl.float32), dt)
            o2 = _to_dtype(_to_dtype(y2 * c2, dt).to(tl.float32) + _to_dtype(y1 * s2, dt).to(tl.float32), dt)
            if head < H:
                tl.store(qo_ptr + head * D + j, o1)
                tl.store(qo_ptr + head * D + HALF + j, o2)
            else:
                kc = kc_ptr + (head - H).to(tl.int64) * skc_h + slot * skc_s
                tl.store(kc + j, o1, mask=in_pool)
                tl.store(kc + HALF + j, o2, mask=in_pool)
        else:  # v: into its slot as it is
            vc = vc_ptr + (head - H - HKV).to(tl.int64) * svc_h + slot * svc_s
            tl.store(vc + j, _to_dtype(y1, dt), mask=in_pool)
            tl.store(vc + HALF + j, _to_dtype(y2, dt), mask=in_pool)
        if TRACE:
            _tr_record(tr_ptr, tl.program_id(0), t_start, t_waited, t_looped, c_waited, 1, t_looped)

    @triton.jit
    def _qkv_block(acc, w, x_ptr, nw_ptr, k0, K, rstd, dt: tl.constexpr, HAS_NORM: tl.constexpr,
                   ON_GPU: tl.constexpr, BLOCK_K: tl.constexpr, pend_ptr=None, PENDING: tl.constexpr = False):
        """The K loop's body for block k0 with its weight tile w loaded: x's block (normed with HAS_NORM; with
        PENDING the settled row, kernels/fused_mlp.py) times w into acc -> acc."""
        k_offs = k0 + tl.arange(0, BLOCK_K)
        k_mask = k_offs < K
        if PENDING:
            h = settled_row(x_ptr, pend_ptr, k_offs, k_mask, dt)
        else:
            h = tl.load(x_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            h = _norm_h(h, tl.load(nw_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32), rstd, dt, ON_GPU)
        return acc + w.to(tl.float32) * h[None, :]

    @triton.jit
    def _bias_slot(b_ptr, pos_ptr, head, j, HAS_BIAS: tl.constexpr, D: tl.constexpr):
        """A program's (head `head`, pair columns j) bias of columns j and j + D / 2 (fp32; 0.0 without a bias) and
        the token's cache slot (int64): epilogue operands, split out so that EARLY_EPI can load them first."""
        b1 = 0.0
        b2 = 0.0
        if HAS_BIAS:
            b1 = tl.load(b_ptr + head * D + j).to(tl.float32)
            b2 = tl.load(b_ptr + head * D + D // 2 + j).to(tl.float32)
        return b1, b2, tl.load(pos_ptr).to(tl.int64)

    @triton.jit
    def _cos_sin(cos_ptr, sin_ptr, j, D: tl.constexpr):
        """cos and sin of the pair columns j and j + D / 2 (fp32): RoPE's operands (q and k heads without a norm)."""
        return (tl.load(cos_ptr + j).to(tl.float32), tl.load(cos_ptr + D // 2 + j).to(tl.float32),
                tl.load(sin_ptr + j).to(tl.float32), tl.load(sin_ptr + D // 2 + j).to(tl.float32))

    # gemv_fused's one-row tiles, counted in pairs (a tile holds 2 BLOCK_P weight rows); + its wider 8-warp ones
    # (32 rows: QK_NORM's heads then have 4 programs to count in, not 8)
    _CONFIGS = [triton.Config({"BLOCK_P": bp, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                for bp, bk in ((1, 1024), (2, 512), (2, 1024), (4, 256), (4, 512), (8, 256), (8, 512))
                for w in (2, 4) for s in (1, 3)] + [
                triton.Config({"BLOCK_P": 16, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                for bk in (256, 512) for w in (4, 8) for s in (1, 3)]

    _KEY = ["K", "H", "HKV", "HAS_BIAS", "HAS_NORM", "D", "QK_NORM"]

    def _prune(configs, named_args, **kwargs):  # a program's pairs must stay within one head (+ a pinned pick
        # where one ships: kernels/tuned.py)
        half = kwargs.get("D", named_args.get("D")) // 2
        configs = [c for c in configs if half % c.kwargs["BLOCK_P"] == 0] or configs[:1]
        return tuned.narrow("_qkv_rope_kernel", configs, named_args, kwargs, _KEY)

    _kernel = _qkv_rope_kernel if _INTERPRET else tuned.autotune(_qkv_rope_kernel, _CONFIGS, _KEY, _prune)


def fused_qkv_problem(x, weight, bias, norm_weight, k_cache, v_cache, num_heads: int, **more) -> str | None:
    """What is wrong with the arguments every qkv launch with RoPE and the K/V write takes (this module's one token,
    kernels/qkv_rope_rows.py's T rows), or None: caches [1, Hkv, S, D] (D a power of two >= 4, unit stride along
    D), the fused weight [(H + 2 Hkv) D, K] (K: x's columns), bias [N] and norm_weight [K] (both optional), and one
    dtype over these, x and `more` (name -> tensor or None)."""
    if k_cache.dim() != 4 or k_cache.shape[0] != 1 or v_cache.shape != k_cache.shape:
        return f"k_cache and v_cache must both be [1, Hkv, S, D], got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
    _, Hkv, S, D = k_cache.shape
    if D < 4 or D & (D - 1):
        return f"head_dim must be a power of two >= 4, got {D}"
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return "k_cache and v_cache must have unit stride along head_dim (they are written in place)"
    N, K = (num_heads + 2 * Hkv) * D, x.shape[1]
    if weight.dim() != 2 or tuple(weight.shape) != (N, K) or not weight.is_contiguous():
        return f"weight must be the contiguous fused qkv [(H + 2 Hkv) D, K] = [{N}, {K}], got {tuple(weight.shape)}"
    for name, t, shape in (("bias", bias, (N,)), ("norm_weight", norm_weight, (K,))):
        if t is not None and (tuple(t.shape) != shape or t.stride(-1) != 1):
            return f"{name} must be [{shape[0]}] with unit stride, got {tuple(t.shape)}"
    tensors = dict(x=x, weight=weight, bias=bias, norm_weight=norm_weight, k_cache=k_cache, v_cache=v_cache, **more)
    dts = {n: t.dtype for n, t in tensors.items() if t is not None}
    if len(set(dts.values())) != 1:
        return f"all tensors must share x's dtype (the eager path's numbers), got {dts}"
    return None


def _problem(x, weight, bias, norm_weight, cos, sin, positions, k_cache, v_cache, num_heads, q_norm_weight,
             k_norm_weight, pending=None, x_out=None) -> str | None:
    """-> what is wrong with the arguments, or None."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(-1) != 1:
        return f"x must be one row [1, K] with unit stride, got {tuple(x.shape)}"
    if (pending is None) != (x_out is None):
        return "pending and x_out come together (the previous layer's fused MLP and where its settled row goes)"
    if pending is not None:
        K = x.shape[1]
        if norm_weight is None:
            return "pending needs the norm prologue (norm_weight): the settled row is normed here"
        if tuple(pending.shape) != (K,) or pending.dtype != torch.float32 or not pending.is_contiguous():
            return f"pending must be a contiguous fp32 [{K}], got {pending.dtype} {tuple(pending.shape)}"
        if tuple(x_out.shape) != (1, K) or x_out.dtype != x.dtype or not x_out.is_contiguous():
            return f"x_out must be a contiguous [1, {K}] of x's dtype, got {x_out.dtype} {tuple(x_out.shape)}"
    problem = fused_qkv_problem(x, weight, bias, norm_weight, k_cache, v_cache, num_heads, cos=cos, sin=sin,
                                q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight)
    if problem:
        return problem
    D = k_cache.shape[-1]
    if (q_norm_weight is None) != (k_norm_weight is None):
        return "q_norm_weight and k_norm_weight come together (a model normalizes both q and k, or neither)"
    for name, t in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if t is not None and (tuple(t.shape) != (D,) or t.stride(-1) != 1):
            return f"{name} must be [{D}] with unit stride, got {tuple(t.shape)}"
    for name, t in (("cos", cos), ("sin", sin)):
        if t.numel() != D or t.stride(-1) != 1:
            return f"{name} must hold one token's row of D = {D} values (one token, one row), got {tuple(t.shape)}"
    if positions.numel() != 1 or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        return f"positions must be one integer position [1, 1], got {positions.dtype} {tuple(positions.shape)}"
    return None


def qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
             eps: float, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, num_heads: int, q_norm_weight: torch.Tensor | None = None,
             k_norm_weight: torch.Tensor | None = None, qk_eps: float = 1e-6, pending: torch.Tensor | None = None,
             x_out: torch.Tensor | None = None) -> torch.Tensor:
    """One token: q = RoPE(qnorm(RMSNorm(x) @ Wq^T + bq)), k likewise into k_cache[0, :, position], v into v_cache;
    -> rotated q [1, H, 1, D] (a new tensor). x [1, K]; weight the fused qkv [(H + 2 Hkv) D, K]; bias [N] and
    norm_weight [K] optional; q_norm_weight / k_norm_weight [D] the per-head norms (Qwen3; both or neither, eps
    qk_eps); cos/sin the token's [.., D] row; positions [1, 1]; caches [1, Hkv, S, D]. A position outside [0, S)
    is not written. pending [K] fp32 (the previous layer's fused MLP, kernels/fused_mlp.py) with x_out [1, K]: the
    input is x settled with it (`fused_mlp.settle`), which is also written to x_out. Static shapes, no host sync:
    safe inside CUDA graphs (once autotuned outside capture, and with the per-head norms launched once eagerly:
    their counters are allocated then)."""
    if triton is None:
        raise RuntimeError("qkv_rope needs triton")
    problem = _problem(x, weight, bias, norm_weight, cos, sin, positions, k_cache, v_cache, num_heads,
                       q_norm_weight, k_norm_weight, pending, x_out)
    if problem:
        raise ValueError(f"qkv_rope: {problem}")
    _, Hkv, S, D = k_cache.shape
    K = x.shape[1]
    qk_norm = q_norm_weight is not None
    q = torch.empty(1, num_heads, 1, D, dtype=x.dtype, device=x.device)
    counters = _COUNTERS.at_least(x.device, num_heads + Hkv) if qk_norm else weight  # (unused pointer: a dummy)
    qnw, knw = (q_norm_weight, k_norm_weight) if qk_norm else (weight, weight)
    args = (x, weight, weight if bias is None else bias, weight if norm_weight is None else norm_weight, cos, sin,
            positions, q, k_cache, v_cache, qnw, knw, counters, K, weight.stride(0), float(eps), float(qk_eps),
            k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2), S, num_heads, Hkv)
    pdl = launch_options()  # launch_pdl=True with USE_PDL when the PDL switch is on
    flags = dict(HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None, ON_GPU=not _INTERPRET,
                 K_P2=triton.next_power_of_2(K) if norm_weight is not None else 1, D=D, QK_NORM=qk_norm,
                 USE_PDL=pdl.use_pdl, PDL_LATE=pdl.late and not TRIGGER_FIRST, **pdl.kwargs,
                 **l2_warming(weight, pdl.use_pdl))
    pairs = (num_heads + 2 * Hkv) * D // 2
    tr = trace.launch_args(x.device, "qkv_rope N={} K={}".format, weight.shape[0], K)  # a diagnostic (off)
    flags.update(EARLY_EPI=EARLY_EPILOGUE, TILE_AFTER_WAIT=FIRST_TILE_AFTER_WAIT, PIPE=PIPE,
                 PENDING=pending is not None, pend_ptr=pending, xo_ptr=x_out)
    if _INTERPRET:  # CPU tests: a small fixed tile (K's mask exercised: the tests' K is not a multiple of 64)
        _kernel[(pairs // 2,)](*args, **flags, BLOCK_P=2, BLOCK_K=64, **tr)
    else:
        _kernel[lambda meta: (pairs // meta["BLOCK_P"],)](*args, **flags, **tr)
    return q


def _register_op():
    """The kernel as a torch custom op: one opaque call under torch.compile (as kernels/rope_write.py); the caches
    are declared mutated so functionalization keeps the writes."""

    @torch.library.custom_op("specpilot::qkv_rope", mutates_args=("k_cache", "v_cache", "x_out"))
    def qkv_rope_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    norm_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                    q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, qk_eps: float,
                    pending: torch.Tensor | None, x_out: torch.Tensor | None) -> torch.Tensor:
        return qkv_rope(x, weight, bias, norm_weight, eps, cos, sin, positions, k_cache, v_cache, num_heads,
                        q_norm_weight, k_norm_weight, qk_eps, pending, x_out)

    @qkv_rope_op.register_fake
    def _(x, weight, bias, norm_weight, eps, cos, sin, positions, k_cache, v_cache, num_heads, q_norm_weight,
          k_norm_weight, qk_eps, pending, x_out):
        return x.new_empty(1, num_heads, 1, k_cache.shape[-1])

    return qkv_rope_op


qkv_rope_op = _register_op() if triton is not None else None
