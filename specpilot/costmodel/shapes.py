"""What one forward pass of a dense decoder must move and compute: pure arithmetic on a ModelConfig.

`forward_cost(cfg, num_tokens, context_len)` -> PassCost for a pass of `num_tokens` new tokens (T) that attend over
`context_len` tokens already in the KV cache (the prefix) plus themselves. `param_count(cfg)` counts parameters as
HF does. `synthetic_config(name)` gives the shapes of well-known models with no weight files.

Invariants:
  * Bytes count what the pass must read or write from memory at least once; FLOPs count multiply-adds as 2.
  * Weights are read once per pass whatever T is (that is why speculation pays); the embedding contributes only
    the rows of the T tokens; a tied embedding/LM head matrix is counted once, as the LM head.
  * Attention is computed as in our implementation: every query against every key in the span (no causal
    skipping inside the block), so FLOPs and K/V reads use the span `context_len + T`.
  * `num_kernels` is an estimate for our eager-style DenseLM (models/dense.py), not a measured count; the
    breakdown is in `_LAYER_KERNELS` / `_HEAD_KERNELS` and the GPU check script prints the profiled count.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specpilot.errors import ConfigError
from specpilot.models.config import ModelConfig

# Kernels per decoder layer of DenseLM, counted from its aten ops (views excluded):
#   RMSNorm 8 (to fp32, pow, mean, +eps, rsqrt, mul, to dtype, *weight), twice per layer;
#   q/k/v/o projections 4; RoPE 10 (neg, cat, 2 mul, add; for q and k); KV-cache write 2 (index_copy K, V);
#   attention 4 (bool mask -> additive mask ~3, fused SDPA 1); head merge copy 1; 2 residual adds;
#   MLP 5 (gate, up, silu, mul, down). Qwen3's q/k RMSNorm adds 2 * 8.
_NORM_KERNELS = 8
_NORM_KERNEL_LAUNCHES = 1  # one RMSNorm through the Triton kernel (kernels/rmsnorm.py, EngineConfig.norm_kernel)
_ROPE_KERNELS = 10
_ROPE_KERNEL_LAUNCHES = 1  # q and k of one layer through the Triton kernel (kernels/rope.py, EngineConfig.rope_kernel)
_LAYER_KERNELS = 2 * _NORM_KERNELS + 4 + _ROPE_KERNELS + 2 + 4 + 1 + 2 + 5  # = 44
_QK_NORM_KERNELS = 2 * _NORM_KERNELS
# Per pass: embedding 1, RoPE tables 7 (positions to fp32, * inv_freq, cat, cos, sin, 2 casts), causal mask 2
# (arange, compare), final RMSNorm 8, LM head 1, logits to fp32 1.
_HEAD_KERNELS = 1 + 7 + 2 + _NORM_KERNELS + 1 + 1  # = 20
_LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down
_FUSED_LINEARS_PER_LAYER = 4  # qkv, o, gate+up, down (DenseLM.fuse_projections)
# torch.compile (Inductor) fuses each run of elementwise ops between two GEMMs / attention calls into one kernel:
# per layer RMSNorm 2, RoPE + KV-cache write 1, attention ~2 (mask or split-KV + merge), SiLU * up 1; per pass
# embedding + RoPE tables 1, final RMSNorm 1, logits cast 1. An estimate (the GPU check prints profiled counts).
_COMPILED_LAYER_OTHER_KERNELS = 6
# fused_decode (models/fused_decode.py), one token: per layer 4 GEMVs (norms as prologues, residual adds and SiLU * up
# as epilogues), RoPE + K/V write 1, attention 1; per pass embedding 1, RoPE tables 7, LM head 1, logits cast 1
# (+ the final norm)
_FUSED_DECODE_LAYER_KERNELS = _FUSED_LINEARS_PER_LAYER + 2
_FUSED_DECODE_HEAD_KERNELS = 1 + 7 + 1 + 1
# fused_verify (with fused_decode), 2-16 tokens in one row: the same layer at T rows, but its attention is the
# split-KV kernel + its merge (two launches; the one-launch variant is fused decode's alone), and its two
# RMSNorms are launches of their own ahead of norm-free M-row GEMVs (models/fused_decode.py PRENORM_ROWS: the
# M-row norm prologue was the H200's bottleneck): 9 a layer. The head's count is unchanged (its LM head is
# cuBLAS's GEMM, no mask). Bytes as for any pass: the M-row GEMVs read each weight once for all T rows, the
# activations count T rows (the normed copies, T rows of H twice a layer, are not counted: ~1e-4 of the weights)
_FUSED_VERIFY_LAYER_KERNELS = _FUSED_LINEARS_PER_LAYER + 3 + 2
# norm_epilogue (kernels/norm_epilogue.py), with a fused pass: the residual GEMVs also write the norm the next GEMV
# reads, so a block's two RMSNorm launches a layer go (9 -> 7; layer 0's input norm stays: one launch a pass) and
# every fused pass loses the final norm (the last down GEMV writes it). A one-token layer keeps its six (its norms
# were GEMV prologues: what it gains, norm-free GEMVs streaming faster, is not priced here)
_FUSED_VERIFY_EPILOGUE_LAYER_KERNELS = _FUSED_LINEARS_PER_LAYER + 3
# rope_in_attention (kernels/rope_attention.py), with fused_decode: a one-token layer's RoPE + K/V write runs inside
# its attention launch (6 -> 5; with pdl the five launch with PDL). Fused verify blocks keep theirs. rope_in_qkv
# (kernels/qkv_rope.py) takes the same launch into the qkv GEMV instead: the same count.
_FUSED_DECODE_ROPE_ATTENTION_LAYER_KERNELS = _FUSED_DECODE_LAYER_KERNELS - 1
# fused_mlp (kernels/fused_mlp.py), with rope_in_qkv: a one-token layer's gate/up and down GEMVs are one launch
# (every layer but the last: 5 -> 4), plus one zeroing of the pending rows a pass (not launched with PDL)
_FUSED_MLP_PASS_KERNELS = 1
# norm_handoff (kernels/norm_handoff.py), with a fused block and without norm_epilogue: the same 7 a layer, but the
# final norm keeps its launch (the LM head is cuBLAS's), so a block has two norm launches: layer 0's and the final.
# pdl (kernels/pdl.py), with fused_decode: the six (five) launches a layer and the LM head GEMV launch with programmatic
# dependent launch (the embedding, RoPE tables, final norm and cast do not); a fused verify pass: its 4 GEMVs and
# RoPE + K/V write a layer (its two RMSNorms, the split-KV attention pair and the cuBLAS LM head launch without)
_PDL_HEAD_KERNELS = 1
_PDL_VERIFY_KERNELS_PER_LAYER = _FUSED_LINEARS_PER_LAYER + 1
MAX_FUSED_VERIFY_TOKENS = 16  # models/fused_decode.py MAX_TOKENS (no import: the cost model stays torch-free)
_COMPILED_HEAD_OTHER_KERNELS = 3


@dataclass(frozen=True)
class PassCost:
    num_tokens: int  # T, new tokens in the pass
    context_len: int  # tokens already in the KV cache before the pass
    weight_bytes: float  # bytes of weights read (once)
    kv_bytes: float  # K/V bytes read over the attention span + written for the T new tokens
    activation_bytes: float  # rough: hidden states in/out per layer + logits written
    flops: float  # 2 * linear params * T + attention 4 * T * span * heads * head_dim per layer
    num_kernels: int  # estimated kernels of one pass of our implementation (see module docstring)
    num_linear_kernels: int  # of which GEMM/GEMV launches (7 per layer + LM head)
    num_layers: int = 0  # attention calls in the pass
    attn_keys: int = 0  # key slots each attention call covers: context + T, or the whole pool when graphed
    head_bytes: float = 0.0  # of weight_bytes, the LM head's: one large GEMV, streamed at a large matrix's rate
    # of num_kernels, the eager RMSNorm (8 each) and RoPE (10 a layer) kernels: fp32 elementwise / reduction
    # chains that cost more per graphed kernel than a tiny add (HardwareCeilings.eager_kernel_s)
    num_eager_kernels: int = 0
    # of num_kernels, those launched with PDL (EngineConfig.pdl: a fused one-token pass): each may start while the
    # kernel before it drains, so it pays only part of a graphed launch's gap (gaps.PDL_GAP_FACTOR)
    num_pdl_kernels: int = 0
    # those PDL launches with the GEMVs' trigger after their K loop (EngineConfig.pdl_trigger "late"), which gives
    # back more of each gap (gaps.PDL_LATE_GAP_FACTOR)
    pdl_late: bool = False
    # the rate the weights stream at, relative to the measured 16-bit GEMV chains' (lossless 12-bit GEMVs decode as
    # they go: LOSSLESS12_RATE); the floor (pass_floor_s) counts the bytes alone
    weight_rate: float = 1.0
    # of weight_bytes, those a one-token fused pass warms in L2 before the GEMVs' PDL waits (EngineConfig.pdl_l2_mb
    # / pdl_l2_share): streamed while the latency-bound kernel ahead runs, so off the pass's critical path
    # (gaps.pass_predicted_s does not count them; the floor does)
    l2_warm_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}


# --- parameter counts (elements, not bytes) -----------------------------------------------------------------


def _layer_linear_params(cfg: ModelConfig) -> int:
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attn = h * q + 2 * h * kv + q * h  # q, k, v [out, in] and o
    bias = (q + 2 * kv) if cfg.attention_bias else 0
    mlp = 3 * h * cfg.intermediate_size  # gate, up, down
    return attn + bias + mlp


def _layer_norm_params(cfg: ModelConfig) -> int:
    return 2 * cfg.hidden_size + (2 * cfg.head_dim if cfg.qk_norm else 0)


def _lm_head_params(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.hidden_size


def param_count(cfg: ModelConfig) -> int:
    """All parameters, as HF counts them: a tied embedding/LM head matrix once, an untied pair twice."""
    layers = cfg.num_hidden_layers * (_layer_linear_params(cfg) + _layer_norm_params(cfg))
    embed = cfg.vocab_size * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else _lm_head_params(cfg)
    return embed + layers + cfg.hidden_size + head  # + final norm


# --- one forward pass ---------------------------------------------------------------------------------------


# lossless 12-bit weights (formats/lossless12.py): bytes a weight, the exception lists included (measured on
# Qwen2.5-Coder-1.5B and N(0, 0.02) matrices: 1.500-1.507), and the rate their GEMVs (kernels/gemv12.py) stream
# stored bytes at relative to the 16-bit fused GEMVs' (H200, session 13, graphed one-token steps: 1.5B 1.66 ms vs
# 1.44-1.55, Qwen3-8B 4.88 vs 4.61 with 3/4 of the bytes -> ~0.69: the decode is not yet hidden under the stream)
LOSSLESS12_BYTES = 1.505
LOSSLESS12_RATE = 0.69


def _weight_bytes(cfg: ModelConfig, T: int, dtype_bytes: int, linear_bytes: float | None = None) -> float:
    """Weights a pass reads; `linear_bytes`: bytes a weight of the projections and the LM head when they are
    stored otherwise (lossless 12-bit), else dtype_bytes."""
    linear = cfg.num_hidden_layers * _layer_linear_params(cfg) + _lm_head_params(cfg)
    rows = T * cfg.hidden_size  # embedding rows gathered; the full matrix only counts as the LM head
    other = cfg.num_hidden_layers * _layer_norm_params(cfg) + cfg.hidden_size + rows
    return linear * (dtype_bytes if linear_bytes is None else linear_bytes) + other * dtype_bytes


def _l2_warm_bytes(cfg: ModelConfig, dtype_bytes: int, pdl_l2_mb: float, pdl_l2_share: float,
                   pdl_l2_next_mb: float = 0) -> float:
    """Bytes of a one-token fused pass's GEMV weights warmed in L2 before their PDL wait: each fused projection
    (qkv, o, gate/up, down) of at most pdl_l2_mb MiB, times the share warmed, plus (pdl_l2_next_mb) the head of
    gate/up's weight that o_proj's launch warms where o_proj is warmed itself (at most what is not warmed
    already), over the layers (the LM head is never that small in practice, and is left out)."""
    h, q, kv, i = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim,
                   cfg.intermediate_size)
    limit = pdl_l2_mb * (1 << 20)
    gate_up = 2 * i * h * dtype_bytes
    sizes = ((q + 2 * kv) * h * dtype_bytes, q * h * dtype_bytes, gate_up, i * h * dtype_bytes)
    per_layer = sum(n for n in sizes if n <= limit) * pdl_l2_share
    if pdl_l2_next_mb > 0 and sizes[1] <= limit:  # kernels/gemv_fused.py PDL_L2_NEXT_BYTES, behind a warmed o_proj
        # only (gemv_fused.next_warming); bytes already warm count once
        left = gate_up * (1 - pdl_l2_share) if gate_up <= limit else gate_up
        per_layer += min(pdl_l2_next_mb * (1 << 20), left)
    return cfg.num_hidden_layers * per_layer


def _kv_bytes(cfg: ModelConfig, T: int, context_len: int, dtype_bytes: int) -> float:
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes  # K and V
    return per_token * ((context_len + T) + T)  # read the span, write the T new tokens


def _activation_bytes(cfg: ModelConfig, T: int, dtype_bytes: int) -> float:
    hidden = 2 * cfg.num_hidden_layers * T * cfg.hidden_size * dtype_bytes  # in + out per layer
    logits = T * cfg.vocab_size * (dtype_bytes + 4)  # LM head output, then its fp32 copy
    return hidden + logits


def _flops(cfg: ModelConfig, T: int, context_len: int) -> float:
    linear = cfg.num_hidden_layers * _layer_linear_params(cfg) + _lm_head_params(cfg)
    attn = 4 * T * (context_len + T) * cfg.num_attention_heads * cfg.head_dim  # QK^T and PV, per layer
    return 2.0 * linear * T + cfg.num_hidden_layers * attn


# The engine's Triton-kernel switches that change a dense pass's kernel count (EngineConfig fields of these names)
KERNEL_FLAGS = ("norm_kernel", "rope_kernel", "act_kernel", "add_norm_kernel", "fused_decode", "fused_verify",
                "lossless12", "pdl", "pdl_late", "norm_epilogue", "rope_in_attention", "rope_in_qkv", "fused_mlp",
                "norm_handoff", "verify_rope_in_qkv")
_DENSE_ONLY_FLAGS = ("add_norm_kernel", "fused_decode", "fused_verify", "lossless12", "pdl", "pdl_late",
                     "norm_epilogue", "norm_handoff", "verify_rope_in_qkv",
                     "rope_in_attention", "rope_in_qkv", "fused_mlp")


def kernel_flags(obj) -> dict[str, bool]:
    """The KERNEL_FLAGS of a config, profile or knobs object (missing ones: off), to pass on as keywords."""
    return {f: bool(getattr(obj, f, False)) for f in KERNEL_FLAGS}


def l2_fields(obj) -> dict[str, float]:
    """A config's, profile's or knobs object's L2 warming (EngineConfig.pdl_l2_mb / pdl_l2_share /
    pdl_l2_next_mb; missing: off),
    as forward_cost's keywords: nothing without PDL, where the engine warms nothing."""
    on = bool(getattr(obj, "pdl", False))
    return {"pdl_l2_mb": getattr(obj, "pdl_l2_mb", 0) if on else 0, "pdl_l2_share": getattr(obj, "pdl_l2_share", 1.0),
            "pdl_l2_next_mb": getattr(obj, "pdl_l2_next_mb", 0) if on else 0}


