"""The dense decoder family: Llama, Qwen2/2.5 (qkv bias), Qwen3 (q/k RMSNorm). A pure forward pass.

`forward(input_ids, positions, cache)` serves prefill, one-token decode and multi-token verification alike: it
writes the new tokens' K/V into the preallocated cache at their positions, then attends over the cache with a
mask (causal by position unless an explicit mask is given, e.g. a tree). A plain causal pass from position 0
(`is_causal=True`, the caller's promise) needs no mask tensor, which lets SDPA take its flash path. It returns the
final-normed hidden states, and on request the outputs of chosen decoder layers (the DFlash drafter conditions on
them); `last_layer` stops after a given layer when only such outputs are wanted (drafter training).
`logits(hidden)` applies the LM head. No sampling, scheduling or bookkeeping lives here.

Module and parameter names follow HF (`model.layers.N.self_attn.q_proj`, ...) so loading is a name mapping.
Numerics follow HF's reference too (RMSNorm in fp32, RoPE tables in fp32), which is what parity tests check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.errors import ConfigError, ModelFormatError
from specpilot.models import fused_decode
from specpilot.models.cache import KVCache
from specpilot.models.config import ModelConfig


_KERNEL_OPS: dict[str, object] = {}


# ops that live in another kernel's module (kernels/<module>.py): op name -> module
_OP_MODULE = {"decode_attention_one": "decode_attention", "decode_attention_token_major": "decode_attention",
              "gemv_fused_normed": "gemv_fused", "gemv_fused_handoff": "gemv_fused"}


def kernel_op(name: str):
    """The torch custom op `<name>_op` of kernels/<name>.py (or of the module _OP_MODULE names), imported once.
    Modules keep a flag and ask here at call time rather than holding the op: an op object on a module makes
    `copy.deepcopy` of the model fail."""
    op = _KERNEL_OPS.get(name)
    if op is None:
        import importlib

        module = importlib.import_module(f"specpilot.kernels.{_OP_MODULE.get(name, name)}")
        op = _KERNEL_OPS[name] = getattr(module, f"{name}_op")
    return op


def require_kernel(name: str, what: str) -> None:
    """Resolve the op `name` now (torch.compile then traces a plain dict lookup; see kernel_op), or say clearly
    that the kernel `what` cannot run here (Triton missing: the op is None)."""
    if kernel_op(name) is None:
        raise ConfigError(f"the {what} needs Triton, which is not installed")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = False  # DenseLM.use_norm_kernel: the one-launch Triton op (same numbers) instead of 8 kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return kernel_op("rmsnorm")(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def use_norm_kernel(model: nn.Module, on: bool = True) -> None:
    """Every RMSNorm inside `model` (a target, a DFlash drafter) through the one-launch Triton kernel
    (kernels/rmsnorm.py, a custom op opaque to torch.compile) instead of 8 eager kernels; same numbers."""
    if on:
        require_kernel("rmsnorm", "RMSNorm kernel")
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = on


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    if kind == "default":
        return inv
    if kind == "llama3":  # Llama 3.x: long wavelengths scaled down, short ones kept, smooth blend between
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * torch.pi / inv
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    raise ModelFormatError(f"unsupported rope_scaling type {kind!r}")


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (any shape, integer) -> cos, sin [*positions.shape, D] in dtype (rotate-half layout: the D/2
    frequencies twice). long * fp32 promotes to fp32 inside the multiply: positions.float() * inv_freq's numbers,
    one launch fewer. One definition for the model's passes, the DFlash drafter's and the one-launch step's table."""
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, H, T, D]; cos, sin [B, 1, T, D]; rotate-half convention (HF layout)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def fused_linear(parts) -> nn.Linear:
    """One Linear whose output is the concatenation of `parts`' outputs (weights, and biases if any, stacked on the
    output axis): the same numbers in one GEMM instead of len(parts)."""
    w = torch.cat([p.weight for p in parts])
    bias = parts[0].bias is not None
    out = nn.Linear(w.shape[1], w.shape[0], bias=bias, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
        if bias:
            out.bias.copy_(torch.cat([p.bias for p in parts]))
    return out


def split_linear(fused: nn.Linear, sizes) -> list[nn.Linear]:
    """`fused_linear` undone: one Linear per output slice of `sizes` rows (copies, so each owns its weight)."""
    ws = fused.weight.detach().split(tuple(sizes))
    bs = fused.bias.detach().split(tuple(sizes)) if fused.bias is not None else (None,) * len(ws)
    out = []
    for w, b in zip(ws, bs):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
            if b is not None:
                lin.bias.copy_(b)
        out.append(lin)
    return out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rope_kernel = False  # DenseLM.use_rope_kernel: q and k rotated in one Triton launch (same numbers)
        self.attention_kernel = False  # DenseLM.use_attention_kernel: few-token steps through the split-KV kernel

    def fuse(self) -> None:
        """Replace q/k/v projections by one (same numbers, one GEMM instead of three: fewer, larger kernels)."""
        if hasattr(self, "qkv_proj"):
            return
        self.qkv_proj = fused_linear((self.q_proj, self.k_proj, self.v_proj))
        del self.q_proj, self.k_proj, self.v_proj

    def _qkv(self, x):
        if hasattr(self, "qkv_proj"):
            q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            return self.qkv_proj(x).split((q_dim, kv_dim, kv_dim), dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x, cos, sin, positions, cache: KVCache, kv_len, mask, is_causal=False):
        B, T, _ = x.shape
        q, k, v = self._qkv(x)
        q = q.reshape(B, T, self.num_heads, self.head_dim)
        k = k.reshape(B, T, self.num_kv_heads, self.head_dim)
        v = v.reshape(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        if self.rope_kernel:
            q, k = kernel_op("rope")(q, k, cos, sin)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(self.layer_idx, positions, k, v)
        keys, values = cache.read(self.layer_idx, kv_len)  # [B, Hkv, S, D]
        if mask is None and not is_causal:  # the positional mask, applied inside the split-KV kernel
            out = kernel_op("decode_attention")(q, keys, values, positions)  # (DenseLM.use_attention_kernel)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        # GQA via enable_gqa: folding the query heads into the query length instead was measured slower on the H200
        # (cuDNN attention already handles GQA with a mask; BENCHMARKS.md, 2026-11-30)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=is_causal, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_kernel = False  # DenseLM.use_act_kernel: silu(gate) * up in one Triton launch (same numbers)

    def fuse(self) -> None:
        """One gate+up GEMM instead of two (same numbers)."""
        if hasattr(self, "gate_up_proj"):
            return
        self.gate_up_proj = fused_linear((self.gate_proj, self.up_proj))
        del self.gate_proj, self.up_proj

    def unfuse(self) -> None:
        """Back to separate gate and up projections (the checkpoint's names; a DFlash drafter switches both ways)."""
        if hasattr(self, "gate_up_proj"):
            self.gate_proj, self.up_proj = split_linear(self.gate_up_proj, (self.down_proj.in_features,) * 2)
            del self.gate_up_proj

    def forward(self, x):
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # two strided views: the kernel reads them in place
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.act_kernel:
            return self.down_proj(kernel_op("silu_mul")(gate, up))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.add_norm_kernel = False  # DenseLM.use_add_norm_kernel: residual add + following norm in one launch

    def forward(self, x, cos, sin, positions, cache, kv_len, mask, is_causal=False, normed=None, next_norm=None):
        """-> the new residual x; with `next_norm` (the next layer's input norm or the final norm), (x,
        next_norm(x)). `normed`: this layer's input norm of x when already computed (by the previous layer's fused
        add + norm). With `add_norm_kernel`, each residual add and the norm after it are one Triton launch
        (kernels/add_rmsnorm.py; same numbers)."""
        h = self.input_layernorm(x) if normed is None else normed
        a = self.self_attn(h, cos, sin, positions, cache, kv_len, mask, is_causal)
        if not self.add_norm_kernel:
            x = x + a
            x = x + self.mlp(self.post_attention_layernorm(x))
            return x if next_norm is None else (x, next_norm(x))
        add_norm, post = kernel_op("add_rmsnorm"), self.post_attention_layernorm
        x, h = add_norm(x, a, post.weight, post.eps)
        m = self.mlp(h)
        return x + m if next_norm is None else add_norm(x, m, next_norm.weight, next_norm.eps)


class DenseBody(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DenseLM(nn.Module):
    """A decoder-only LM. Parameters are named as in HF (`model.*`, `lm_head`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DenseBody(cfg)
        self.attention_kernel = False  # use_attention_kernel() switches few-token steps to the split-KV kernel
        self.norm_kernel = False  # use_norm_kernel() switches every RMSNorm to the Triton kernel
        self.rope_kernel = False  # use_rope_kernel() rotates q and k in one Triton kernel per layer
        self.act_kernel = False  # use_act_kernel(): the MLP's silu(gate) * up in one Triton kernel per layer
        self.add_norm_kernel = False  # use_add_norm_kernel(): each residual add + the norm after it in one kernel
        self.fused_decode = False  # use_fused_decode(): one-token steps through six launches a layer (fused_decode.py)
        self.fused_verify = False  # use_fused_verify(): 2-16-token steps through nine launches a layer (the same)
        self.norm_epilogue = False  # use_norm_epilogue(): the fused layer's residual GEMVs also write the next norm
        self.norm_handoff = False  # use_norm_handoff(): a verify block's residual GEMVs hand the next norm its sums
        self.verify_rope_in_qkv = False  # use_verify_rope_in_qkv(): a verify block's RoPE + K/V write in its qkv GEMM
        self.rope_in_attention = False  # use_rope_in_attention(): a one-token fused layer's RoPE + K/V write inside
        # its attention launch (five launches a layer)
        self.rope_in_qkv = False  # use_rope_in_qkv(): a one-token fused layer's RoPE + K/V write in its qkv GEMV
        self.l2_prefetch = 0.0  # use_l2_prefetch(): that fraction of a fused layer's gate/up weight warmed in L2
        self.fused_mlp = False  # use_fused_mlp(): a one-token fused layer's MLP in one launch (kernels/fused_mlp.py)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def fuse_projections(self) -> "DenseLM":
        """Fuse q/k/v and gate/up projections in place (a run-time layout; checkpoints keep HF names)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    def use_gemv_kernel(self, on: bool = True, force: bool = False) -> "DenseLM":
        """Route few-token projections (decode, verification) through the Triton GEMV (kernels/gemv.py), or (on
        False) back through the library GEMM; same parameters either way, only the forward changes."""
        from specpilot.kernels.gemv import SkinnyLinear

        old, new = (nn.Linear, SkinnyLinear) if on else (SkinnyLinear, nn.Linear)
        for module in self.modules():
            if type(module) is old:
                module.__class__ = new
                module.force_kernel = force and on
        return self

    def use_attention_kernel(self, on: bool = True) -> "DenseLM":
        """Steps of at most 16 tokens under the positional causal mask attend through the split-KV Triton kernel
        (kernels/decode_attention.py) instead of SDPA with a mask tensor; prefill and custom masks keep SDPA."""
        if on:  # a custom op: opaque to torch.compile
            require_kernel("decode_attention", "attention kernel")
        self.attention_kernel = on
        for layer in self.model.layers:
            layer.self_attn.attention_kernel = on
        return self

    def use_norm_kernel(self, on: bool = True) -> "DenseLM":
        """Every RMSNorm (input/post-attention, q/k, final) through the one-launch Triton kernel
        (kernels/rmsnorm.py, a custom op opaque to torch.compile) instead of 8 eager kernels; same numbers."""
        self.norm_kernel = on
        use_norm_kernel(self, on)
        return self

    def use_rope_kernel(self, on: bool = True) -> "DenseLM":
        """RoPE of q and k in one Triton launch per layer (kernels/rope.py, a custom op opaque to torch.compile)
        instead of 10 eager kernels; same numbers."""
        if on:
            require_kernel("rope", "RoPE kernel")
        self.rope_kernel = on
        for layer in self.model.layers:
            layer.self_attn.rope_kernel = on
        return self

    def use_act_kernel(self, on: bool = True) -> "DenseLM":
        """The MLP's silu(gate) * up in one Triton launch per layer (kernels/silu_mul.py, a custom op opaque to
        torch.compile; the fused gate+up output's halves read in place) instead of 2 eager kernels; same numbers."""
        if on:
            require_kernel("silu_mul", "activation kernel")
        self.act_kernel = on
        for layer in self.model.layers:
            layer.mlp.act_kernel = on
        return self

    def use_add_norm_kernel(self, on: bool = True) -> "DenseLM":
        """Each residual add and the RMSNorm after it (post-attention; the next layer's input norm, or the final
        norm after the last layer) in one Triton launch (kernels/add_rmsnorm.py, a custom op opaque to
        torch.compile) instead of 1 add + the norm's kernels; same numbers. The first layer's input norm stays."""
        if on:
            require_kernel("add_rmsnorm", "add + RMSNorm kernel")
        self.add_norm_kernel = on
        for layer in self.model.layers:
            layer.add_norm_kernel = on
        return self

    def use_fused_decode(self, on: bool = True) -> "DenseLM":
        """One-token steps (one row, positional mask) through six fused launches per layer (models/fused_decode.py:
        norms as GEMV prologues, residual adds and SiLU * up as epilogues, RoPE with the K/V write, one-launch
        attention); other steps keep the regular path. Fuses the projections first (it reads qkv_proj, gate_up_proj)."""
        if on:
            self._fused_layer_ready("decode_attention_one", "one-launch attention kernel")
        self.fused_decode = on
        return self

    def _fused_layer_ready(self, attention: str, what: str) -> None:
        """What models/fused_decode.py's layer needs: its kernels (the fused GEMV, RoPE + K/V write, `attention`)
        and the fused projections it reads (qkv_proj, gate_up_proj)."""
        for name, label in (("gemv_fused", "fused GEMV"), ("rope_write", "RoPE + K/V write kernel"), (attention, what)):
            require_kernel(name, label)
        self.fuse_projections()

    def use_fused_verify(self, on: bool = True) -> "DenseLM":
        """Steps of 2 to 16 tokens in one row under the positional mask (a speculative verify block) through the
        fused layer of models/fused_decode.py at T rows: the M-row fused GEMVs (norm prologues, residual and SiLU *
        up epilogues), RoPE + K/V write, the split-KV attention; the LM head stays cuBLAS. Other steps are
        unchanged. Fuses the projections first (it reads qkv_proj, gate_up_proj)."""
        if on:
            self._fused_layer_ready("decode_attention_token_major", "attention kernel")
            require_kernel("rmsnorm", "RMSNorm kernel")  # the block's norms (fused_decode.PRENORM_ROWS)
        self.fused_verify = on
        return self

    def use_norm_epilogue(self, on: bool = True) -> "DenseLM":
        """The fused layer's (models/fused_decode.py) residual GEMVs also write the norm the next GEMV needs
        (kernels/norm_epilogue.py): o_proj the post-attention norm, down_proj the next layer's input norm or, after
        the last layer, the final norm; so gate_up, qkv and the LM head run norm-free and a verify block's two
        RMSNorm launches a layer (and the final norm's) disappear. Layer 0's input norm stays. Same numbers. Needs
        the fused path (fused_decode or fused_verify), the only one it changes."""
        if on:
            if not (self.fused_decode or self.fused_verify):
                raise ConfigError("norm_epilogue needs fused_decode or fused_verify: only the fused layer's GEMVs "
                                  "have the norm epilogue")
            if self.norm_handoff:
                raise ConfigError("norm_epilogue and norm_handoff both replace a verify block's RMSNorm launches: "
                                  "choose one")
            require_kernel("gemv_fused_normed", "fused GEMV with a norm epilogue")
        self.norm_epilogue = on
        return self

    def use_norm_handoff(self, on: bool = True) -> "DenseLM":
        """A fused verify block's (models/fused_decode.py, 2-16 tokens) residual GEMVs hand the GEMV after them their
        output rows' sums of squares (kernels/norm_handoff.py), so qkv and gate_up normalize their input from them:
        the block's two RMSNorm launches a layer go, layer 0's input norm and the final norm stay. The numbers
        differ from the RMSNorm launch's only in the mean's summation order. Needs fused_verify, the only path it
        changes; not with norm_epilogue (both replace the same launches)."""
        if on:
            if not self.fused_verify:
                raise ConfigError("norm_handoff needs fused_verify: only a fused verify block's GEMVs hand over sums")
            if self.norm_epilogue:
                raise ConfigError("norm_handoff and norm_epilogue both replace a verify block's RMSNorm launches: "
                                  "choose one")
            require_kernel("gemv_fused_handoff", "fused GEMV with the norm handoff")
        self.norm_handoff = on
        return self

    def use_verify_rope_in_qkv(self, on: bool = True) -> "DenseLM":
        """A fused verify block (models/fused_decode.py, 2-16 tokens) runs RoPE and the K/V-cache write in its qkv
        GEMM's epilogue (kernels/qkv_rope_rows.py) instead of rope_write's launch after it: a launch fewer a layer.
        Layers with a per-head q/k norm (Qwen3) keep the launch. Needs fused_verify, the only path it changes."""
        if on:
            if not self.fused_verify:
                raise ConfigError("verify_rope_in_qkv needs fused_verify: only a fused verify block's qkv GEMM has "
                                  "the RoPE epilogue")
            require_kernel("qkv_rope_rows", "qkv GEMM with RoPE and the K/V write")
        self.verify_rope_in_qkv = on
        return self

    def use_rope_in_attention(self, on: bool = True) -> "DenseLM":
        """A one-token fused layer (models/fused_decode.py) runs q/k norm (Qwen3), RoPE and the K/V-cache write
        inside its attention launch (kernels/rope_attention.py) instead of the RoPE + K/V write launch before it:
        five launches a layer instead of six. Same numbers. Needs fused_decode, the only path it changes; fused
        verify blocks (T > 1) keep their RoPE + K/V write launch."""
        if on:
            if not self.fused_decode:
                raise ConfigError("rope_in_attention needs fused_decode: only the fused one-token layer has it")
            require_kernel("rope_attention", "RoPE + K/V write + attention kernel")
        self.rope_in_attention = on
        return self

    def use_rope_in_qkv(self, on: bool = True) -> "DenseLM":
        """A one-token fused layer (models/fused_decode.py) runs RoPE and the K/V-cache write in its qkv GEMV's
        epilogue (kernels/qkv_rope.py; a per-head q/k norm too, Qwen3's, in each head's last program) instead of
        the launch after it: five launches a layer instead of six. Same numbers. Needs fused_decode (the only path
        it changes; verify blocks keep their launch); not with rope_in_attention."""
        if on:
            if not self.fused_decode:
                raise ConfigError("rope_in_qkv needs fused_decode: only the fused one-token layer has it")
            if self.rope_in_attention:
                raise ConfigError("rope_in_qkv and rope_in_attention both move the RoPE + K/V write: choose one")
            require_kernel("qkv_rope", "qkv GEMV + RoPE + K/V write kernel")
        self.rope_in_qkv = on
        return self

    def use_fused_mlp(self, on: bool = True) -> "DenseLM":
        """A one-token fused layer runs its whole MLP (norm, gate/up, SiLU x up, down) in one launch
        (kernels/fused_mlp.py), down's sums left as fp32 in a pending row that the next layer's qkv + RoPE launch
        settles (rounds and adds to the residual) as it reads its input: four launches a layer instead of five
        (the last layer, and layers whose outputs are captured, keep theirs). Numbers: down's fp32 summation
        order differs, and on a GPU varies between runs (atomics). Keeps a transposed copy of each down_proj
        weight (memory grows by down's weights). Needs fused_decode and rope_in_qkv over bf16/fp32 weights of
        their own (not lossless12), without the norm epilogue, and an MLP without biases."""
        if on:
            if not (self.fused_decode and self.rope_in_qkv):
                raise ConfigError("fused_mlp needs fused_decode and rope_in_qkv: the next layer's qkv + RoPE launch "
                                  "settles the fused MLP's sums")
            if self.norm_epilogue or getattr(self.lm_head, "packed12", None) is not None:
                raise ConfigError("fused_mlp does not go with norm_epilogue or lossless12: the next qkv launch must "
                                  "read and norm the bf16 residual itself")
            mlps = [layer.mlp for layer in self.model.layers]
            if any(not hasattr(m, "gate_up_proj") or m.gate_up_proj.bias is not None or m.down_proj.bias is not None
                   for m in mlps):
                raise ConfigError("fused_mlp needs fused gate/up projections and an MLP without biases")
            require_kernel("fused_mlp", "fused MLP kernel")
        for layer in self.model.layers:
            if on:
                layer.mlp.down_t = layer.mlp.down_proj.weight.detach().t().contiguous()
            elif hasattr(layer.mlp, "down_t"):
                del layer.mlp.down_t
        self._mlp_pending = None
        self.fused_mlp = on
        return self

    def _pending_rows(self, x: torch.Tensor, T: int, fused: bool, last: int) -> torch.Tensor | None:
        """The fused MLP's pending rows [L, H] fp32, zeroed for this step, or None where this step has no fused
        MLP (off, more than one token, a layout it does not go with, or a single layer)."""
        if not (fused and T == 1 and self.fused_mlp and self.rope_in_qkv and not self.norm_epilogue and last > 0):
            return None
        rows = getattr(self, "_mlp_pending", None)
        if rows is None or rows.device != x.device:  # allocated by the first (eager) step, before any capture
            rows = self._mlp_pending = torch.zeros(self.config.num_hidden_layers, self.config.hidden_size,
                                                   dtype=torch.float32, device=x.device)
        return rows.zero_()

    def use_l2_prefetch(self, fraction: float) -> "DenseLM":
        """A fused layer (models/fused_decode.py, one token or a verify block) reads `fraction` of its gate/up
        weight into L2 on a side stream while its latency-bound launches run (kernels/l2_prefetch.py); 0 = off.
        Same numbers. Needs fused_decode or fused_verify, the only paths it changes."""
        if not 0.0 <= fraction <= 1.0:
            raise ConfigError(f"l2_prefetch is a fraction of the gate/up weight in [0, 1], got {fraction}")
        if fraction > 0 and not (self.fused_decode or self.fused_verify):
            raise ConfigError("l2_prefetch needs fused_decode or fused_verify: only the fused layer has it")
        from specpilot.kernels import l2_prefetch as l2

        if fraction > 0 and l2.triton is None:
            raise ConfigError("l2_prefetch needs Triton, which is not installed")
        self.l2_prefetch = float(fraction)
        return self

    def use_lossless12(self, on: bool = True) -> "DenseLM":
        """One-token fused steps read lossless 12-bit copies of the projection and LM-head weights
        (formats/lossless12.py: every weight exact, 1.5 bytes instead of 2; kernels/gemv12.py). The bf16 weights
        stay for prefill and multi-token steps (cuBLAS, or the fused verify path's M-row GEMVs), so memory grows by
        3/4 of the weights. Needs bf16 weights and fused decode on (the only path that reads the copies)."""
        from specpilot.formats.lossless12 import pack

        if on:
            if not self.fused_decode:
                raise ConfigError("lossless12 needs fused_decode: only the fused one-token steps read 12-bit weights")
            if self.lm_head.weight.dtype != torch.bfloat16:
                raise ConfigError(f"lossless12 needs bf16 weights, the model has {self.lm_head.weight.dtype}")
            require_kernel("gemv12", "12-bit GEMV")
        linears = [m for layer in self.model.layers
                   for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                             layer.mlp.down_proj)] + [self.lm_head] if on else list(self.modules())
        for m in linears:
            if on:
                m.packed12 = pack(m.weight.detach())
            elif hasattr(m, "packed12"):
                del m.packed12
        return self

    def new_cache(self, batch_size: int, max_seq_len: int) -> KVCache:
        p = self.lm_head.weight
        return KVCache(self.config, batch_size, max_seq_len, dtype=p.dtype, device=p.device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T] absolute positions of these tokens
        cache: KVCache,
        *,
        kv_len: int | None = None,  # attend over cache slots [0, kv_len); None = whole pool (static shapes)
        attn_mask: torch.Tensor | None = None,  # [B, T, S] bool, True = may attend; None = causal by position
        return_layers: tuple[int, ...] = (),
        last_layer: int | None = None,  # run decoder layers 0..last_layer only; None = all
        is_causal: bool = False,  # caller's promise: positions are 0..T-1 in every row and kv_len == T
    ):
        """-> hidden [B, T, H]; with `return_layers`, (hidden, [outputs of those decoder layers, each [B, T, H]]).

        With `last_layer` below the last layer, the later layers and the final norm are skipped (their work is
        wasted when only captured layers are wanted) and hidden is None. `is_causal` attends with SDPA's own causal
        mask instead of a [B, 1, T, S] mask tensor (same attention: key slot <= query position); the positions
        themselves are not checked, since that would cost a host sync."""
        L, T = self.config.num_hidden_layers, input_ids.shape[1]
        last = L - 1 if last_layer is None else last_layer
        if not 0 <= last < L:
            raise ConfigError(f"last_layer {last_layer} outside the model's {L} layers")
        if any(i > last for i in return_layers):
            raise ConfigError(f"return_layers {tuple(return_layers)} reach past last_layer {last}")
        if is_causal and (attn_mask is not None or kv_len != T):
            raise ConfigError(f"is_causal needs kv_len == T ({T}) and no attn_mask, got kv_len {kv_len}")
        x = self.model.embed_tokens(input_ids)
        cos, sin = (t[:, None] for t in rope_cos_sin(positions, self.inv_freq, x.dtype))  # [B, 1, T, D]
        S = cache.max_seq_len if kv_len is None else kv_len
        # one token (fused_decode) or 2-16 (fused_verify) in one row: six or nine launches a layer
        fused = fused_decode.applies(self, input_ids, attn_mask, is_causal)
        if fused or is_causal or (attn_mask is None and self.attention_kernel and T <= 16):
            mask = None  # SDPA's causal mask, or positional: the attention kernel applies it from `positions`
        else:
            if attn_mask is None:
                key_pos = torch.arange(S, device=input_ids.device)
                attn_mask = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, S]
            mask = attn_mask[:, None]  # [B, 1, T, S]
        captured = []
        layers = self.model.layers[: last + 1]
        # with add_norm_kernel (regular path) or norm_epilogue (fused path): the next layer's input norm (or the
        # final norm) comes out of the launch that makes the residual it normalizes
        next_norms = self.norm_epilogue if fused else self.add_norm_kernel
        normed = None
        rows = self._pending_rows(x, T, fused, last)  # the fused MLP (use_fused_mlp): down's sums, per layer
        pending = None  # the previous layer's row, settled by this layer's qkv launch
        handoff = fused and T > 1 and self.norm_handoff  # a verify block's norms from handed-over sums
        ss = None  # the previous layer's down GEMV's sums of squares (norm_handoff)
        for i, layer in enumerate(layers):
            nxt = None
            if next_norms:
                nxt = layers[i + 1].input_layernorm if i < last else self.model.norm if last == L - 1 else None
            if fused:
                mlp_out = rows[i] if rows is not None and i < last and i not in return_layers else None
                x = fused_decode.decode_layer(layer, x, cos, sin, positions, cache, kv_len, normed=normed,
                                              next_norm=nxt, norm_epilogue=self.norm_epilogue,
                                              rope_in_attention=self.rope_in_attention,
                                              rope_in_qkv=self.rope_in_qkv, l2_prefetch=self.l2_prefetch,
                                              pending=pending, mlp_out=mlp_out, handoff=handoff, norm_ss=ss,
                                              ss_out=handoff and i < last,
                                              rope_in_qkv_rows=self.verify_rope_in_qkv)
                pending = mlp_out
                if handoff and i < last:
                    x, ss = x
            else:
                x = layer(x, cos, sin, positions, cache, kv_len, mask, is_causal, normed=normed, next_norm=nxt)
            x, normed = x if nxt is not None else (x, None)
            if i in return_layers:
                captured.append(x)
        hidden = (self.model.norm(x) if normed is None else normed) if last == L - 1 else None
        return (hidden, captured) if return_layers else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # [B, T, H] -> [B, T, V] in fp32 (acceptance and margins compare logits; bf16 ties would be noise)
        if self.fused_decode and hidden.numel() == hidden.shape[-1]:  # one row: the fused path's GEMV, no cuBLAS
            row = fused_decode.project(self.lm_head, hidden.reshape(1, -1), None, 0.0, None, "")
            return row.float().view(*hidden.shape[:-1], -1)
        return self.lm_head(hidden).float()  # several rows (a fused verify step's too): cuBLAS
