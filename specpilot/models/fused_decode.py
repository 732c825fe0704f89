"""A decode or verify pass of 1 to 16 tokens through a dense layer in six or nine launches (EngineConfig.fused_decode,
EngineConfig.fused_verify).

Why: at bs 1 a graphed decode step of a 1.5B-class model is bound by its ~15 kernels per layer, not by its bytes
(H200, session 11: 2.07 ms with every elementwise kernel fused = 2.8x the 0.74 ms bytes/bandwidth floor; the
cuBLAS GEMVs alone reach ~2.2 of 4.2 TB/s at these shapes). Here one token's layer is

    [input RMSNorm + qkv GEMV (+ bias)]       kernels/gemv_fused.py, the norm as the GEMV's prologue
    [q/k norm (Qwen3) + RoPE + K/V write]     kernels/rope_write.py
    [attention over the cache]                kernels/decode_attention.py, the slices merged by their last program
    [o_proj GEMV + residual add]              gemv_fused, residual epilogue
    [post-attention RMSNorm + gate/up GEMV + SiLU(gate) * up]
    [down GEMV + residual add]

each launch reproducing the eager modules' rounding order (only the GEMVs' fp32 summation order differs from
cuBLAS's), so a fused step gives the eager step's tokens up to that rounding (the engine's greedy outputs are
checked against AR by token forcing like any other kernel's).

One token (fused_decode: AR decode, a small drafter's passes): the GEMVs are gemv_fused's one-row kernel and the
attention is one launch (its slices merged by the last program). 2 to 16 tokens in one row (fused_verify: a
speculative verify block, e.g. DFlash's 16): the same layer with T rows, because the regular path of a verify step
(~12 launches a layer, cuBLAS at M = 16) cost 2.5-3.6 one-token steps on the H200. The GEMVs are gemv_fused's M-row
kernel (the weights read once for all T rows; down_proj's may split K, kernels/gemm_rows.py), RoPE + K/V write
takes the T tokens in one launch as it is, and the attention is the split-KV kernel and its merge. The two RMSNorms
are launches of their own here (kernels/rmsnorm.py, then norm-free GEMVs: `PRENORM_ROWS`, the M-row norm prologue
was the H200's bottleneck; same numbers): nine launches a layer. The attention writes its output token-major, so
o_proj reads it as [T, H * D] without a copy.

With EngineConfig.rope_in_attention (DenseLM.use_rope_in_attention, kernels/rope_attention.py) a one-token layer's
attention launch also does the q/k norm, RoPE and K/V write (the rope_write launch goes: five launches a layer;
every program rotates q and the new k itself, so no slice reads the slot another program writes). Same numbers.

With EngineConfig.rope_in_qkv (DenseLM.use_rope_in_qkv, kernels/qkv_rope.py) a one-token layer's qkv GEMV also
does RoPE and the K/V write in its epilogue (each program owns the column pairs RoPE mixes): five launches a layer,
for models without a q/k norm. Same numbers.

With EngineConfig.norm_epilogue (DenseLM.use_norm_epilogue, kernels/norm_epilogue.py) the residual GEMVs also
write the norm the next GEMV reads: o_proj's the post-attention norm, down's the next layer's input norm (the final
norm after the last layer), so qkv, gate_up and the LM head run norm-free; a block's layer is seven launches, and
only layer 0's input norm keeps its launch (or prologue). Same numbers.

With EngineConfig.fused_mlp (DenseLM.use_fused_mlp, kernels/fused_mlp.py), with rope_in_qkv, a one-token layer's
MLP is ONE launch: down's sums go into a pending fp32 row by atomics, and the next layer's qkv + RoPE launch settles
them (rounds, adds the residual) as it reads its input: four launches a layer (the last layer keeps five). The
numbers differ from the five-launch layer's only in down's fp32 summation order.

Both apply under the positional mask only; prefill of more than 16 tokens, batches and custom masks (trees) keep
the regular path. Needs fused projections (qkv_proj, gate_up_proj). With EngineConfig.lossless12 the one-token
GEMVs (and the LM head's) read lossless 12-bit copies of the weights (formats/lossless12.py, kernels/gemv12.py):
the same weights in 3/4 of the bytes; multi-token steps read the bf16 weights, which use_lossless12 keeps.
"""