def draft_kernel_flags(obj) -> dict[str, bool]:
    """The switches a DFlash draft pass follows (engine.build_drafter; not _DENSE_ONLY_FLAGS, which are the dense
    model's), for dflash_pass_cost."""
    return {f: v for f, v in kernel_flags(obj).items() if f not in _DENSE_ONLY_FLAGS}


def kernels_per_layer(cfg: ModelConfig, norm_kernel: bool = False, rope_kernel: bool = False,
                      act_kernel: bool = False, add_norm_kernel: bool = False) -> int:
    """Kernels of one eager layer. `act_kernel`: SiLU and the multiply in one launch (2 -> 1); `add_norm_kernel`:
    each residual add takes the RMSNorm after it into its launch (the layer's two norms disappear; over a pass
    the final norm joins the last add and layer 0's input norm stays: the head's count is unchanged)."""
    norms = 2 + (2 if cfg.qk_norm else 0)
    per_norm = _NORM_KERNEL_LAUNCHES if norm_kernel else _NORM_KERNELS
    saved = norms * (_NORM_KERNELS - _NORM_KERNEL_LAUNCHES) if norm_kernel else 0
    saved += _ROPE_KERNELS - _ROPE_KERNEL_LAUNCHES if rope_kernel else 0
    saved += 1 if act_kernel else 0
    saved += 2 * per_norm if add_norm_kernel else 0
    return _LAYER_KERNELS + (_QK_NORM_KERNELS if cfg.qk_norm else 0) - saved


