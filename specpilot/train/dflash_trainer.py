"""Training a DFlash block drafter for a target (the network of `models/dflash.py`, z-lab's checkpoint format).

The drafter learns to draft what the *target* says: training sequences are prompt + the target's own greedy
response (`train/regenerate.py`). The target is frozen (eval, no grad); only drafter parameters train. Its input
embedding and LM head are the target's, shared and frozen, as at inference.

One step, for N sequences (prompt + response, right-padded to T tokens):

1. Target pass. One teacher-forced `DenseLM.forward(..., return_layers=target_capture_layers(...))` over all
   positions gives `context_features` [N, T, n*H], exactly what the engine's runner hands the drafter at
   inference for the same committed tokens. It stops at the deepest layer the drafter reads (`last_layer`) and
   attends with SDPA's causal mask (`is_causal`, no mask tensor, so the flash path) since it starts at position 0.
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

Batches are length-bucketed (`length_buckets`, `epoch_batches`): each epoch's shuffled sequences are sorted by
length within windows of batch_size * length_buckets and cut into batches, which are then shuffled. A batch is
padded to its longest sequence, and with random batches most of a step was padding (H200 data: 50-1280 tokens,
mean ~330, batches of 16 padded to ~1000+).
"""

from __future__ import annotations

import itertools
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specpilot.errors import ConfigError
from specpilot.models.dflash import DFlashDrafter, context_features, target_capture_layers
from specpilot.models.dflash_io import load_dflash, save_dflash
from specpilot.train.block_loss import block_labels, block_loss, drafter_block_hidden, offset_weights
from specpilot.train.dflash_init import (
    build_drafter_for, choose_mask_token_id, init_from_target, new_drafter_config, spread_layer_ids,
)
from specpilot.train.distributed import Dist

__all__ = [  # the trainer's API, including what it re-exports from the two modules it is built on; the loop
    # that drives it (validation, checkpoints, deadlines) is train/loop.py
    "DFlashTrainer", "TrainConfig", "block_labels", "build_drafter_for", "checkpoint_dir", "choose_mask_token_id",
    "drafter_block_hidden", "epoch_batches", "init_from_target", "new_drafter_config", "offset_weights",
    "resume_trainer", "spread_layer_ids",
]

