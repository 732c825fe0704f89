"""Training a DFlash block drafter for a target (the network of `models/dflash.py`, z-lab's checkpoint format).

The drafter learns to draft what the *target* says: training sequences are prompt + the target's own greedy
response (`train/regenerate.py`). The target is frozen (eval, no grad); only drafter parameters train. Its input
embedding and LM head are the target's, shared and frozen, as at inference.

One step, for N sequences (prompt + response, right-padded to T tokens):

1. Target pass. One teacher-forced `DenseLM.forward(..., return_layers=target_capture_layers(...))` over all
   positions gives `context_features` [N, T, n*H], exactly what the engine's runner hands the drafter at
   inference for the same committed tokens.
2. Anchors. A positions per sequence are drawn uniformly (without replacement) from the response anchors
   j in [P-1, L-2] (P prompt tokens, L sequence length): at inference the first anchor is the last prompt
   token and every later one a committed response token. Each anchor makes a block
   [token_j, mask, ..., mask] (block_size B) at positions j .. j+B-1 whose labels are tokens j+1 .. j+B-1
   (ignored past the sequence end; offset 0, the anchor itself, has no label).
3. Drafter pass, all anchors of a sequence at once. The context is projected once per sequence
   (`project_context`, [N, T, H]) and each draft layer computes the context K/V once per sequence; the A
   blocks are concatenated into one query sequence of A*B tokens, and one boolean attention mask gives each
   block what inference gives it: the context keys at positions < its anchor, plus its own block's keys (not
   the other blocks'), with the per-layer causal / sliding-window rules of the config. The draft layers are
   called with that mask (their inference code, only the mask differs), so the trained function is the
   inference function: `test_train.py` checks the batched hidden states against per-anchor
   `DFlashDrafter.forward` calls. Cost per sequence: context K/V projections for T tokens and the layers for
   A*B block tokens, plus dense masked attention of A*B queries over T + A*B keys (about half of the context
   part and (A-1)/A of the block part are masked: wasted but cheap next to the projections at these sizes).
   Versus one padded (sequence, anchor) row per block, this does the context K/V work once instead of A times.
4. Loss. Cross-entropy of the draft logits (through the target's LM head, `compute_logits`) against the labels,
   weighted by offset k in the block: w_k = exp(-(k - 1) / gamma), normalised over the labelled positions of
   the batch. Why decaying: a drafted token at offset k only counts when offsets 1..k-1 were accepted too, so
   its value is about P(reach k) = alpha^(k-1) for a per-position acceptance alpha; gamma = 7 (the default
   for block 16, (B-1)/2 in general) matches alpha ~ 0.87.

Also reported per step: the teacher-forced acceptance length (per anchor, how many offsets 1.. in a row the
drafter's argmax gets right). The labels are the target's greedy tokens and the context is the target's, so
1 + that length is the engine's greedy tau for a step anchored there (bf16 numerics aside).

Optimisation: AdamW over drafter parameters (fp32 master weights), linear warmup then cosine decay to
`min_lr_ratio`, gradient clipping, bf16 autocast on CUDA. The batch and anchors of step s are a pure function
of (seed, s), so a resumed run needs only the step, weights, optimizer and scheduler state to continue exactly.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from specpilot.errors import ConfigError
from specpilot.models.dflash import (
    DFlashConfig, DFlashDrafter, apply_layer_rules, build_target_layer_ids, context_features, target_capture_layers,
)
from specpilot.models.dflash_io import load_dflash, save_dflash

STATE_FILE = "trainer_state.pt"
CHECKPOINT = "checkpoint"
BEST = "best"
IGNORE = -100


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
                       num_target_features: int | None = None) -> DFlashConfig:
    """A DFlash config shaped like the target (hidden size, heads, head dim, MLP width, RoPE), with `num_layers`
    full-attention draft layers conditioned on `target_layer_ids` (default: `num_target_features` layers, by
    default as many as draft layers as in z-lab's checkpoints, spread by `spread_layer_ids`)."""
    L = target_cfg.num_hidden_layers
    if target_layer_ids is None:
        target_layer_ids = spread_layer_ids(L, num_target_features or num_layers)
    bad = [i for i in target_layer_ids if not 0 <= int(i) < L]
    if bad:
        raise ConfigError(f"target layer ids {bad} outside the target's {L} layers")
    return DFlashConfig(
        hidden_size=target_cfg.hidden_size,
        intermediate_size=target_cfg.intermediate_size,
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


@torch.no_grad()
def init_from_target(drafter: DFlashDrafter, target) -> tuple[int, ...]:
    """Copy draft layer i from target layer round((i + 1) * L / n) - 1 (evenly spaced, the last one being the
    target's last layer): q/k/v/o, MLP and both layer norms. q/k norms are copied from a Qwen3 target and set to
    ones otherwise; qkv biases (Qwen2) are dropped (the draft layers have none). `fc` starts as the mean of
    the conditioning layers' states. -> the target layers copied."""
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
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(d_layer.mlp, name).weight.copy_(getattr(t_layer.mlp, name).weight)
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
                      seed: int = 0, avoid_ids=()) -> DFlashDrafter:
    """A new fp32 drafter for `target` on its device (`init`: "target" copies target layers, "random" does not)."""
    if init not in ("target", "random"):
        raise ConfigError(f"init must be 'target' or 'random', got {init!r}")
    if mask_token_id is None:
        mask_token_id = choose_mask_token_id(target, tokenizer, avoid_ids)
    cfg = new_drafter_config(target.config, num_layers=num_layers, block_size=block_size, mask_token_id=mask_token_id,
                             target_layer_ids=target_layer_ids, num_target_features=num_target_features)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg).to(device=target.lm_head.weight.device, dtype=torch.float32)
    if init == "target":
        init_from_target(drafter, target)
    return drafter


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