def _kernel_counts(cfg: ModelConfig, fused: bool, compiled: bool, norm_kernel: bool = False,
                   rope_kernel: bool = False, act_kernel: bool = False, add_norm_kernel: bool = False
                   ) -> tuple[int, int]:
    """(all kernels, GEMM kernels) of one pass: fused projections cut GEMMs, compilation the elementwise kernels,
    the RMSNorm kernel 7 of each norm's 8, the RoPE kernel 9 of a layer's 10 (under compile both are already
    fused into neighbouring kernels: no change)."""
    L = cfg.num_hidden_layers
    linear = L * (_FUSED_LINEARS_PER_LAYER if fused else _LINEARS_PER_LAYER) + 1  # + LM head
    if compiled:
        other = L * _COMPILED_LAYER_OTHER_KERNELS + _COMPILED_HEAD_OTHER_KERNELS
    else:
        head = _HEAD_KERNELS - (_NORM_KERNELS - _NORM_KERNEL_LAUNCHES if norm_kernel else 0)
        other = L * (kernels_per_layer(cfg, norm_kernel, rope_kernel, act_kernel, add_norm_kernel)
                     - _LINEARS_PER_LAYER) + head - 1
    return linear + other, linear


def eager_chain_kernels(cfg: ModelConfig, compiled: bool = False, norm_kernel: bool = False,
                        rope_kernel: bool = False, add_norm_kernel: bool = False) -> int:
    """Kernels of one pass spent in eager RMSNorms (every layer's, the final one) and RoPE (0 under compile:
    Inductor fuses them; each Triton kernel replaces its chain)."""
    if compiled:
        return 0
    # with add_norm_kernel the layers' two norms run inside the adds' launches (layer 0's input norm stays)
    norms = cfg.num_hidden_layers * ((0 if add_norm_kernel else 2) + (2 if cfg.qk_norm else 0)) + 1
    return (0 if norm_kernel else norms * _NORM_KERNELS) + (0 if rope_kernel else cfg.num_hidden_layers * _ROPE_KERNELS)


