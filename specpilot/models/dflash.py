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
  anchor position plus the block's own K/V, which are never written. Only committed positions are ever fed, so
  there is nothing to crop or roll back; slots at or above the anchor are masked (or not read, with `kv_len`).

No embedding or LM head lives here: the caller passes the target's embedding matrix and LM head
(`DenseLM.model.embed_tokens.weight`, `DenseLM.lm_head`). Module and parameter names equal the published
checkpoint's (`layers.N.self_attn.q_proj.weight`, `fc.weight`, `hidden_norm.weight`, `norm.weight`, ...), so
loading (`models/dflash_io.py`) is a plain name mapping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.errors import ModelFormatError
from specpilot.models.cache import KVCache
from specpilot.models.dense import MLP, RMSNorm, apply_rope, rope_inv_freq

ARCHITECTURE = "DFlashDraftModel"
_QWEN3_MAX_WINDOW_LAYERS = 28  # transformers' Qwen3Config default, which the reference inherits
_QWEN3_HEAD_DIM = 128  # ditto: Qwen3Config's head_dim default when config.json has none


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference's default choice of target layers (used only when the config names none)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    lo, hi = 1, num_target_layers - 3
    return tuple(round(lo + i * (hi - lo) / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    vocab_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"; () means all full
    sliding_window: int | None = None  # effective window (None unless the config enables sliding windows)
    is_causal: bool | None = None  # explicit override of the per-layer rule, as in the reference
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    extra: dict = field(default_factory=dict, compare=False)  # other config.json fields, kept for saving

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelFormatError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            raise ModelFormatError(f"DFlash block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ModelFormatError("DFlash config names no target layers")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_hidden_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelFormatError("layer_types must name one type per draft layer")
        bad = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if bad:
            raise ModelFormatError(f"unsupported DFlash layer types {sorted(bad)}")

    def layer_is_causal(self, i: int) -> bool:
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        if self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "DFlashConfig":
        """Read a z-lab DFlash config.json (a Qwen3 config plus `block_size` and `dflash_config`)."""
        archs = cfg.get("architectures") or []
        if "DFlash2DraftModel" in archs:
            raise ModelFormatError("DFlash 2 drafters (DFlash2DraftModel) are not supported, only DFlashDraftModel")
        dcfg = cfg.get("dflash_config")
        if not isinstance(dcfg, dict) or (archs and ARCHITECTURE not in archs):
            raise ModelFormatError(
                f"not a DFlash drafter config (architectures={archs}, dflash_config "
                f"{'present' if isinstance(dcfg, dict) else 'missing'}); expected {ARCHITECTURE} with dflash_config"
            )

        def draft_value(name, default=None):  # the reference reads dflash_config first, then the top level
            return dcfg.get(name, cfg.get(name, default))

        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelFormatError(f"unsupported DFlash hidden_act {act!r} (Qwen3-style layers use silu)")
        try:
            heads = int(cfg["num_attention_heads"])
            n_layers = int(cfg["num_hidden_layers"])
            mask_token_id = draft_value("mask_token_id")
            if mask_token_id is None:
                raise KeyError("dflash_config.mask_token_id")
            ids = draft_value("target_layer_ids")
            n_target = cfg.get("num_target_layers")
            if ids is None:
                if n_target is None:
                    raise KeyError("dflash_config.target_layer_ids")
                ids = build_target_layer_ids(int(n_target), n_layers)
            rope_params = cfg.get("rope_parameters") or {}
            scaling = cfg.get("rope_scaling")
            if scaling is None and rope_params.get("rope_type", "default") != "default":
                scaling = dict(rope_params)
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
            layer_types = cfg.get("layer_types")
            if layer_types is None:  # Qwen3Config's rule
                max_window = cfg.get("max_window_layers", _QWEN3_MAX_WINDOW_LAYERS)
                layer_types = [
                    "sliding_attention" if window is not None and i >= max_window else "full_attention"
                    for i in range(n_layers)
                ]
            softcap = draft_value("final_logit_softcapping")
            head_dim = cfg.get("head_dim", _QWEN3_HEAD_DIM) or cfg["hidden_size"] // heads
            known = {
                "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "block_size", "dflash_config", "num_target_layers", "vocab_size",
                "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
                "attention_bias", "layer_types", "sliding_window", "use_sliding_window", "max_window_layers",
                "is_causal", "input_embedding_scale", "output_multiplier", "final_logit_softcapping",
                "architectures", "model_type", "hidden_act", "dtype", "torch_dtype", "transformers_version",
            }
            return cls(
                hidden_size=int(cfg["hidden_size"]),
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=n_layers,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                block_size=int(draft_value("block_size", 16)),
                mask_token_id=int(mask_token_id),
                target_layer_ids=tuple(int(i) for i in ids),
                num_target_layers=None if n_target is None else int(n_target),
                vocab_size=cfg.get("vocab_size"),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
                rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                layer_types=tuple(layer_types),
                sliding_window=None if window is None else int(window),
                is_causal=cfg.get("is_causal"),
                input_embedding_scale=float(draft_value("input_embedding_scale", 1.0)),
                output_multiplier=float(draft_value("output_multiplier", 1.0)),
                final_logit_softcapping=None if softcap is None else float(softcap),
                extra={k: v for k, v in cfg.items() if k not in known},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(f"DFlash config.json lacks or mangles field {e}") from None

    def to_hf_dict(self) -> dict:
        """The config.json z-lab's loader reads (transformers' Qwen3Config plus the DFlash fields)."""
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        out = {
            **self.extra,
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": dflash,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "layer_types": list(self.layer_types),
            "use_sliding_window": self.sliding_window is not None,
            "sliding_window": self.sliding_window,
            "max_window_layers": _QWEN3_MAX_WINDOW_LAYERS,
        }
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.vocab_size is not None:
            out["vocab_size"] = self.vocab_size
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        return out


# ----------------------------------------------------------------------------------------------------------
# context features from the target


def target_capture_layers(target_layer_ids, num_target_layers: int) -> tuple[int, ...]:
    """The target decoder layers whose outputs must be captured (`DenseLM.forward(return_layers=...)`).

    The target's last layer is never among them: the reference reads it as the final-normed hidden state, which
    the target's forward returns anyway."""
    return tuple(sorted({int(i) for i in target_layer_ids if int(i) != num_target_layers - 1}))


def context_features(final_hidden: torch.Tensor, captured, target_layer_ids, num_target_layers: int) -> torch.Tensor:
    """Concatenate the target states the reference conditions on: [B, T, len(target_layer_ids) * H].

    `final_hidden` is the target's final-normed output, `captured` the layer outputs returned for
    `target_capture_layers(...)` (in that order). Layer id i means HF `hidden_states[i + 1]`: the output of
    decoder layer i, except i = num_target_layers - 1, where HF substitutes the final-normed state."""
    by_layer = dict(zip(target_capture_layers(target_layer_ids, num_target_layers), captured))
    parts = []
    for i in target_layer_ids:
        i = int(i)
        if not 0 <= i < num_target_layers:
            raise ModelFormatError(f"DFlash target layer {i} outside the target's {num_target_layers} layers")
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

    def _kv(self, x: torch.Tensor, cos, sin):
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, ctx, rope_blk, rope_ctx, positions_ctx, cache: KVCache | None, kv_len, mask):
        B, S, _ = x.shape
        cos_b, sin_b = rope_blk
        q = self.q_norm(self.q_proj(x).view(B, S, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos_b, sin_b)
        k_blk, v_blk = self._kv(x, cos_b, sin_b)
        if ctx.shape[1]:
            k_ctx, v_ctx = self._kv(ctx, *rope_ctx)
            if cache is not None:
                cache.write(self.layer_idx, positions_ctx, k_ctx, v_ctx)
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

    def forward(self, x, ctx, rope_blk, rope_ctx, positions_ctx, cache, kv_len, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_blk, rope_ctx, positions_ctx, cache, kv_len, mask)
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

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

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
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

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
        below its anchor position plus itself; feed each committed position once, in any later step."""
        x = block_embeds
        ctx = context.to(x.dtype)
        rope_blk = self._rope(positions_block, x.dtype)
        rope_ctx = self._rope(positions_ctx, x.dtype) if ctx.shape[1] else None
        masks = {}
        for i, layer in enumerate(self.layers):
            key = (self.config.layer_is_causal(i), self.config.layer_window(i))
            if key not in masks:
                masks[key] = self._mask(i, positions_ctx, positions_block, cache, kv_len)
            x = layer(x, ctx, rope_blk, rope_ctx, positions_ctx, cache, kv_len, masks[key])
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
) -> torch.Tensor:
    """One greedy DFlash draft, as the reference's spec_generate does per step -> token ids [num_tokens].

    `anchor_id` is the last committed token (an int or a 0-d tensor), at position `anchor_pos`.
    `context_hidden` is `context_features(...)` of the target for positions anchor_pos-C .. anchor_pos-1 ([C, n*H]
    or [1, C, n*H]): with a `cache`, only the positions not fed before (the reference feeds the prompt first, then
    each step the anchor and accepted drafts of the previous step); without one, the whole prefix.
    `num_tokens` defaults to block_size - 1 (the reference shortens the block only at max_new_tokens)."""
    k = drafter.block_size - 1 if num_tokens is None else int(num_tokens)
    embed_w, lm_head = _target_io(target_model)
    device = embed_w.device
    ids = torch.full((1, k + 1), drafter.mask_token_id, dtype=torch.long, device=device)
    ids[0, 0] = anchor_id
    ctx = context_hidden if context_hidden.dim() == 3 else context_hidden[None]
    C = ctx.shape[1]
    if C > anchor_pos:
        raise ValueError(f"{C} context positions cannot all precede the anchor at position {anchor_pos}")
    pos_ctx = torch.arange(anchor_pos - C, anchor_pos, device=device)[None]
    pos_blk = torch.arange(anchor_pos, anchor_pos + k + 1, device=device)[None]
    hidden = drafter(
        drafter.embed(ids, embed_w), drafter.project_context(ctx), pos_ctx, pos_blk, cache,
        kv_len=anchor_pos if cache is not None else None,
    )
    logits = drafter.compute_logits(hidden[:, 1:], lm_head)
    return logits.argmax(dim=-1)[0]