from __future__ import annotations

import torch

from specpilot.kernels import gemv_fused as kernels_gemv
from specpilot.kernels import l2_prefetch as kernels_l2
from specpilot.kernels.gemv12 import gemv12_call
from specpilot.models.cache import KVCache


MAX_TOKENS = 16  # a fused step's tokens: the M-row GEMV's rows (kernels/gemm_rows.py MAX_ROWS) and the split-KV
# attention's queries (kernels/decode_attention.py MAX_T)


def _ops(T: int):
    from specpilot.models.dense import kernel_op

    return kernel_op("rope_write"), kernel_op("decode_attention_one" if T == 1 else "decode_attention_token_major")


# 12-bit GEMVs with a norm prologue: normalize x in one separate RMSNorm launch first (True) instead of in every
# program of the GEMV (False). H200, session 13: the 12-bit GEMVs with the prologue streamed 2.5-2.7 TB/s of stored
# bytes against 3.8-3.9 for the LM head without one; whether a launch more per norm wins back the difference in a
# whole step is what scripts/gpu_step_timing.py's fuseddecode12pre variant measures. Same numbers either way (the
# RMSNorm kernel rounds as the prologue does).
PRENORM_12BIT = False

# M > 1 rows (a fused verify block) with a norm: normalize x in one RMSNorm launch first (True), then run the M-row
# GEMV without its norm prologue (False: the prologue, `_norm_rstds` + a normed [16, BK] tile per K step in every
# program). H200, bf16, M = 16, graphed (scripts/gpu_fused_check.py --only=gemm): with the prologue qkv (1.5B,
# N 2048 K 1536, + bias) took 12.5 us against cuBLAS's 4.55 (the one-row fused GEMV: 4.87), gate_up + SiLU*up 28.8
# against 16.9, the 8B's qkv 33 against 15.1; the same kernel WITHOUT a norm matched cuBLAS (o_proj 4.32 vs 4.49,
# the 8B's 8.04 vs 8.97): the prologue was the bottleneck, not tl.dot. Two more launches a layer
# (costmodel/shapes.py). Same numbers either way: the RMSNorm kernel rounds where the prologue does (x * rstd to
# the dtype, times the weight, to the dtype; the mean of squares over one next-power-of-two block of the row).
PRENORM_ROWS = True


def project(linear, x2: torch.Tensor, norm_weight, eps: float, residual, act: str, out_norm=None, warm_next=None,
            norm_ss=None, ss_out: bool = False):
    """One fused GEMV launch through `linear` for x2 [M, K]: one row over its lossless 12-bit copy when it has one
    (`packed12`, set by DenseLM.use_lossless12; same weights, 3/4 of the bytes), else (and for M > 1 rows: the
    12-bit GEMV takes one) over its bf16 weight. M > 1 rows with a norm: an RMSNorm launch first (PRENORM_ROWS).
    out_norm (an RMSNorm module; the norm epilogue, EngineConfig.norm_epilogue): the same launch also writes the
    output rows' norm -> (y, out_norm(y)) instead of y. warm_next (one row, the bf16 path, no norm epilogue): a
    gate/up weight whose halves' heads the launch warms in L2 (kernels/gemv_fused.py PDL_L2_NEXT_BYTES; a hint).
    The norm handoff (M > 1 rows, bf16 weights; kernels/norm_handoff.py, EngineConfig.norm_handoff): norm_ss, the
    sums of squares of x2's rows a previous launch handed over, normalize x2 in this launch (no RMSNorm launch);
    ss_out -> (y, y's sums of squares) for the launch that normalizes y next."""
    from specpilot.models.dense import kernel_op

    packed = getattr(linear, "packed12", None) if x2.shape[0] == 1 else None
    if (norm_ss is not None or ss_out) and out_norm is None and packed is None:
        y, ss = kernel_op("gemv_fused_handoff")(x2, linear.weight, linear.bias, norm_weight, eps, residual, act,
                                                norm_ss, ss_out)
        return (y, ss) if ss_out else y
    prenorm = PRENORM_12BIT if packed is not None else PRENORM_ROWS and x2.shape[0] > 1
    x2, norm_weight = _prenormed(x2, norm_weight, eps, prenorm)
    norm_out = () if out_norm is None else (out_norm.weight, out_norm.eps)
    if packed is not None:
        return gemv12_call(x2, packed, linear.bias, norm_weight, eps, residual, act, norm_out or None)
    if norm_out:
        return kernel_op("gemv_fused_normed")(x2, linear.weight, linear.bias, norm_weight, eps, residual, act, *norm_out)
    if warm_next is not None and x2.shape[0] == 1:
        return kernel_op("gemv_fused")(x2, linear.weight, linear.bias, norm_weight, eps, residual, act, warm_next)
    return kernel_op("gemv_fused")(x2, linear.weight, linear.bias, norm_weight, eps, residual, act)