def forward_cost(cfg: ModelConfig, num_tokens: int, context_len: int, dtype_bytes: int = 2,
                 pool_len: int | None = None, *, fused: bool = False, compiled: bool = False,
                 norm_kernel: bool = False, rope_kernel: bool = False, act_kernel: bool = False,
                 add_norm_kernel: bool = False, fused_decode: bool = False, fused_verify: bool = False,
                 lossless12: bool = False, pdl: bool = False, norm_epilogue: bool = False,
                 rope_in_attention: bool = False, rope_in_qkv: bool = False, pdl_late: bool = False,
                 pdl_l2_mb: float = 0, pdl_l2_share: float = 1.0, pdl_l2_next_mb: float = 0,
                 fused_mlp: bool = False, norm_handoff: bool = False,
                 verify_rope_in_qkv: bool = False) -> PassCost:
    """Cost of one pass of `num_tokens` tokens after `context_len` cached ones, weights/KV in `dtype_bytes`.
    `pool_len`: the KV pool a graphed pass attends over in full (masked); None: only the span is read.
    `fused` (q/k/v and gate/up projections fused), `compiled` (torch.compile), `norm_kernel` (each RMSNorm one
    Triton launch), `rope_kernel` (a layer's RoPE one launch), `act_kernel` and `add_norm_kernel` (see
    kernels_per_layer) change only the kernel counts; `fused_decode` a one-token pass's (models/fused_decode.py),
    `fused_verify` (with fused_decode) a 2-16-token pass's; `lossless12` (with fused_decode) a one-token pass's
    weight bytes: the projections and the LM head read 12-bit copies; `pdl` (with fused_decode) marks the fused
    passes' Triton launches as launched with PDL (`num_pdl_kernels`; `pdl_late`: the GEMVs' trigger after their
    K loop); and `norm_epilogue` takes a fused pass's
    norm launches into its residual GEMVs (_FUSED_VERIFY_EPILOGUE_LAYER_KERNELS); `rope_in_attention` a one-token
    fused layer's RoPE + K/V write launch into its attention's (_FUSED_DECODE_ROPE_ATTENTION_LAYER_KERNELS);
    `rope_in_qkv` the same launch into its qkv GEMV's (one launch fewer too, a q/k-norm model's as well);
    `pdl_l2_mb` / `pdl_l2_share` (with pdl, a one-token fused pass of 16-bit
    weights) the GEMV weights it warms in L2 before their waits (`PassCost.l2_warm_bytes`), `pdl_l2_next_mb` the
    head of gate/up's weight o_proj's launch warms; `fused_mlp` (with rope_in_qkv, without norm_epilogue or
    lossless12) a one-token fused layer's two MLP GEMVs into one launch (all layers but the last); `norm_handoff`
    (without norm_epilogue) a fused block's norm launches into its GEMVs but layer 0's input norm and the final norm
    (kernels/norm_handoff.py); `verify_rope_in_qkv` a fused block's RoPE + K/V write launch into its qkv GEMM (a
    model without a q/k norm: kernels/qkv_rope_rows.py)."""
    if num_tokens < 1 or context_len < 0 or dtype_bytes < 1:
        raise ConfigError(f"forward_cost needs num_tokens >= 1, context_len >= 0, dtype_bytes >= 1 "
                          f"(got {num_tokens}, {context_len}, {dtype_bytes})")
    kernels = _kernel_counts(cfg, fused, compiled, norm_kernel, rope_kernel, act_kernel, add_norm_kernel)
    eager = eager_chain_kernels(cfg, compiled, norm_kernel, rope_kernel, add_norm_kernel)
    one_token_fused = fused_decode and num_tokens == 1 and not compiled
    block_fused = fused_decode and fused_verify and 2 <= num_tokens <= MAX_FUSED_VERIFY_TOKENS and not compiled
    linear_bytes = LOSSLESS12_BYTES if lossless12 and one_token_fused and dtype_bytes == 2 else None
    pdl_kernels = 0
    if one_token_fused or block_fused:  # six (nine) launches a layer, the head without a mask
        L = cfg.num_hidden_layers
        norms = _NORM_KERNEL_LAUNCHES if norm_kernel else _NORM_KERNELS  # the final norm's
        per_layer = _FUSED_DECODE_LAYER_KERNELS if one_token_fused else _FUSED_VERIFY_LAYER_KERNELS
        if one_token_fused and (rope_in_attention or rope_in_qkv):
            per_layer = _FUSED_DECODE_ROPE_ATTENTION_LAYER_KERNELS
        eager = 0 if norm_kernel else _NORM_KERNELS
        if norm_epilogue:  # the final norm comes out of the last down GEMV; a block keeps layer 0's input norm
            eager = 0
            norms = _NORM_KERNEL_LAUNCHES if block_fused else 0
            per_layer = _FUSED_VERIFY_EPILOGUE_LAYER_KERNELS if block_fused else per_layer
        elif norm_handoff and block_fused:  # the final norm stays; layer 0's input norm is one launch more
            norms += _NORM_KERNEL_LAUNCHES
            per_layer = _FUSED_VERIFY_EPILOGUE_LAYER_KERNELS
        rope_merged = block_fused and verify_rope_in_qkv and not cfg.qk_norm  # one launch fewer a layer
        per_layer -= rope_merged
        kernels = (L * per_layer + _FUSED_DECODE_HEAD_KERNELS + norms, L * _FUSED_LINEARS_PER_LAYER + 1)
        merged = (L - 1 if one_token_fused and fused_mlp and rope_in_qkv and not norm_epilogue
                  and linear_bytes is None else 0)  # MLPs in one launch (the last layer's keeps two)
        if merged:
            kernels = (kernels[0] - merged + _FUSED_MLP_PASS_KERNELS, kernels[1] - merged)
        if pdl:
            pdl_kernels = (L * per_layer - merged + _PDL_HEAD_KERNELS if one_token_fused
                           else L * (_PDL_VERIFY_KERNELS_PER_LAYER - rope_merged))
    warm = (_l2_warm_bytes(cfg, dtype_bytes, pdl_l2_mb, pdl_l2_share, pdl_l2_next_mb)
            if pdl_kernels and one_token_fused and linear_bytes is None and (pdl_l2_mb > 0 or pdl_l2_next_mb > 0)
            else 0.0)
    return PassCost(
        num_tokens=num_tokens,
        context_len=context_len,
        weight_bytes=_weight_bytes(cfg, num_tokens, dtype_bytes, linear_bytes),
        kv_bytes=_kv_bytes(cfg, num_tokens, context_len, dtype_bytes),
        activation_bytes=_activation_bytes(cfg, num_tokens, dtype_bytes),
        flops=_flops(cfg, num_tokens, context_len),
        num_kernels=kernels[0],
        num_linear_kernels=kernels[1],
        num_layers=cfg.num_hidden_layers,
        attn_keys=pool_len if pool_len else context_len + num_tokens,
        head_bytes=_lm_head_params(cfg) * (dtype_bytes if linear_bytes is None else linear_bytes),
        num_eager_kernels=eager,
        weight_rate=LOSSLESS12_RATE if linear_bytes is not None else 1.0,
        num_pdl_kernels=pdl_kernels,
        pdl_late=bool(pdl_kernels) and pdl_late,
        l2_warm_bytes=warm,
    )


