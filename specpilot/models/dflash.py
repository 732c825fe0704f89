"""The DFlash block drafter (z-lab's `DFlashDraftModel`, dflash 0.1.0): a pure forward pass.

What the network is, as the reference defines it (and what this module mirrors, behaviour for behaviour):

* Context features. The target is run with its hidden states recorded; for every id in `target_layer_ids` the
  reference takes `hidden_states[id + 1]` of the HF output, i.e. the *output of target decoder layer `id`*
  (index 0 is the embedding output). One quirk comes with it: HF ties `hidden_states[num_layers]` to the
  final-normed `last_hidden_state`, so an id equal to the target's last layer means the normed final hidden
  state, not the raw layer output. `context_features` mirrors both. The selected states are concatenated on the
  feature axis ([B, T, n*H]) and `project_context` maps them through `fc` (Linear n*H -> H, no bias) and
  `hidden_norm` (RMSNorm). That projection happens once per forward, not per layer.
* Draft layers are Qwen3-style (pre-norm, q/k RMSNorm per head, RoPE, GQA, SiLU MLP). In every layer the
  queries come from the block only; keys and values are `k_proj`/`v_proj` of the projected context (without the
  layer's `input_layernorm`) concatenated *before* the block's own keys/values (which come from the normed block),
  `k_norm` is applied to both, and RoPE puts context keys at the context positions and block keys/queries at the
  block positions. Attention is non-causal: every block token sees every context key and every block key. (A
  config may declare `sliding_attention` layers: as in the reference they are causal by position and windowed
  by `sliding_window` when the Qwen3 config enables it; a top-level `is_causal` overrides causality for all.)
* The block is `[anchor, mask, mask, ...]` (block_size tokens; `mask_token_id`), embedded with the target's
  *raw* input embedding matrix times `input_embedding_scale` (default 1). The output is the final-normed hidden
  state of each block position; position i >= 1 is read through the target's LM head (times `output_multiplier`,
  with `final_logit_softcapping` if set) as the draft for the token at position anchor_pos + i. The anchor
  position's output is dropped.
* Positions. The anchor sits at position `start` (the first position not yet verified), the block occupies
  start .. start+block_size-1, and the context passed in a step covers the positions just before the anchor:
  start-C .. start-1.
* Draft K/V cache. The reference keeps an HF cache of *context* K/V only: each step appends the new context's
  K/V (and, transiently, the block's), then crops back to `start`, so the next step feeds only the context of
  the tokens committed since (anchor + accepted drafts; the bonus token becomes the next anchor and enters the
  context one step later). Here the cache is our preallocated `KVCache` indexed by position (slot p = position
  p): `forward(..., cache=...)` writes the context K/V at `positions_ctx` and attends over the slots below the
  anchor position plus the block's own K/V. Only committed positions are ever fed, so there is nothing to crop or
  roll back; slots at or above the anchor are masked (or not read, with `kv_len`).
* The attention kernel (`use_attention_kernel()`, CUDA): for non-causal, unwindowed layers and blocks of at most
  16 tokens, the block's K/V are written into the cache at the block positions too (after this pass's context
  writes, so they win over padding rows written at the same slots), and the split-KV kernel attends over the
  cache with every query at the block's last position: slot j visible iff j <= anchor + S - 1, i.e. all context
  below the anchor and the whole block, which is exactly the SDPA mask here. Why: on the H200 the masked SDPA over
  cat(whole cache pool, block) cost 0.18 ms per layer plus the cat copies, in a 0.82 ms draft graph; the kernel's
  work follows the real context. The block slots (>= anchor) then hold draft K/V until real context overwrites
  them: a later pass writes its context (every position from the old anchor up to its own anchor) before
  attending, and slots above its own block are beyond every query position.

* Fused projections (`fuse_projections()`, the engine's `fused_projections`): a run-time inference layout, as
  `DenseLM.fuse_projections`. Per layer q/k/v become one weight `qkv_proj` (the block's q, k, v in one GEMM; the
  context's k, v in one GEMM over its k/v rows, a contiguous slice) and gate/up one `gate_up_proj`: 4 GEMM
  launches fewer a layer, same numbers. The draft pass is launch-bound on the H200 (~0.16 ms of bytes in a
  0.6-0.7 ms graph), so launches are what it is priced in. Training never fuses; `save_dflash` writes split names.

No embedding or LM head lives here: the caller passes the target's embedding matrix and LM head
(`DenseLM.model.embed_tokens.weight`, `DenseLM.lm_head`). Module and parameter names equal the published
checkpoint's (`layers.N.self_attn.q_proj.weight`, `fc.weight`, `hidden_norm.weight`, `norm.weight`, ...), so
loading (`models/dflash_io.py`) is a plain name mapping. The configuration (`DFlashConfig`, the reference's
defaults and quirks) is `models/dflash_config.py`, re-exported here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.errors import ModelFormatError
from specpilot.models.cache import KVCache
from specpilot.models.dense import (MLP, RMSNorm, apply_rope, fused_linear, kernel_op, require_kernel, rope_cos_sin,
                                    rope_inv_freq, split_linear)
from specpilot.models.dense import use_norm_kernel as _use_norm_kernel

from specpilot.models.dflash_config import ARCHITECTURE, DFlashConfig, build_target_layer_ids  # noqa: F401


# ----------------------------------------------------------------------------------------------------------
# context features from the target


def target_capture_layers(target_layer_ids, num_target_layers: int) -> tuple[int, ...]:
    """The target decoder layers whose outputs must be captured (`DenseLM.forward(return_layers=...)`).

    The target's last layer is never among them: the reference reads it as the final-normed hidden state, which
    the target's forward returns anyway."""
    return tuple(sorted({int(i) for i in target_layer_ids if int(i) != num_target_layers - 1}))