def block_loss(drafter: DFlashDrafter, lm_head, hidden, labels, weights) -> tuple[torch.Tensor, dict]:
    """Weighted CE over labelled block positions -> (loss, metrics as 0-d / 1-d tensors, no host sync):
    accept_len (mean over anchors of the consecutive argmax hits from offset 1), acc (top-1 over labelled
    positions), acc_by_offset [B-1] (NaN where an offset has no label), tokens (labelled positions)."""
    N, A, Bs = labels.shape
    lab = labels[:, :, 1:]  # offset 0 (the anchor) has no label
    h = hidden.view(N, A, Bs, -1)[:, :, 1:]
    logits = drafter.compute_logits(h, lm_head).float()  # [N, A, B-1, V]; no boolean indexing: no host sync
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


# ----------------------------------------------------------------------------------------------------------
# the trainer


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 8  # sequences per step
    anchors_per_seq: int = 16
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    loss_gamma: float | None = None  # offset weight decay; None = (block_size - 1) / 2
    max_seq_len: int = 2048  # sequences are cut to this many tokens
    seed: int = 0
    amp: bool = True  # bf16 autocast on CUDA (ignored elsewhere)

    def __post_init__(self):
        for name in ("steps", "batch_size", "anchors_per_seq", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        self.betas = tuple(self.betas)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine from 1 to min_lr_ratio at `steps`."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    grad_norm: float
    accept_len: float
    acc: float
    step_s: float
    tokens: int  # labelled block positions this step
    acc_by_offset: list = field(default_factory=list)


class DFlashTrainer:
    """Holds the frozen target, the drafter being trained, the optimizer and the training sequences.

    `sequences` are objects with `.prompt_ids` and `.response_ids` (train/regenerate.Sequence)."""

    def __init__(self, target, drafter: DFlashDrafter, sequences, cfg: TrainConfig):
        self.target, self.drafter, self.cfg = target, drafter, cfg
        self.device = target.lm_head.weight.device
        target.eval().requires_grad_(False)
        self.drafter.train()
        self.items = self._prepare(sequences, cfg.max_seq_len)
        if not self.items:
            raise ConfigError("no usable training sequences (each needs a prompt and a response within max_seq_len)")
        self.capture = target_capture_layers(drafter.config.target_layer_ids, target.config.num_hidden_layers)
        self.gamma = cfg.loss_gamma if cfg.loss_gamma is not None else max(1.0, (drafter.block_size - 1) / 2)
        self.weights = offset_weights(drafter.block_size, self.gamma, self.device)
        params = [p for p in drafter.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=cfg.betas, **({"fused": True} if self.device.type == "cuda" else {}))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, cfg))
        self.step = 0
        self._cache = None
        self.mask_in_data = sum(ids.count(drafter.mask_token_id) for ids, _ in self.items)

    @staticmethod
    def _prepare(sequences, max_len: int) -> list[tuple[list[int], int]]:
        out = []
        for s in sequences:
            P = len(s.prompt_ids)
            ids = (list(s.prompt_ids) + list(s.response_ids))[:max_len]
            if 1 <= P < len(ids):  # at least one response token (the first anchor is the last prompt token)
                out.append((ids, P))
        return out

    # -- data: a pure function of (seed, step) --

    def batch_indices(self, step: int) -> list[int]:
        n, N = len(self.items), self.cfg.batch_size
        out = []
        flat = step * N
        while len(out) < N:
            epoch, offset = divmod(flat, n)
            perm = list(range(n))
            random.Random(f"{self.cfg.seed}/epoch/{epoch}").shuffle(perm)
            take = min(N - len(out), n - offset)
            out += perm[offset:offset + take]
            flat += take
        return out

    def make_batch(self, indices: list[int], rng: random.Random, items=None):
        """-> tokens [N, T], lengths [N], anchors [N, A] (on the device)."""
        items = self.items if items is None else items
        A = self.cfg.anchors_per_seq
        rows = [items[i] for i in indices]
        T = max(len(ids) for ids, _ in rows)
        tokens = torch.zeros(len(rows), T, dtype=torch.long)
        anchors = torch.zeros(len(rows), A, dtype=torch.long)
        for r, (ids, P) in enumerate(rows):
            tokens[r, : len(ids)] = torch.tensor(ids)
            choices = list(range(P - 1, len(ids) - 1))  # anchors with at least one label
            picked = rng.sample(choices, A) if len(choices) >= A else [rng.choice(choices) for _ in range(A)]
            anchors[r] = torch.tensor(sorted(picked))
        lengths = torch.tensor([len(ids) for ids, _ in rows])
        return tokens.to(self.device), lengths.to(self.device), anchors.to(self.device)

    # -- the forward --

    def _autocast(self):
        """bf16 autocast on CUDA (fp32 master weights); on any device a half-precision target needs autocast in
        its dtype too (its LM head and features meet the fp32 drafter)."""
        tdtype = self.target.lm_head.weight.dtype
        if tdtype != torch.float32:
            return torch.autocast(device_type=self.device.type, dtype=tdtype)
        on = self.cfg.amp and self.device.type == "cuda"
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=on)

    @torch.no_grad()
    def target_features(self, tokens: torch.Tensor) -> torch.Tensor:
        N, T = tokens.shape
        if self._cache is None or self._cache.batch_size != N or self._cache.max_seq_len < T:
            self._cache = self.target.new_cache(N, max(T, min(self.cfg.max_seq_len, 2 * T)))
        pos = torch.arange(T, device=tokens.device)[None].expand(N, T)
        out = self.target(tokens, pos, self._cache, kv_len=T, return_layers=self.capture)
        hidden, layers = out if self.capture else (out, [])
        return context_features(hidden, layers, self.drafter.config.target_layer_ids,
                                self.target.config.num_hidden_layers)

    def loss_on(self, tokens, lengths, anchors) -> tuple[torch.Tensor, dict]:
        feats = self.target_features(tokens)
        labels = block_labels(tokens, lengths, anchors, self.drafter.block_size)
        with self._autocast():
            hidden = drafter_block_hidden(self.drafter, self.target.model.embed_tokens.weight, feats, tokens, anchors)
            return block_loss(self.drafter, self.target.lm_head, hidden, labels, self.weights)

    def train_step(self) -> StepResult:
        t0 = time.perf_counter()
        rng = random.Random(f"{self.cfg.seed}/anchors/{self.step}")
        tokens, lengths, anchors = self.make_batch(self.batch_indices(self.step), rng)
        self.drafter.train()
        loss, m = self.loss_on(tokens, lengths, anchors)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        vals = torch.cat([torch.stack([loss.detach().float(), gnorm.float(), m["accept_len"], m["acc"], m["tokens"]]),
                          m["acc_by_offset"]]).tolist()  # the step's one host sync
        loss_v, gnorm_v, accept_len, acc, n_tok = vals[:5]
        by_offset = [None if math.isnan(v) else round(v, 4) for v in vals[5:]]
        return StepResult(self.step, loss_v, lr, gnorm_v, accept_len, acc, time.perf_counter() - t0, int(n_tok),
                          by_offset)

    @torch.no_grad()
    def evaluate_loss(self, sequences, *, max_batches: int = 4) -> dict:
        """Loss and teacher-forced acceptance on fixed anchors of `sequences` (no training)."""
        items = self._prepare(sequences, self.cfg.max_seq_len)
        if not items:
            return {}
        self.drafter.eval()
        rng = random.Random(f"{self.cfg.seed}/val")
        N = self.cfg.batch_size
        tot, accl, n = 0.0, 0.0, 0
        for b in range(min(max_batches, math.ceil(len(items) / N))):
            idx = list(range(b * N, min(len(items), (b + 1) * N)))
            tokens, lengths, anchors = self.make_batch(idx, rng, items)
            loss, m = self.loss_on(tokens, lengths, anchors)
            tot += float(loss) * len(idx)
            accl += float(m["accept_len"]) * len(idx)
            n += len(idx)
        self.drafter.train()
        return {"val_loss": tot / n, "val_accept_len": accl / n}

    # -- checkpoints --

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "train_config": asdict(self.cfg),
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        rng = state.get("rng") or {}
        if rng.get("python") is not None:
            random.setstate(rng["python"])
        if rng.get("torch") is not None:
            torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    def save(self, out: str | Path, extra: dict | None = None) -> Path:
        """Write OUT/checkpoint (z-lab DFlash folder + trainer_state.pt), replacing the previous one only once the
        new one is complete. -> its path."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        new, final, old = out / ".checkpoint-new", out / CHECKPOINT, out / ".checkpoint-old"
        shutil.rmtree(new, ignore_errors=True)
        save_dflash(self.drafter, new)
        torch.save({**self.state_dict(), "extra": extra or {}}, new / STATE_FILE)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(new, final)
        shutil.rmtree(old, ignore_errors=True)
        return final


def checkpoint_dir(out: str | Path) -> Path | None:
    """The latest complete checkpoint under OUT (a swap interrupted half-way leaves the previous one)."""
    out = Path(out)
    for p in (out / CHECKPOINT, out / ".checkpoint-old"):
        if (p / STATE_FILE).exists() and (p / "config.json").exists():
            return p
    return None


def load_checkpoint(path: str | Path, device) -> tuple[DFlashDrafter, dict]:
    """-> (fp32 drafter on `device`, trainer state) of a checkpoint folder."""
    path = Path(path)
    drafter = load_dflash(path, dtype=torch.float32, device=device)
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    return drafter, state


def resume_trainer(target, sequences, path: str | Path, cfg: TrainConfig | None = None) -> DFlashTrainer:
    """A trainer continuing exactly from a checkpoint folder (its saved TrainConfig unless `cfg` is given)."""
    device = target.lm_head.weight.device
    drafter, state = load_checkpoint(path, device)
    if cfg is None:
        cfg = TrainConfig(**state["train_config"])
    trainer = DFlashTrainer(target, drafter, sequences, cfg)
    trainer.load_state_dict(state)
    trainer.resumed_extra = state.get("extra") or {}
    return trainer


# ----------------------------------------------------------------------------------------------------------
# validation through the real engine


def inference_copy(drafter: DFlashDrafter, target) -> DFlashDrafter:
    """An eval copy of the drafter in the target's dtype (the engine runs both in one dtype)."""
    return copy.deepcopy(drafter).to(dtype=target.lm_head.weight.dtype).eval()