# --- a DFlash draft pass -------------------------------------------------------------------------------------

# Launches of one static draft step (drafters/dflash.py `_static_step`, the step the engine captures as a CUDA
# graph), counted from its aten ops in bf16 (tests/test_dflash_fused.py counts them with a dispatch mode and
# checks this count). Per draft layer, beside the GEMMs:
#   RMSNorms 5 (input, post-attention, the block's q and k, the context's k; 8 eager kernels each, 1 with the
#   kernel); RoPE of the block's q and k 10 (1 with the kernel) and of the context's keys 5 (1); the context's
#   K/V cache write 2; attention: masked SDPA 3 (cat keys, cat values, SDPA; its output is already token-major, so
#   the head merge is a view), or with the split-KV kernel (DFlashDrafter.use_attention_kernel) the block's K/V
#   cache write 2 + the kernel's 2 launches (split + merge); 2 residual adds; SiLU x mul 2 (1 with the kernel).
# GEMMs a layer: the block's q, k, v 3 (1 fused), the context's k, v 2 (1 fused), o, gate, up (1 fused), down.
# Per pass: the step's positions from its scalars 5 (lt, sub, where, 2 adds), the block ids' cat 1, embedding 1,
# fc 1 (a GEMM) + hidden_norm, RoPE tables over both position runs 7 (cat, mul, cat, cos, sin, 2 casts), with SDPA
# the visibility mask 7 (arange, cat, lt, ones_like, cat, ones, and), the final norm, LM head 1 (a GEMM), argmax 1.
# An eager pass (the prompt's first) differs a little (its positions are aranges); only static passes are priced.
_DFLASH_LAYER_NORMS = 5
_DFLASH_ROPE_BLOCK_KERNELS = _ROPE_KERNELS
_DFLASH_ROPE_CTX_KERNELS = _ROPE_KERNELS // 2
_DFLASH_CTX_WRITE_KERNELS = 2
_DFLASH_SDPA_KERNELS = 3
_DFLASH_ATTN_KERNEL_LAUNCHES = 2 + 2  # the block's K/V write + split-KV attention and its merge
_DFLASH_LAYER_ADDS = 2
_DFLASH_LINEARS = 3 + 2 + 1 + 2 + 1  # q k v, context k v, o, gate up, down
_DFLASH_FUSED_LINEARS = 1 + 1 + 1 + 1 + 1  # qkv, context kv, o, gate_up, down (DFlashDrafter.fuse_projections)
_DFLASH_STEP_INPUT_KERNELS = 5 + 1 + 1  # positions, ids cat, embedding
_DFLASH_ROPE_TABLE_KERNELS = 7
_DFLASH_MASK_KERNELS = 7
_DFLASH_PASS_NORMS = 2  # hidden_norm, final norm
_DFLASH_PASS_LINEARS = 2  # fc, LM head
_DFLASH_ARGMAX_KERNELS = 1