def context_features(final_hidden: torch.Tensor | None, captured, target_layer_ids,
                     num_target_layers: int) -> torch.Tensor:
    """Concatenate the target states the reference conditions on: [B, T, len(target_layer_ids) * H].

    `final_hidden` is the target's final-normed output, `captured` the layer outputs returned for
    `target_capture_layers(...)` (in that order). Layer id i means HF `hidden_states[i + 1]`: the output of
    decoder layer i, except i = num_target_layers - 1, where HF substitutes the final-normed state.
    `final_hidden` may be None (a target pass stopped early, `last_layer`) when that last layer is not wanted."""
    by_layer = dict(zip(target_capture_layers(target_layer_ids, num_target_layers), captured))
    parts = []
    for i in target_layer_ids:
        i = int(i)
        if not 0 <= i < num_target_layers:
            raise ModelFormatError(f"DFlash target layer {i} outside the target's {num_target_layers} layers")
        if i == num_target_layers - 1 and final_hidden is None:
            raise ValueError(f"target layer {i} is the final-normed state, but the target pass stopped before it")
        parts.append(final_hidden if i == num_target_layers - 1 else by_layer[i])
    return torch.cat(parts, dim=-1)


# ----------------------------------------------------------------------------------------------------------
# the network

class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.kernel_max_t = 0  # > 0: the split-KV kernel takes up to this many queries (use_attention_kernel)
        self.rope_kernel = False  # DFlashDrafter.use_rope_kernel: RoPE through kernels/rope.py (same numbers)

    def uses_kernel(self, cache: KVCache | None, block_len: int, kv_len: int | None) -> bool:
        """Whether this pass attends through the kernel: switched on for this layer, a cache to write the block
        into, a block the kernel takes (<= MAX_T queries), and (an eager pass, kv_len = the anchor) room for the
        block's slots; the drafter's cache has block_size spare slots, so the static step always has room."""
        return (cache is not None and block_len <= self.kernel_max_t
                and (kv_len is None or kv_len + block_len <= cache.max_seq_len))

    # -- fused projections (DFlashDrafter.fuse_projections): a run-time layout, checkpoints keep q/k/v_proj --

    def fuse(self) -> None:
        """q/k/v in one weight (qkv_proj): the block's q, k, v in one GEMM, and the context's k, v in one GEMM over
        its k/v rows (a contiguous slice of the same weight). Same numbers, 2 GEMMs instead of 5."""
        if not hasattr(self, "qkv_proj"):
            self.qkv_proj = fused_linear((self.q_proj, self.k_proj, self.v_proj))
            del self.q_proj, self.k_proj, self.v_proj

    def unfuse(self) -> None:
        if hasattr(self, "qkv_proj"):
            q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            self.q_proj, self.k_proj, self.v_proj = split_linear(self.qkv_proj, (q, kv, kv))
            del self.qkv_proj

    def _qkv(self, x: torch.Tensor):
        """The block's q, k, v projections, [B, S, H*D] and [B, S, Hkv*D] x 2 (views of one GEMM when fused)."""
        if hasattr(self, "qkv_proj"):
            kv = self.num_kv_heads * self.head_dim
            return self.qkv_proj(x).split((self.num_heads * self.head_dim, kv, kv), dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def _kv_proj(self, x: torch.Tensor):
        """The context's k, v projections, [B, C, Hkv*D] each (one GEMM over qkv_proj's k/v rows when fused)."""
        if hasattr(self, "qkv_proj"):
            q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            b = self.qkv_proj.bias
            return F.linear(x, self.qkv_proj.weight[q:], None if b is None else b[q:]).split((kv, kv), dim=-1)
        return self.k_proj(x), self.v_proj(x)

    def _kv(self, k: torch.Tensor, v: torch.Tensor, cos, sin, rotate: bool = True):
        """Projected k, v [B, T, Hkv*D] -> keys (k-normed, rotated at cos/sin unless `rotate` is False) and values,
        [B, Hkv, T, D] each."""
        B, T, _ = k.shape
        k = self.k_norm(k.view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if not rotate:
            return k, v
        if self.rope_kernel:  # keys only (the context): the kernel's q slot takes one key head, its output dropped
            return kernel_op("rope")(k[:, :1], k, cos, sin)[1], v
        return apply_rope(k, cos, sin), v

    def forward(self, x, ctx, rope_blk, rope_ctx, positions_ctx, cache: KVCache | None, kv_len, mask,
                positions_blk=None):  # positions_blk: needed with a cache only (the kernel writes the block there)
        B, S, _ = x.shape
        cos_b, sin_b = rope_blk
        q, k, v = self._qkv(x)
        q = self.q_norm(q.view(B, S, self.num_heads, self.head_dim)).transpose(1, 2)
        if self.rope_kernel:  # the block's queries and keys share positions: one launch for both
            k_blk, v_blk = self._kv(k, v, cos_b, sin_b, rotate=False)
            q, k_blk = kernel_op("rope")(q, k_blk, cos_b, sin_b)
        else:
            q = apply_rope(q, cos_b, sin_b)
            k_blk, v_blk = self._kv(k, v, cos_b, sin_b)
        if ctx.shape[1]:
            k_ctx, v_ctx = self._kv(*self._kv_proj(ctx), *rope_ctx)
            if cache is not None:
                cache.write(self.layer_idx, positions_ctx, k_ctx, v_ctx)
        if self.uses_kernel(cache, S, kv_len):
            # after the context write: static padding rows share slots with the block, the block must win there
            cache.write(self.layer_idx, positions_blk, k_blk, v_blk)
            keys, values = cache.read(self.layer_idx, None)  # the kernel skips slices above the last position
            last = positions_blk[:, -1:].expand(B, S)  # every query sees slots <= anchor + S - 1 (non-causal)
            # token-major output (same kernels and numbers): the o_proj input below is a view, not a copy kernel
            out = kernel_op("decode_attention_token_major")(q, keys, values, last)
            return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))
        if cache is not None:
            k_ctx, v_ctx = cache.read(self.layer_idx, kv_len)
        elif not ctx.shape[1]:
            k_ctx, v_ctx = k_blk[:, :, :0], v_blk[:, :, :0]
        keys, values = torch.cat((k_ctx, k_blk), dim=2), torch.cat((v_ctx, v_blk), dim=2)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx, rope_blk, rope_ctx, positions_ctx, cache, kv_len, mask, positions_blk=None):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_blk, rope_ctx, positions_ctx, cache, kv_len, mask,
                               positions_blk)
        return x + self.mlp(self.post_attention_layernorm(x))