def _prenormed(x2: torch.Tensor, norm_weight, eps: float, prenorm: bool):
    """(x2, norm_weight) as the launch after takes them: with `prenorm` and a norm, x2 normalized by one RMSNorm
    launch and no norm left for the launch (PRENORM_ROWS, PRENORM_12BIT); otherwise as they are."""
    if prenorm and norm_weight is not None:
        from specpilot.models.dense import kernel_op

        return kernel_op("rmsnorm")(x2, norm_weight, eps), None
    return x2, norm_weight


def decode_layer(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 cache: KVCache, kv_len: int | None, *, normed: torch.Tensor | None = None, next_norm=None,
                 norm_epilogue: bool = False, rope_in_attention: bool = False, rope_in_qkv: bool = False,
                 l2_prefetch: float = 0.0, pending: torch.Tensor | None = None, mlp_out: torch.Tensor | None = None,
                 handoff: bool = False, norm_ss: torch.Tensor | None = None, ss_out: bool = False,
                 rope_in_qkv_rows: bool = False):
    """x [1, T, H] (the residual stream, 1 <= T <= 16) -> the layer's output [1, T, H]; K/V of the T tokens
    written at `positions` [1, T].

    The norm epilogue (EngineConfig.norm_epilogue, kernels/norm_epilogue.py): `normed` [1, T, H] is this layer's
    input norm of x, already written by the previous layer's down GEMV, so qkv runs norm-free; `norm_epilogue`
    makes o_proj's GEMV also write the post-attention norm, so gate_up runs norm-free; `next_norm` (the next
    layer's input norm, or the final norm) makes down's GEMV write that norm of the output too -> (output,
    next_norm(output)), both [1, T, H]. Same numbers as the norms' own launches or prologues.

    `rope_in_attention` (EngineConfig.rope_in_attention, kernels/rope_attention.py), T = 1 only: the attention
    launch also does q/k norm, RoPE and the K/V write (five launches); T > 1 keeps rope_write's launch.

    `rope_in_qkv` (EngineConfig.rope_in_qkv, kernels/qkv_rope.py), T = 1, the qkv GEMV over its own weights (not a
    12-bit copy): that GEMV's epilogue does the q/k norm (Qwen3: each head's last program), RoPE and the K/V write
    (five launches); otherwise rope_write's launch stays.

    `l2_prefetch` (EngineConfig.l2_prefetch, kernels/l2_prefetch.py): that fraction of gate/up's weight is read
    into L2 on a side stream while qkv, RoPE, attention and o_proj run (latency-bound launches that leave HBM
    idle); gate/up's GEMV waits for it. Same numbers.

    The fused MLP (EngineConfig.fused_mlp, kernels/fused_mlp.py), T = 1 with rope_in_qkv: `pending` [H] fp32 holds
    the previous layer's down sums, which this layer's qkv launch settles into x (the residual it then adds to);
    `mlp_out` [H] fp32 (zero) makes this layer's MLP one launch that leaves its down sums there, so the returned
    x is the residual before the MLP (the next layer, given mlp_out as its `pending`, completes it).

    The norm handoff (EngineConfig.norm_handoff, kernels/norm_handoff.py), T > 1: `handoff` makes o_proj's GEMV hand
    gate_up's its rows' sums of squares (gate_up normalizes from them: no post-attention RMSNorm launch); `norm_ss`:
    the previous layer's down GEMV's, for this layer's input norm (None: layer 0, an RMSNorm launch); `ss_out`:
    down's GEMV hands the next layer such sums -> (output, sums).

    `rope_in_qkv_rows` (EngineConfig.verify_rope_in_qkv, kernels/qkv_rope_rows.py), T > 1, a model without a q/k
    norm: the qkv GEMM's epilogue does RoPE and the K/V write (no rope_write launch)."""
    T = x.shape[1]
    rope_write, attend = _ops(T)
    attn, mlp = layer.self_attn, layer.mlp
    side = None  # (12-bit one-token GEMVs read another copy of the weight: not warmed)
    if l2_prefetch > 0 and (T > 1 or getattr(mlp.gate_up_proj, "packed12", None) is None):
        side = kernels_l2.fork(mlp.gate_up_proj.weight, l2_prefetch)
    h, n, g, d = x.shape[-1], attn.num_heads, attn.num_kv_heads, attn.head_dim
    pre = layer.input_layernorm
    x2 = x.view(T, h)
    i = attn.layer_idx
    if rope_in_qkv and T == 1 and getattr(attn.qkv_proj, "packed12", None) is None:  # one launch: GEMV (+ q/k
        # norm) + RoPE + K/V write
        from specpilot.models.dense import kernel_op

        x_in, nw = (x2, pre.weight) if normed is None else (normed.view(T, h), None)
        qk = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if attn.q_norm is not None else (None, None,
                                                                                                         pre.eps)
        settled = None if pending is None else torch.empty_like(x2)  # x + the previous fused MLP's sums
        q = kernel_op("qkv_rope")(x_in, attn.qkv_proj.weight, attn.qkv_proj.bias, nw, pre.eps, cos, sin, positions,
                                  cache.k[i], cache.v[i], n, *qk, pending, settled)  # [1, n, 1, d]
        keys, values = cache.read(i, kv_len)
        return _after_attention(layer, attend(q, keys, values, positions), x2 if settled is None else settled, T, h, n,
                                d, norm_epilogue, next_norm, side, mlp_out)
    if pending is not None or mlp_out is not None:
        raise ValueError("the fused MLP's sums are settled by a one-token qkv + RoPE launch over bf16 weights "
                         "(rope_in_qkv): this layer has none")
    if rope_in_qkv_rows and T > 1 and attn.q_norm is None and normed is None:  # one launch: GEMM + RoPE + K/V
        from specpilot.models.dense import kernel_op

        # (without handed-over sums the block's norm is a launch of its own, as project's)
        x_in, nw = _prenormed(x2, pre.weight, pre.eps, norm_ss is None and PRENORM_ROWS)
        q = kernel_op("qkv_rope_rows")(x_in, attn.qkv_proj.weight, attn.qkv_proj.bias, nw, pre.eps, cos, sin,
                                       positions, cache.k[i], cache.v[i], n, norm_ss)  # [1, n, T, d]
        keys, values = cache.read(i, kv_len)
        out = attend(q, keys, values, positions, attn.o_proj.weight)
        return _after_attention(layer, out, x2, T, h, n, d, norm_epilogue, next_norm, side, handoff=handoff,
                                ss_out=ss_out)
    if normed is None:  # [T, (n + 2g) d]; normalized from the handed-over sums where there are some
        qkv = project(attn.qkv_proj, x2, pre.weight, pre.eps, None, "", norm_ss=norm_ss)
    else:  # normed by the previous layer's down GEMV
        qkv = project(attn.qkv_proj, normed.view(T, h), None, pre.eps, None, "")
    q, k, v = qkv.split((n * d, g * d, g * d), dim=-1)
    q, k, v = q.view(1, T, n, d).transpose(1, 2), k.view(1, T, g, d).transpose(1, 2), v.view(1, T, g, d).transpose(1, 2)
    qn = attn.q_norm.weight if attn.q_norm is not None else None
    kn = attn.k_norm.weight if attn.k_norm is not None else None
    eps = attn.q_norm.eps if attn.q_norm is not None else pre.eps
    if rope_in_attention and T == 1:  # one launch: q/k norm + RoPE + K/V write + attention (rotated q never stored)
        from specpilot.models.dense import kernel_op

        keys, values = cache.read(i, kv_len)
        out = kernel_op("rope_attention")(q, k, v, cos, sin, positions, keys, values, qn, kn, eps)  # [1, n, 1, d]
    else:
        q = rope_write(q, k, v, cos, sin, positions, cache.k[i], cache.v[i], qn, kn, eps)  # [1, n, T, d]
        keys, values = cache.read(i, kv_len)
        # [1, n, T, d]; T > 1: token-major in memory, o_proj's weight handed over to be warmed in L2 (a hint:
        # kernels/decode_attention.py VERIFY_WARM_MAX_BYTES says where it is taken)
        out = attend(q, keys, values, positions) if T == 1 else attend(q, keys, values, positions, attn.o_proj.weight)
    return _after_attention(layer, out, x2, T, h, n, d, norm_epilogue, next_norm, side,
                            handoff=handoff and T > 1, ss_out=ss_out)


