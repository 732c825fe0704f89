"""A new DFlash drafter for a target: its config (layers, block, target layers to read, mask token) and an
initialisation of its layers from evenly spaced target layers (measured to help early: BENCHMARKS.md)."""

from __future__ import annotations

import dataclasses

import torch

from specpilot.errors import ConfigError
from specpilot.models.dflash import DFlashConfig, DFlashDrafter, build_target_layer_ids
# ----------------------------------------------------------------------------------------------------------
# a new drafter for a target


# Special tokens that chat data never contains, best first; the mask token's (frozen) embedding row should be a
# trained, distinct vector, which these are (unlike the zero/random padding rows past the tokenizer's vocab).
_MASK_CANDIDATES = ("<|fim_pad|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<|box_start|>",
                    "<empty_output>", "<jupyter_script>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_2|>", "<|finetune_right_pad_id|>")


def choose_mask_token_id(target, tokenizer=None, avoid=()) -> int:
    """The block's mask token: a special token of the target's vocabulary that never occurs in chat data.

    Rule: the first of `_MASK_CANDIDATES` the tokenizer knows (Qwen2.5: <|fim_pad|>; SmolLM2: <empty_output>);
    else the tokenizer's last added special token; else (no tokenizer) the last vocabulary id. Never EOS, BOS,
    PAD or UNK, nor an id in `avoid` (the CLI passes every id of the training sequences, so chat-role tokens
    are out), nor an id whose embedding row is all zeros (it would give the mask positions no input at all)."""
    vocab = target.config.vocab_size
    emb = target.model.embed_tokens.weight
    reserved = set(target.config.eos_token_ids) | {int(i) for i in avoid}
    ids: list[int] = []
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
            if getattr(hf, attr, None) is not None:
                reserved.add(int(getattr(hf, attr)))
        known = hf.get_vocab()
        ids += [known[t] for t in _MASK_CANDIDATES if t in known]
        ids += sorted((int(i) for i in getattr(hf, "added_tokens_decoder", {})), reverse=True)
    ids += [vocab - 1 - i for i in range(min(vocab, 256))]
    for i in ids:
        if 0 <= i < vocab and i not in reserved and bool(emb[i].detach().abs().sum() > 0):
            return int(i)
    raise ConfigError("found no usable mask token id; pass --mask-token-id")