def apply_layer_rules(visible: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool,
                      window: int | None) -> torch.Tensor:
    """A layer's causal / sliding-window rules on a visibility mask [B, Q, K] (q_pos [B, Q], k_pos [B, K])."""
    q, k = q_pos[:, :, None], k_pos[:, None, :]
    if causal:
        visible = visible & (k <= q)
    if window is not None:
        visible = visible & (q - k < window)
        if not causal:
            visible = visible & (k - q < window)
    return visible


class DFlashDrafter(nn.Module):
    """z-lab's DFlashDraftModel as a pure forward. Parameter names are the checkpoint's."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DFlashLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.attention_kernel = False  # use_attention_kernel() switches cached draft passes to the split-KV kernel
        self.rope_kernel = False  # use_rope_kernel(): RoPE through kernels/rope.py (2 launches per layer)
        self.act_kernel = False  # use_act_kernel(): the MLPs' silu(gate) * up through kernels/silu_mul.py

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def use_attention_kernel(self, on: bool = True) -> "DFlashDrafter":
        """Cached draft passes of at most 16 tokens attend through the split-KV Triton kernel instead of masked SDPA
        over cat(cache, block), in the layers it can serve: non-causal, no sliding window, a power-of-two head_dim
        >= 16 (the others keep SDPA). Same numbers; passes without a cache (training) keep SDPA."""
        # imported here, not at the top: importing Triton stays off the model's import
        from specpilot.kernels.decode_attention import MAX_T

        if on:
            require_kernel("decode_attention_token_major", "attention kernel")
        self.attention_kernel = on
        cfg, d = self.config, self.config.head_dim
        for i, layer in enumerate(self.layers):
            ok = not cfg.layer_is_causal(i) and cfg.layer_window(i) is None and d >= 16 and not d & (d - 1)
            layer.self_attn.kernel_max_t = MAX_T if on and ok else 0
        return self

    def use_norm_kernel(self, on: bool = True) -> "DFlashDrafter":
        """Every RMSNorm (input/post-attention, q/k, hidden_norm, final) through the one-launch Triton kernel
        (kernels/rmsnorm.py) instead of 8 eager kernels; same numbers."""
        _use_norm_kernel(self, on)
        return self

    @property
    def norm_kernel(self) -> bool:
        """Whether the RMSNorms run through the kernel (use_norm_kernel, or dense.use_norm_kernel on the network)."""
        return self.norm.kernel

    def use_rope_kernel(self, on: bool = True) -> "DFlashDrafter":
        """RoPE through the one-launch Triton kernel (kernels/rope.py) instead of 5 eager kernels per rotated
        tensor: per layer one launch for the block's q and k (same positions) and one for the context's keys (when
        the pass has context rows). Same numbers, every pass (cached or not). Layers whose head_dim the kernel
        cannot take (not a power of two) keep the eager RoPE."""
        if on:
            require_kernel("rope", "RoPE kernel")
        d = self.config.head_dim
        self.rope_kernel = on
        for layer in self.layers:
            layer.self_attn.rope_kernel = on and d >= 2 and not d & (d - 1)
        return self

    def use_act_kernel(self, on: bool = True) -> "DFlashDrafter":
        """The MLPs' silu(gate) * up in one Triton launch per layer (kernels/silu_mul.py) instead of 2 eager
        kernels; same numbers."""
        if on:
            require_kernel("silu_mul", "activation kernel")
        self.act_kernel = on
        for layer in self.layers:
            layer.mlp.act_kernel = on
        return self

    def fuse_projections(self, on: bool = True) -> "DFlashDrafter":
        """Per layer, q/k/v in one weight (the block's q, k, v in one GEMM, the context's k, v in one GEMM over its
        k/v rows) and gate/up in one (dense.MLP.fuse): 4 GEMM launches fewer a layer, same numbers. A run-time
        inference layout, like DenseLM.fuse_projections: `on=False` splits them back; checkpoints keep the
        z-lab names (dflash_io.save_dflash saves an unfused copy); training never fuses."""
        for layer in self.layers:
            for module in (layer.self_attn, layer.mlp):
                (module.fuse if on else module.unfuse)()
        return self

    @property
    def projections_fused(self) -> bool:
        return any(hasattr(layer.self_attn, "qkv_proj") or hasattr(layer.mlp, "gate_up_proj") for layer in self.layers)

    def use_kernels(self, *, norm: bool | None = None, rope: bool | None = None, act: bool | None = None,
                    attention: bool | None = None) -> "DFlashDrafter":
        """Switch several kernels at once; None leaves a kernel as it is."""
        for on, switch in ((norm, self.use_norm_kernel), (rope, self.use_rope_kernel), (act, self.use_act_kernel),
                           (attention, self.use_attention_kernel)):
            if on is not None:
                switch(bool(on))
        return self

    def new_cache(self, batch_size: int, max_seq_len: int) -> KVCache:
        """The draft cache: context K/V of every draft layer, slot p = position p."""
        p = self.fc.weight
        return KVCache(self.config, batch_size, max_seq_len, dtype=p.dtype, device=p.device)

    def project_context(self, target_hidden) -> torch.Tensor:
        """Concatenated target layer states [B, T, n*H] (or a list of n [B, T, H]) -> context features [B, T, H]."""
        if isinstance(target_hidden, (list, tuple)):
            target_hidden = torch.cat(list(target_hidden), dim=-1)
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def embed(self, token_ids: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        """Block embeddings as the reference makes them: the target's raw embedding rows times the config's scale."""
        x = F.embedding(token_ids, embed_weight)
        scale = self.config.input_embedding_scale
        return x * scale if scale != 1.0 else x

    def compute_logits(self, hidden: torch.Tensor, lm_head) -> torch.Tensor:
        """Draft logits through the target's LM head (a module or a weight), with the reference's multiplier/softcap."""
        logits = lm_head(hidden) if callable(lm_head) else F.linear(hidden, lm_head)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None and cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _rope(self, positions: torch.Tensor, dtype):
        cos, sin = rope_cos_sin(positions, self.inv_freq, dtype)
        return cos[:, None], sin[:, None]  # [B, 1, T, D]

    def _rope_tables(self, positions_blk: torch.Tensor, positions_ctx: torch.Tensor | None, dtype):
        """(cos, sin) of the block and of the context (None without context rows), [B, 1, S|C, D] each: one table
        over both position runs, then sliced (the same elementwise numbers; 1 cat instead of a second table's 4-6
        launches)."""
        S = positions_blk.shape[1]
        if positions_ctx is None:
            return self._rope(positions_blk, dtype), None
        cos, sin = self._rope(torch.cat((positions_blk, positions_ctx), dim=1), dtype)
        return (cos[:, :, :S], sin[:, :, :S]), (cos[:, :, S:], sin[:, :, S:])

    def _mask(self, layer: int, positions_ctx, positions_blk, cache, kv_len):
        """[B, 1, S, K] bool, or None when all keys are visible. Keys: the context (cache slots or the given
        context), then the block."""
        causal, window = self.config.layer_is_causal(layer), self.config.layer_window(layer)
        if cache is None:
            if not causal and window is None:
                return None
            key_pos = torch.cat((positions_ctx, positions_blk), dim=1)  # [B, K]
            valid = None
        else:
            n = cache.max_seq_len if kv_len is None else kv_len
            slots = torch.arange(n, device=positions_blk.device).expand(positions_blk.shape[0], n)
            key_pos = torch.cat((slots, positions_blk), dim=1)
            anchor = positions_blk[:, :1]
            valid = torch.cat((slots < anchor, torch.ones_like(positions_blk, dtype=torch.bool)), dim=1)[:, None, :]
        visible = torch.ones(key_pos.shape[0], positions_blk.shape[1], key_pos.shape[1], dtype=torch.bool,
                             device=key_pos.device)
        visible = apply_layer_rules(visible, positions_blk, key_pos, causal, window)
        if valid is not None:
            visible &= valid
        return visible[:, None]

    def forward(
        self,
        block_embeds: torch.Tensor,  # [B, S, H] embeddings of [anchor, mask, ...]
        context: torch.Tensor,  # [B, C, H] projected context features (project_context), C may be 0
        positions_ctx: torch.Tensor,  # [B, C] positions of the context tokens (just before the anchor)
        positions_block: torch.Tensor,  # [B, S] positions of the block, positions_block[:, 0] = anchor position
        cache: KVCache | None = None,
        *,
        kv_len: int | None = None,  # with a cache: attend over slots [0, kv_len); None = whole pool (static shapes)
    ) -> torch.Tensor:
        """-> final-normed hidden states of the block [B, S, H].

        Without a cache the context must hold every position the draft should see (the reference with no past).
        With a cache, the context K/V are written at `positions_ctx` first, then the block attends to all slots
        below its anchor position plus itself; feed each committed position once, in any later step. The block's
        positions must be consecutive (anchor .. anchor + S - 1): the attention kernel's mask relies on it."""
        x = block_embeds
        ctx = context.to(x.dtype)
        rope_blk, rope_ctx = self._rope_tables(positions_block, positions_ctx if ctx.shape[1] else None, x.dtype)
        masks = {}
        for i, layer in enumerate(self.layers):
            key = (self.config.layer_is_causal(i), self.config.layer_window(i))
            if layer.self_attn.uses_kernel(cache, x.shape[1], kv_len):
                mask = None  # the kernel's positional mask (DFlashAttention.forward)
            else:
                if key not in masks:
                    masks[key] = self._mask(i, positions_ctx, positions_block, cache, kv_len)
                mask = masks[key]
            x = layer(x, ctx, rope_blk, rope_ctx, positions_ctx, cache, kv_len, mask, positions_block)
        return self.norm(x)


