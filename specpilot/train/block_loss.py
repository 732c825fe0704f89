"""The training pass of a DFlash drafter: all anchors of a sequence as one masked query sequence, and the
offset-weighted block loss (see train/dflash_trainer.py's docstring for the derivation of both)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specpilot.models.dflash import DFlashConfig, DFlashDrafter, apply_layer_rules

IGNORE = -100
# ----------------------------------------------------------------------------------------------------------
# the batched training forward


def block_attention_mask(cfg: DFlashConfig, layer: int, pos_ctx, pos_blk, anchor_of_q, block_of_q) -> torch.Tensor:
    """[N, 1, Q, T + Q] bool (True = may attend) for Q block queries over [context (T) ; all blocks (Q)] keys.

    A block query sees context keys at positions before its anchor and the keys of its own block, as one
    `DFlashDrafter.forward` call for that block alone would give it; plus the layer's causal/window rules."""
    ctx_vis = pos_ctx[:, None, :] < anchor_of_q[:, :, None]  # [N, Q, T]
    blk_vis = block_of_q[:, :, None] == block_of_q[:, None, :]  # [N, Q, Q]
    vis = torch.cat((ctx_vis, blk_vis), dim=2)
    causal, window = cfg.layer_is_causal(layer), cfg.layer_window(layer)
    if causal or window is not None:
        vis = apply_layer_rules(vis, pos_blk, torch.cat((pos_ctx, pos_blk), dim=1), causal, window)
    return vis[:, None]


def drafter_block_hidden(drafter: DFlashDrafter, embed_weight, features, tokens, anchors) -> torch.Tensor:
    """Final-normed drafter states of all blocks: [N, A * B, H].

    features [N, T, n*H] target context features of the sequences; tokens [N, T]; anchors [N, A] anchor
    positions (each >= 1 ... any position with context before it; 0 gives an empty context)."""
    cfg = drafter.config
    N, T = tokens.shape
    A, Bs = anchors.shape[1], cfg.block_size
    device = tokens.device
    offs = torch.arange(Bs, device=device)
    pos_blk = (anchors[:, :, None] + offs).reshape(N, A * Bs)
    block_ids = torch.full((N, A, Bs), cfg.mask_token_id, dtype=torch.long, device=device)
    block_ids[:, :, 0] = tokens.gather(1, anchors)
    block_ids = block_ids.reshape(N, A * Bs)
    anchor_of_q = anchors[:, :, None].expand(N, A, Bs).reshape(N, A * Bs)
    block_of_q = torch.arange(A, device=device)[None, :, None].expand(N, A, Bs).reshape(N, A * Bs)
    pos_ctx = torch.arange(T, device=device)[None].expand(N, T)
    dtype = drafter.fc.weight.dtype
    x = drafter.embed(block_ids, embed_weight).to(dtype)
    ctx = drafter.project_context(features)
    rope_blk, rope_ctx = drafter._rope(pos_blk, dtype), drafter._rope(pos_ctx, dtype)
    masks: dict = {}
    for i, layer in enumerate(drafter.layers):
        key = (cfg.layer_is_causal(i), cfg.layer_window(i))
        if key not in masks:
            masks[key] = block_attention_mask(cfg, i, pos_ctx, pos_blk, anchor_of_q, block_of_q)
        x = layer(x, ctx, rope_blk, rope_ctx, pos_ctx, None, None, masks[key])
    return drafter.norm(x)


def block_labels(tokens, lengths, anchors, block_size: int) -> torch.Tensor:
    """[N, A, B] labels: token at anchor + k for k >= 1 while inside the sequence, else IGNORE (offset 0 too)."""
    offs = torch.arange(block_size, device=tokens.device)
    pos = anchors[:, :, None] + offs  # [N, A, B]
    valid = (pos < lengths[:, None, None]) & (offs > 0)
    labels = tokens.gather(1, pos.clamp(max=tokens.shape[1] - 1).flatten(1)).view_as(pos)
    return torch.where(valid, labels, torch.full_like(labels, IGNORE))


def offset_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """[B] loss weight of each block offset: 0 for the anchor, exp(-(k - 1) / gamma) for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


def block_loss(drafter: DFlashDrafter, lm_head, hidden, labels, weights, soft: torch.Tensor | None = None,
               kd_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Weighted CE over labelled block positions -> (loss, metrics as 0-d / 1-d tensors, no host sync):
    accept_len (mean over anchors of the consecutive argmax hits from offset 1), acc (top-1 over labelled
    positions), acc_by_offset [B-1] (NaN where an offset has no label), tokens (labelled positions).
    `soft` [N, A, B-1, V] (the target's distributions, DFlashTrainer.soft_targets; overwritten): each position's
    CE is (1 - kd_weight) CE(label) + kd_weight CE(soft) (TrainConfig.kd_weight)."""
    N, A, Bs = labels.shape
    lab = labels[:, :, 1:]  # offset 0 (the anchor) has no label
    h = hidden.view(N, A, Bs, -1)[:, :, 1:]
    logits = drafter.compute_logits(h, lm_head).float()  # [N, A, B-1, V]; no boolean indexing: no host sync
    if soft is not None and kd_weight > 0:
        # CE is linear in its target distribution: one CE against kd * soft + (1 - kd) * one-hot(label), the
        # mixture built in place in `soft` (one [.., V] log-softmax, not two). Positions without a label get any
        # target: they are weighted 0 below
        mix = soft.to(logits.dtype).mul_(kd_weight)
        mix.scatter_add_(-1, lab.clamp_min(0)[..., None], torch.full_like(mix[..., :1], 1.0 - kd_weight))
        ce = F.cross_entropy(logits.flatten(0, 2), mix.flatten(0, 2), reduction="none")
    else:
        ce = F.cross_entropy(logits.flatten(0, 2), lab.reshape(-1), ignore_index=IGNORE, reduction="none")
    labelled = (lab != IGNORE).float()
    w = weights.to(ce.device)[1:] * labelled  # [N, A, B-1]
    loss = (ce.view_as(w) * w).sum() / w.sum().clamp_min(1e-9)
    with torch.no_grad():
        correct = (logits.argmax(-1) == lab).float() * labelled
        has = labelled[:, :, 0]  # anchors with at least one label
        accept_len = correct.cumprod(-1).sum(-1)  # consecutive hits from offset 1
        per_offset = labelled.sum((0, 1))
        metrics = {
            "accept_len": (accept_len * has).sum() / has.sum().clamp_min(1),
            "acc": correct.sum() / labelled.sum().clamp_min(1),
            "acc_by_offset": torch.where(per_offset > 0, correct.sum((0, 1)) / per_offset.clamp_min(1),
                                         torch.full_like(per_offset, float("nan"))),
            "tokens": labelled.sum(),
        }
    return loss, metrics