def dflash_pass_kernels(num_layers: int, *, fused: bool = False, norm_kernel: bool = False,
                        rope_kernel: bool = False, act_kernel: bool = False,
                        attention_kernel: bool = False) -> tuple[int, int, int]:
    """(all launches, GEMM launches, eager norm / RoPE chain launches) of one static DFlash draft step (the
    graphed step; see the count above). `attention_kernel`: the block attends through the split-KV kernel
    (EngineConfig.draft_attention_kernel): no mask, 2 launches, and the block's K/V are written to the cache."""
    norm = _NORM_KERNEL_LAUNCHES if norm_kernel else _NORM_KERNELS
    rope = (2 * _ROPE_KERNEL_LAUNCHES if rope_kernel else _DFLASH_ROPE_BLOCK_KERNELS + _DFLASH_ROPE_CTX_KERNELS)
    attn = _DFLASH_ATTN_KERNEL_LAUNCHES if attention_kernel else _DFLASH_SDPA_KERNELS
    linears = _DFLASH_FUSED_LINEARS if fused else _DFLASH_LINEARS
    layer = (linears + _DFLASH_LAYER_NORMS * norm + rope + _DFLASH_CTX_WRITE_KERNELS + attn + _DFLASH_LAYER_ADDS
             + (1 if act_kernel else 2))
    head = (_DFLASH_STEP_INPUT_KERNELS + _DFLASH_PASS_LINEARS + _DFLASH_PASS_NORMS * norm + _DFLASH_ROPE_TABLE_KERNELS
            + (0 if attention_kernel else _DFLASH_MASK_KERNELS) + _DFLASH_ARGMAX_KERNELS)
    eager = ((0 if norm_kernel else (num_layers * _DFLASH_LAYER_NORMS + _DFLASH_PASS_NORMS) * _NORM_KERNELS)
             + (0 if rope_kernel else num_layers * (_DFLASH_ROPE_BLOCK_KERNELS + _DFLASH_ROPE_CTX_KERNELS)))
    return num_layers * layer + head, num_layers * linears + _DFLASH_PASS_LINEARS, eager