def _target_io(target_model):
    """(embedding matrix, LM head) of a target: our DenseLM or an HF causal LM."""
    if hasattr(target_model, "get_input_embeddings"):
        embed = target_model.get_input_embeddings()
    else:
        embed = target_model.model.embed_tokens
    return embed.weight, target_model.lm_head


@torch.no_grad()
def draft_block(
    drafter: DFlashDrafter,
    target_model,
    anchor_id,
    context_hidden: torch.Tensor,
    *,
    anchor_pos: int,
    cache: KVCache | None = None,
    num_tokens: int | None = None,
    return_logits: bool = False,
    pad_to: int | None = None,
) -> torch.Tensor:
    """One greedy DFlash draft, as the reference's spec_generate does per step -> token ids [num_tokens]
    (with `return_logits`, the draft logits [num_tokens, V] they are the argmax of instead).

    `anchor_id` is the last committed token (an int or a 0-d tensor), at position `anchor_pos`.
    `context_hidden` is `context_features(...)` of the target for positions anchor_pos-C .. anchor_pos-1 ([C, n*H]
    or [1, C, n*H]): with a `cache`, only the positions not fed before (the reference feeds the prompt first, then
    each step the anchor and accepted drafts of the previous step); without one, the whole prefix.
    `num_tokens` defaults to block_size - 1 (the reference shortens the block only at max_new_tokens).
    `pad_to` (with a cache): the context is padded with zero rows to that many, at the positions from the anchor on,
    and the pass attends over anchor + (pad_to - C) slots, so passes over contexts of different lengths share a few
    shapes (engine/runner.py `padded_length` says why); the mask shows the block only slots below the anchor, so
    the padding is never seen (the static step pads the same way)."""
    k = drafter.block_size - 1 if num_tokens is None else int(num_tokens)
    embed_w, lm_head = _target_io(target_model)
    device = embed_w.device
    ids = torch.full((1, k + 1), drafter.mask_token_id, dtype=torch.long, device=device)
    ids[0, 0] = anchor_id
    ctx = context_hidden if context_hidden.dim() == 3 else context_hidden[None]
    C = ctx.shape[1]
    if C > anchor_pos:
        raise ValueError(f"{C} context positions cannot all precede the anchor at position {anchor_pos}")
    pad = 0
    if pad_to is not None and cache is not None and pad_to > C:
        pad = pad_to - C
        ctx = torch.cat((ctx, ctx.new_zeros(ctx.shape[0], pad, ctx.shape[2])), dim=1)
        if anchor_pos + pad > cache.max_seq_len:
            raise ValueError(f"padding the context to {pad_to} rows needs slots up to {anchor_pos + pad}; the cache "
                             f"has {cache.max_seq_len}")
    pos_ctx = torch.arange(anchor_pos - C, anchor_pos + pad, device=device)[None]
    pos_blk = torch.arange(anchor_pos, anchor_pos + k + 1, device=device)[None]
    hidden = drafter(
        drafter.embed(ids, embed_w), drafter.project_context(ctx), pos_ctx, pos_blk, cache,
        kv_len=anchor_pos + pad if cache is not None else None,
    )
    logits = drafter.compute_logits(hidden[:, 1:], lm_head)
    return logits[0] if return_logits else logits.argmax(dim=-1)[0]