def validate_tau(target, drafter: DFlashDrafter, prompts_ids: list[list[int]], *, max_new_tokens: int = 128,
                 num_draft_tokens: int | None = None, ignore_eos: bool = False) -> dict:
    """Greedy speculative decoding of each prompt with the real engine and this drafter:
    -> {"tau": tokens per target forward over all prompts, "tokens", "forwards", "per_prompt": [...]}."""
    from specpilot.config import EngineConfig
    from specpilot.engine import Engine, build_drafter

    if not prompts_ids:
        return {"tau": float("nan"), "tokens": 0, "forwards": 0, "per_prompt": []}
    k = drafter.block_size - 1 if num_draft_tokens is None else num_draft_tokens
    longest = max(len(p) for p in prompts_ids)
    device = str(target.lm_head.weight.device)
    cfg = EngineConfig(drafter_kind="dflash", num_draft_tokens=k, max_new_tokens=max_new_tokens,
                       max_seq_len=max(16, longest + max_new_tokens + k + 2), device=device, cuda_graphs=False,
                       fused_projections=False, ignore_eos=ignore_eos)
    net = inference_copy(drafter, target)
    engine = Engine(target, cfg, build_drafter(cfg, net, target))
    tokens = forwards = 0
    per = []
    for p in prompts_ids:
        res = engine.generate(list(p))
        tokens += res.num_output_tokens
        forwards += res.num_target_forwards
        per.append(round(res.tau, 4))
    return {"tau": tokens / max(forwards, 1), "tokens": tokens, "forwards": forwards, "per_prompt": per}