def dflash_pass_cost(dcfg, target_cfg: ModelConfig, context_len: int, new_context: int,
                     dtype_bytes: int = 2, pool_len: int | None = None, *, fused: bool = False,
                     norm_kernel: bool = False, rope_kernel: bool = False, act_kernel: bool = False,
                     attention_kernel: bool = False) -> PassCost:
    """One DFlash draft pass (models/dflash.py): the block (block_size tokens: anchor + masks) through the draft
    layers, attending over the draft cache's `context_len` slots; `new_context` target feature rows projected
    (fc), turned into K/V and written; the block's hidden states through the target's LM head. `norm_kernel`:
    every RMSNorm one launch; `rope_kernel`: the block's q/k in one launch and the context keys in another;
    `act_kernel`: SiLU x mul in one launch (the drafter follows the engine's switches, engine.build_drafter);
    `fused`: fused projections (EngineConfig.fused_projections), 4 GEMMs a layer fewer, same bytes and FLOPs;
    `attention_kernel`: the split-KV kernel instead of masked SDPA (EngineConfig.draft_attention_kernel). The
    launch counts are `dflash_pass_kernels` (the static step's, counted from its ops)."""
    B = dcfg.block_size
    dense = ModelConfig(model_type="qwen3", vocab_size=target_cfg.vocab_size, hidden_size=dcfg.hidden_size,
                        intermediate_size=dcfg.intermediate_size, num_hidden_layers=dcfg.num_hidden_layers,
                        num_attention_heads=dcfg.num_attention_heads, num_key_value_heads=dcfg.num_key_value_heads,
                        head_dim=dcfg.head_dim, qk_norm=True)
    base = forward_cost(dense, B, context_len, dtype_bytes, pool_len=pool_len + B if pool_len else None)
    kernels, linears, eager = dflash_pass_kernels(dcfg.num_hidden_layers, fused=fused, norm_kernel=norm_kernel,
                                                  rope_kernel=rope_kernel, act_kernel=act_kernel,
                                                  attention_kernel=attention_kernel)
    feat = len(dcfg.target_layer_ids) * dcfg.hidden_size
    fc = feat * dcfg.hidden_size
    kv_proj = dcfg.num_hidden_layers * 2 * dcfg.hidden_size * dcfg.num_key_value_heads * dcfg.head_dim
    kv_write = new_context * 2 * dcfg.num_hidden_layers * dcfg.num_key_value_heads * dcfg.head_dim * dtype_bytes
    return PassCost(
        num_tokens=B,
        context_len=context_len,
        weight_bytes=base.weight_bytes + fc * dtype_bytes,
        kv_bytes=base.kv_bytes + kv_write,
        activation_bytes=base.activation_bytes + new_context * feat * dtype_bytes,
        flops=base.flops + 2.0 * (fc + kv_proj) * new_context,
        num_kernels=kernels,
        num_linear_kernels=linears,
        num_layers=base.num_layers,
        attn_keys=base.attn_keys,
        head_bytes=base.head_bytes,
        num_eager_kernels=eager,
    )