def spread_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
    """n target layers to condition on, spread over the target: z-lab's rule (`build_target_layer_ids`: from layer
    1 to layer L-3) where the target is deep enough for it, else evenly over all layers."""
    if n <= 0:
        raise ConfigError("need at least one target layer")
    if num_target_layers >= 4 and n <= num_target_layers - 3:
        ids = build_target_layer_ids(num_target_layers, n)
        if len(set(ids)) == n:
            return tuple(ids)
    n = min(n, num_target_layers)
    if n == 1:
        return (num_target_layers // 2,)
    return tuple(sorted({round(i * (num_target_layers - 1) / (n - 1)) for i in range(n)}))


def new_drafter_config(target_cfg, *, num_layers: int = 2, block_size: int = 16, mask_token_id: int,
                       target_layer_ids: tuple[int, ...] | None = None,
                       num_target_features: int | None = None, intermediate_size: int | None = None) -> DFlashConfig:
    """A DFlash config shaped like the target (hidden size, heads, head dim, MLP width, RoPE), with `num_layers`
    full-attention draft layers conditioned on `target_layer_ids` (default: `num_target_features` layers, by
    default as many as draft layers as in z-lab's checkpoints, spread by `spread_layer_ids`). A smaller
    `intermediate_size` than the target's makes a smaller drafter (shipped drafters must be small)."""
    I = target_cfg.intermediate_size if intermediate_size is None else int(intermediate_size)
    if I <= 0:
        raise ConfigError(f"intermediate size must be > 0, got {I}")
    L = target_cfg.num_hidden_layers
    if target_layer_ids is None:
        target_layer_ids = spread_layer_ids(L, num_target_features or num_layers)
    bad = [i for i in target_layer_ids if not 0 <= int(i) < L]
    if bad:
        raise ConfigError(f"target layer ids {bad} outside the target's {L} layers")
    return DFlashConfig(
        hidden_size=target_cfg.hidden_size,
        intermediate_size=I,
        num_hidden_layers=num_layers,
        num_attention_heads=target_cfg.num_attention_heads,
        num_key_value_heads=target_cfg.num_key_value_heads,
        head_dim=target_cfg.head_dim,
        block_size=block_size,
        mask_token_id=int(mask_token_id),
        target_layer_ids=tuple(int(i) for i in target_layer_ids),
        num_target_layers=L,
        vocab_size=target_cfg.vocab_size,
        rms_norm_eps=target_cfg.rms_norm_eps,
        rope_theta=target_cfg.rope_theta,
        rope_scaling=target_cfg.rope_scaling,
        max_position_embeddings=target_cfg.max_position_embeddings,
        attention_bias=False,  # DFlash layers put a bias on all of q/k/v/o or none; Qwen2's is qkv-only
    )


def mlp_neurons(mlp, n: int) -> torch.Tensor:
    """Indices (ascending) of the `n` MLP neurons of a target layer to keep in a narrower draft MLP: the largest
    |gate row| * |up row| * |down column|, a cheap proxy for how much each neuron can write to the residual."""
    total = mlp.gate_proj.weight.shape[0]
    if n > total:
        raise ConfigError(f"a draft MLP of {n} neurons cannot start from a target layer of {total}")
    if n == total:
        return torch.arange(total, device=mlp.gate_proj.weight.device)
    score = (mlp.gate_proj.weight.float().norm(dim=1) * mlp.up_proj.weight.float().norm(dim=1)
             * mlp.down_proj.weight.float().norm(dim=0))
    return score.topk(n).indices.sort().values


@torch.no_grad()
def init_from_target(drafter: DFlashDrafter, target) -> tuple[int, ...]:
    """Copy draft layer i from target layer round((i + 1) * L / n) - 1 (evenly spaced, the last one being the
    target's last layer): q/k/v/o, MLP and both layer norms. q/k norms are copied from a Qwen3 target and set to
    ones otherwise; qkv biases (Qwen2) are dropped (the draft layers have none). `fc` starts as the mean of
    the conditioning layers' states. A narrower draft MLP keeps the target neurons `mlp_neurons` picks.
    -> the target layers copied."""
    n, L = drafter.config.num_hidden_layers, target.config.num_hidden_layers
    src = tuple(max(0, round((i + 1) * L / n) - 1) for i in range(n))
    for d_layer, t_idx in zip(drafter.layers, src):
        t_layer = target.model.layers[t_idx]
        ta, da = t_layer.self_attn, d_layer.self_attn
        if not hasattr(ta, "q_proj") or not hasattr(t_layer.mlp, "gate_proj"):
            raise ConfigError("init from the target needs unfused projections (load it with fused_projections off)")
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(da, name).weight.copy_(getattr(ta, name).weight)
        for name in ("q_norm", "k_norm"):
            tn = getattr(ta, name)
            getattr(da, name).weight.copy_(tn.weight if tn is not None else torch.ones_like(getattr(da, name).weight))
        keep = mlp_neurons(t_layer.mlp, d_layer.mlp.gate_proj.weight.shape[0])
        d_layer.mlp.gate_proj.weight.copy_(t_layer.mlp.gate_proj.weight[keep])
        d_layer.mlp.up_proj.weight.copy_(t_layer.mlp.up_proj.weight[keep])
        d_layer.mlp.down_proj.weight.copy_(t_layer.mlp.down_proj.weight[:, keep])
        d_layer.input_layernorm.weight.copy_(t_layer.input_layernorm.weight)
        d_layer.post_attention_layernorm.weight.copy_(t_layer.post_attention_layernorm.weight)
    drafter.norm.weight.copy_(target.model.norm.weight)
    k = len(drafter.config.target_layer_ids)
    H = drafter.config.hidden_size
    eye = torch.eye(H, dtype=drafter.fc.weight.dtype, device=drafter.fc.weight.device) / k
    drafter.fc.weight.copy_(torch.cat([eye] * k, dim=1))
    return src


def build_drafter_for(target, *, num_layers: int = 2, block_size: int = 16, mask_token_id: int | None = None,
                      tokenizer=None, target_layer_ids=None, num_target_features=None, init: str = "target",
                      seed: int = 0, avoid_ids=(), intermediate_size: int | None = None) -> DFlashDrafter:
    """A new fp32 drafter for `target` on its device (`init`: "target" copies target layers, "random" does not)."""
    if init not in ("target", "random"):
        raise ConfigError(f"init must be 'target' or 'random', got {init!r}")
    if mask_token_id is None:
        mask_token_id = choose_mask_token_id(target, tokenizer, avoid_ids)
    cfg = new_drafter_config(target.config, num_layers=num_layers, block_size=block_size, mask_token_id=mask_token_id,
                             target_layer_ids=target_layer_ids, num_target_features=num_target_features,
                             intermediate_size=intermediate_size)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg).to(device=target.lm_head.weight.device, dtype=torch.float32)
    if init == "target":
        init_from_target(drafter, target)
    return drafter


@torch.no_grad()
def grow_layers(drafter: DFlashDrafter, num_layers: int) -> DFlashDrafter:
    """A drafter of `num_layers` layers that drafts exactly what `drafter` drafts: its layers, then copies of its
    last layer whose residual writes (o_proj, down_proj) are zero, so each new layer adds nothing until training
    moves them (function-preserving growth). Why: a warm start keeps its validation tau while gaining capacity;
    issue 4 asks what more layers buy, and a new deeper drafter would restart from scratch. `drafter` itself
    when it already has >= num_layers layers."""
    c = drafter.config
    extra = num_layers - c.num_hidden_layers
    if extra <= 0:
        return drafter
    cfg = dataclasses.replace(c, num_hidden_layers=num_layers, layer_types=c.layer_types + (c.layer_types[-1],) * extra)
    p = drafter.fc.weight
    grown = DFlashDrafter(cfg).to(device=p.device, dtype=p.dtype)
    state = drafter.state_dict()
    last = {k.split(".", 2)[2]: v for k, v in state.items() if k.startswith(f"layers.{c.num_hidden_layers - 1}.")}
    for i in range(c.num_hidden_layers, num_layers):
        for name, value in last.items():
            zero = name.startswith(("self_attn.o_proj.", "mlp.down_proj."))
            state[f"layers.{i}.{name}"] = torch.zeros_like(value) if zero else value.clone()
    grown.load_state_dict(state)
    grown.train(drafter.training)
    return grown