# ----------------------------------------------------------------------------------------------------------
# the training loop (used by the CLI)


@dataclass
class LoopConfig:
    val_every: int = 200  # steps between validations (0 = only at the end)
    save_every: int = 200  # steps between checkpoints (0 = only at the end)
    val_max_new_tokens: int = 128
    deadline: float | None = None  # time.monotonic() seconds: stop and checkpoint before it
    log_every: int = 10


def run_training(trainer: DFlashTrainer, out: str | Path, *, loop: LoopConfig, val_prompts: list[list[int]],
                 val_sequences=(), log: Callable[[str], None] | None = None, progress: bool = True,
                 best_tau: float | None = None) -> dict:
    """Train until `trainer.cfg.steps` or the deadline, validating and checkpointing on the way.

    Appends JSON lines to OUT/log.jsonl ({"kind": "train"|"val", ...}); saves OUT/checkpoint, and OUT/best when
    validation tau improves. -> summary {steps, final_loss, best_val_tau, checkpoint, best, stopped_by}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log = log or (lambda m: None)
    log_path = out / "log.jsonl"
    cfg = trainer.cfg
    best = best_tau if best_tau is not None else float("-inf")
    last: StepResult | None = None
    save_s, val_s, step_times = 5.0, 5.0, []
    stopped_by = "steps"

    def write(rec: dict):
        with open(log_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")

    def validate():
        nonlocal best, val_s
        t0 = time.monotonic()
        rec = {"kind": "val", "step": trainer.step, "time": time.time()}
        if val_sequences:
            rec.update(trainer.evaluate_loss(val_sequences))
        if val_prompts:
            v = validate_tau(trainer.target, trainer.drafter, val_prompts, max_new_tokens=loop.val_max_new_tokens)
            rec.update({"val_tau": v["tau"], "val_tokens": v["tokens"]})
            if v["tau"] > best:
                best = v["tau"]
                save_dflash(trainer.drafter, out / BEST)
                rec["best"] = True
        val_s = time.monotonic() - t0
        rec["val_s"] = round(val_s, 3)
        write(rec)
        log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()
                     if k not in ("kind", "time")))
        return rec

    def save():
        nonlocal save_s
        t0 = time.monotonic()
        path = trainer.save(out, {"best_val_tau": best if best > float("-inf") else None})
        save_s = time.monotonic() - t0
        return path

    bar = None
    if progress:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                       TextColumn("{task.fields[info]}"), console=Console(stderr=True), transient=False)
        task = bar.add_task("train", total=cfg.steps, completed=trainer.step, info="")
        bar.start()
    try:
        while trainer.step < cfg.steps:
            if loop.deadline is not None:
                typical = sorted(step_times)[len(step_times) // 2] if step_times else 5.0
                due_val = loop.val_every and (trainer.step + 1) % loop.val_every == 0
                need = 2 * typical + 2 * save_s + (val_s if due_val else 0.0) + 5.0
                if time.monotonic() + need > loop.deadline:
                    stopped_by = "time_limit"
                    break
            last = trainer.train_step()
            step_times = (step_times + [last.step_s])[-50:]
            rec = {"kind": "train", **asdict(last)}
            write(rec)
            if bar is not None:
                bar.update(task, completed=trainer.step,
                           info=f"loss {last.loss:.3f} acc-len {last.accept_len:.2f} lr {last.lr:.2e}")
            elif loop.log_every and trainer.step % loop.log_every == 0:
                log(f"step {trainer.step} loss {last.loss:.4f} accept_len {last.accept_len:.2f} lr {last.lr:.2e} "
                    f"{last.step_s * 1e3:.0f} ms")
            if loop.val_every and trainer.step % loop.val_every == 0 and trainer.step < cfg.steps:
                validate()
            if loop.save_every and trainer.step % loop.save_every == 0 and trainer.step < cfg.steps:
                save()
    finally:
        if bar is not None:
            bar.stop()
    final_val = None
    if trainer.step >= cfg.steps and (loop.deadline is None or time.monotonic() + val_s + save_s < loop.deadline):
        final_val = validate()
    ckpt = save()
    return {
        "steps": trainer.step,
        "final_loss": last.loss if last is not None else None,
        "final_accept_len": last.accept_len if last is not None else None,
        "final_val_tau": (final_val or {}).get("val_tau"),
        "final_val_loss": (final_val or {}).get("val_loss"),
        "best_val_tau": best if best > float("-inf") else None,
        "checkpoint": str(ckpt),
        "best": str(out / BEST) if (out / BEST).exists() else None,
        "stopped_by": stopped_by,
        "median_step_s": sorted(step_times)[len(step_times) // 2] if step_times else None,
    }