def _after_attention(layer, out, x2, T: int, h: int, n: int, d: int, norm_epilogue: bool, next_norm, side,
                     mlp_out=None, handoff: bool = False, ss_out: bool = False):
    """The layer from its attention output out [1, n, T, d] and residual x2 [T, h] on: o_proj + residual, the MLP
    (decode_layer's arguments say the rest)."""
    attn, mlp = layer.self_attn, layer.mlp
    pre, post = layer.input_layernorm, layer.post_attention_layernorm
    out2 = out.transpose(1, 2).reshape(T, n * d)  # token-major: a view
    post_ss = None  # (the norm handoff's sums for gate_up)
    if norm_epilogue:  # o_proj + residual, and the post-attention norm of the sum from the same launch
        x2, gate_in = project(attn.o_proj, out2, None, pre.eps, x2, "", out_norm=post)
        gate_norm = None  # (already normed)
    elif handoff:  # o_proj + residual, handing gate_up the sum's sums of squares
        x2, post_ss = project(attn.o_proj, out2, None, pre.eps, x2, "", ss_out=True)
        gate_in, gate_norm = x2, post.weight
    else:
        x2 = project(attn.o_proj, out2, None, pre.eps, x2, "", warm_next=_next_warm(mlp, T))  # + residual
        gate_in, gate_norm = x2, post.weight
    if side is not None:  # gate/up's GEMV after its warming
        kernels_l2.join(side)
    if mlp_out is not None:  # the whole MLP in one launch; down's sums stay pending for the next layer's qkv
        from specpilot.models.dense import kernel_op

        kernel_op("fused_mlp")(x2, post.weight, post.eps, mlp.gate_up_proj.weight, mlp.down_t, mlp_out)
        return x2.view(1, T, h)
    act = project(mlp.gate_up_proj, gate_in, gate_norm, post.eps, None, "silu_mul", norm_ss=post_ss)  # [T, I]
    if handoff and ss_out:  # + residual, handing the next layer's qkv its sums of squares
        x2, ss = project(mlp.down_proj, act, None, post.eps, x2, "", ss_out=True)
        return x2.view(1, T, h), ss
    x2 = project(mlp.down_proj, act, None, post.eps, x2, "", out_norm=next_norm)  # + residual (, its next norm)
    if next_norm is None:
        return x2.view(1, T, h)
    return x2[0].view(1, T, h), x2[1].view(1, T, h)


def _next_warm(mlp, T: int):
    """gate/up's bf16 weight for o_proj's launch to warm the head of (kernels/gemv_fused.py PDL_L2_NEXT_BYTES, set
    from EngineConfig.pdl_l2_next_mb; `next_warming` decides whether o_proj's launch can), or None: more than one
    token, the warming off, or a 12-bit gate/up (its GEMV reads another copy of the weight)."""
    if T != 1 or kernels_gemv.PDL_L2_NEXT_BYTES <= 0 or getattr(mlp.gate_up_proj, "packed12", None) is not None:
        return None
    return mlp.gate_up_proj.weight


def applies(model, input_ids: torch.Tensor, attn_mask, is_causal: bool) -> bool:
    """Whether `model.forward` runs this path: the positional mask, one row, and one token with fused_decode on or
    2..16 tokens with fused_verify on."""
    if attn_mask is not None or is_causal or input_ids.shape[0] != 1:
        return False
    T = input_ids.shape[1]
    return model.fused_decode if T == 1 else model.fused_verify and T <= MAX_TOKENS