# --- well-known shapes --------------------------------------------------------------------------------------

_QWEN_VOCAB = 151936
_SYNTHETIC: dict[str, dict] = {
    "qwen3-8b": dict(model_type="qwen3", num_hidden_layers=36, hidden_size=4096, intermediate_size=12288,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, qk_norm=True,
                     tie_word_embeddings=False, rope_theta=1_000_000.0, max_position_embeddings=40960),
    "qwen3-32b": dict(model_type="qwen3", num_hidden_layers=64, hidden_size=5120, intermediate_size=25600,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128, qk_norm=True,
                      tie_word_embeddings=False, rope_theta=1_000_000.0, max_position_embeddings=40960),
    "qwen2.5-1.5b": dict(model_type="qwen2", num_hidden_layers=28, hidden_size=1536, intermediate_size=8960,
                         num_attention_heads=12, num_key_value_heads=2, head_dim=128, attention_bias=True,
                         tie_word_embeddings=True, rope_theta=1_000_000.0, max_position_embeddings=32768),
    "qwen2.5-0.5b": dict(model_type="qwen2", num_hidden_layers=24, hidden_size=896, intermediate_size=4864,
                         num_attention_heads=14, num_key_value_heads=2, head_dim=64, attention_bias=True,
                         tie_word_embeddings=True, rope_theta=1_000_000.0, max_position_embeddings=32768),
}
SYNTHETIC_NAMES = tuple(_SYNTHETIC)


def synthetic_config(name: str) -> ModelConfig:
    """The ModelConfig of a well-known model shape (no weights needed): one of SYNTHETIC_NAMES."""
    try:
        spec = _SYNTHETIC[name]
    except KeyError:
        raise ConfigError(f"unknown synthetic model {name!r}; known: {', '.join(SYNTHETIC_NAMES)}") from None
    return ModelConfig(vocab_size=_QWEN_VOCAB, rms_norm_eps=1e-6, **spec)