STATE_FILE = "trainer_state.pt"
CHECKPOINT = "checkpoint"
BEST = "best"


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
    length_buckets: int = 32  # batches per length-sorted window (epoch_batches); 0 or 1 = random batches
    # distillation: loss = (1 - kd_weight) CE(labels) + kd_weight CE(the target's own distribution at each labelled
    # position), same offset weights. The labels are the target's greedy tokens, so the soft targets' argmax is the
    # label; they add how close the runners-up were. The target pass then runs to its final norm (block_loss)
    kd_weight: float = 0.0
    # a warm start (--init-from): the LR of the parameters it carried is lr * warm_lr_scale, so layers grown on top
    # of it (--draft-layers above its own: layers carried_layers and up) learn at the full lr while the trained ones
    # move gently. Why: every warm-started run at 3e-4 lost validation tau in its first ~500 steps (sessions 10, 17,
    # 18) while a grown layer starts as a no-op and needs the full rate. carried_layers 0: nothing was carried
    warm_lr_scale: float = 1.0
    carried_layers: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "anchors_per_seq", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.length_buckets < 0:
            raise ConfigError(f"length_buckets must be >= 0, got {self.length_buckets}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if not 0.0 < self.warm_lr_scale <= 1.0:
            raise ConfigError(f"warm_lr_scale must be in (0, 1], got {self.warm_lr_scale}")
        if self.carried_layers < 0:
            raise ConfigError(f"carried_layers must be >= 0, got {self.carried_layers}")
        if not 0.0 <= self.kd_weight <= 1.0:
            raise ConfigError(f"kd_weight must be in [0, 1], got {self.kd_weight}")
        self.betas = tuple(self.betas)


def param_groups(drafter, cfg: TrainConfig) -> list[dict]:
    """AdamW groups: weight decay on matrices only; with a warm start (cfg.carried_layers > 0), the carried
    parameters (fc, norms, layers below carried_layers) at lr * warm_lr_scale, grown layers at lr. The same
    arguments always give the same groups in the same order (a resumed run loads its optimizer state into them)."""
    def grown(name: str) -> bool:
        parts = name.split(".")
        return cfg.carried_layers > 0 and parts[0] == "layers" and int(parts[1]) >= cfg.carried_layers

    groups = []
    for is_grown in (False, True):
        scale = 1.0 if is_grown or cfg.carried_layers == 0 else cfg.warm_lr_scale
        named = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad and grown(n) == is_grown]
        for decay in (True, False):
            ps = [p for _, p in named if (p.dim() >= 2) == decay]
            if ps:
                groups.append({"params": ps, "weight_decay": cfg.weight_decay if decay else 0.0,
                               "lr": cfg.lr * scale})
    return groups


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine from 1 to min_lr_ratio at `steps`."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def epoch_batches(lengths: list[int], batch_size: int, buckets: int, seed: int, epoch: int,
                  group: int = 1) -> list[list[int]]:
    """The batches (item indices) of one epoch, length-bucketed: the seeded shuffle of all items is cut into
    windows of batch_size * buckets items, each window is sorted by length and cut into batches, and the batches
    are shuffled. Batches of similar lengths waste little on padding, and each window is a random sample so the
    order of what is learnt stays random. A short last batch is filled from the start of the shuffled list.

    `group` (the number of data-parallel ranks): runs of `group` neighbouring batches in length order are shuffled
    as units, so the batches the ranks take in one step (consecutive in the stream) have similar lengths and no
    rank waits long for another at the gradient all-reduce. group=1 is the plain shuffle."""
    order = list(range(len(lengths)))
    random.Random(f"{seed}/epoch/{epoch}").shuffle(order)
    window = batch_size * max(1, buckets)
    batches = []
    for w in range(0, len(order), window):
        part = sorted(order[w:w + window], key=lambda i: lengths[i])
        batches += [part[b:b + batch_size] for b in range(0, len(part), batch_size)]
    if len(batches[-1]) < batch_size:  # only the last window can end short (a window is whole batches)
        batches[-1] += itertools.islice(itertools.cycle(order), batch_size - len(batches[-1]))
    group = max(1, group)
    whole = len(batches) - len(batches) % group  # a short last run stays last, or it would shift every pair after it
    units = [batches[i:i + group] for i in range(0, whole, group)]
    random.Random(f"{seed}/batches/{epoch}").shuffle(units)
    return [b for unit in units for b in unit] + batches[whole:]


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

    def __init__(self, target, drafter: DFlashDrafter, sequences, cfg: TrainConfig, dist: Dist | None = None):
        self.target, self.drafter, self.cfg = target, drafter, cfg
        self.dist = dist or Dist()  # data-parallel ranks (train/distributed.py); one process by default
        self.device = target.lm_head.weight.device
        target.eval().requires_grad_(False)
        self.drafter.train()
        self.items = self._prepare(sequences, cfg.max_seq_len)
        if not self.items:
            raise ConfigError("no usable training sequences (each needs a prompt and a response within max_seq_len)")
        self.capture = target_capture_layers(drafter.config.target_layer_ids, target.config.num_hidden_layers)
        # the target pass stops at the deepest layer the drafter reads (the later layers' work would be wasted),
        # unless distillation needs its final states
        self.last_layer = max(int(i) for i in drafter.config.target_layer_ids)
        if cfg.kd_weight > 0:
            self.last_layer = target.config.num_hidden_layers - 1
        self.gamma = cfg.loss_gamma if cfg.loss_gamma is not None else max(1.0, (drafter.block_size - 1) / 2)
        self.weights = offset_weights(drafter.block_size, self.gamma, self.device)
        self.optimizer = torch.optim.AdamW(param_groups(drafter, cfg), lr=cfg.lr, betas=cfg.betas,
                                           **({"fused": True} if self.device.type == "cuda" else {}))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, cfg))
        self.step = 0
        self._cache = None
        self._epoch: tuple[int, list[list[int]]] | None = None  # (epoch, its batches) when length-bucketed
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

    def global_batch(self, step: int) -> int:
        """This rank's batch of `step` in the one stream of batches all ranks share (= step with one process)."""
        return step * self.dist.world + self.dist.rank

    def batch_indices(self, step: int) -> list[int]:
        """The batch of the stream's index `step` (with several ranks: pass `global_batch(step)`)."""
        n, N = len(self.items), self.cfg.batch_size
        if self.cfg.length_buckets > 1:  # epoch s // batches-per-epoch, its batch s % batches-per-epoch
            per_epoch = math.ceil(n / N)
            per_epoch += -per_epoch % self.dist.world  # whole steps of all ranks: the ranks' pairs stay aligned
            epoch, b = divmod(step, per_epoch)
            if self._epoch is None or self._epoch[0] != epoch:
                lengths = [len(ids) for ids, _ in self.items]
                self._epoch = (epoch, epoch_batches(lengths, N, self.cfg.length_buckets, self.cfg.seed, epoch,
                                                    group=self.dist.world))
            return list(self._epoch[1][b % len(self._epoch[1])])  # the rounding up re-uses the first batches
        # random batches: one flat stream through the epochs' shuffles (a batch may straddle two epochs)
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
    def target_features(self, tokens: torch.Tensor, final: bool = False):
        """-> the drafter's context features [N, T, n*H]; with `final`, (features, the target's final-normed
        states [N, T, H]) (needs the full pass: kd_weight > 0)."""
        N, T = tokens.shape
        if self._cache is None or self._cache.batch_size != N or self._cache.max_seq_len < T:
            self._cache = self.target.new_cache(N, max(T, min(self.cfg.max_seq_len, 2 * T)))
        pos = torch.arange(T, device=tokens.device)[None].expand(N, T)
        out = self.target(tokens, pos, self._cache, kv_len=T, return_layers=self.capture,
                          last_layer=self.last_layer, is_causal=True)  # positions 0..T-1, kv_len T: as promised
        hidden, layers = out if self.capture else (out, [])
        feats = context_features(hidden, layers, self.drafter.config.target_layer_ids,
                                 self.target.config.num_hidden_layers)
        return (feats, hidden) if final else feats

    @torch.no_grad()
    def soft_targets(self, final_hidden: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """[N, A, B-1, V] fp32: the target's next-token distribution for each labelled block offset k = 1..B-1,
        i.e. its output at position anchor + k - 1 (clamped at the end: those offsets carry no label)."""
        N, T, H = final_hidden.shape
        offs = torch.arange(self.drafter.block_size - 1, device=anchors.device)
        pos = (anchors[:, :, None] + offs).clamp(max=T - 1)  # [N, A, B-1]
        h = final_hidden.gather(1, pos.flatten(1)[..., None].expand(-1, -1, H)).view(*pos.shape, H)
        return torch.softmax(self.target.lm_head(h).float(), dim=-1)

    def loss_on(self, tokens, lengths, anchors) -> tuple[torch.Tensor, dict]:
        kd = self.cfg.kd_weight
        feats, final = self.target_features(tokens, final=True) if kd > 0 else (self.target_features(tokens), None)
        labels = block_labels(tokens, lengths, anchors, self.drafter.block_size)
        with self._autocast():
            soft = self.soft_targets(final, anchors) if kd > 0 else None
            hidden = drafter_block_hidden(self.drafter, self.target.model.embed_tokens.weight, feats, tokens, anchors)
            return block_loss(self.drafter, self.target.lm_head, hidden, labels, self.weights, soft=soft,
                              kd_weight=kd)

    def train_step(self) -> StepResult:
        t0 = time.perf_counter()
        g = self.global_batch(self.step)
        rng = random.Random(f"{self.cfg.seed}/anchors/{g}")
        tokens, lengths, anchors = self.make_batch(self.batch_indices(g), rng)
        self.drafter.train()
        loss, m = self.loss_on(tokens, lengths, anchors)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.dist.average_grads(self.drafter.parameters())
        gnorm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        lr = max(g["lr"] for g in self.optimizer.param_groups)  # the full rate (grown layers' with a warm start)
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


def resume_trainer(target, sequences, path: str | Path, cfg: TrainConfig | None = None,
                   dist: Dist | None = None) -> DFlashTrainer:
    """A trainer continuing exactly from a checkpoint folder (its saved TrainConfig unless `cfg` is given)."""
    device = target.lm_head.weight.device
    drafter, state = load_checkpoint(path, device)
    if cfg is None:  # checkpoints saved before length buckets existed continue with their random batches
        cfg = TrainConfig(**{"length_buckets": 0, **state["train_config"]})
    trainer = DFlashTrainer(target, drafter, sequences, cfg, dist)
    trainer.load_state_dict(state)
    trainer.resumed_extra = state.get("extra") or {}
    return trainer

