"""DFlash as a drafter: one forward of a small block-diffusion network drafts a whole block.

The network (`models/dflash.py`, z-lab's checkpoint format) conditions on hidden states of chosen target layers.
The engine hands them over through `observe()` for every committed token but the last (see drafters/base.py), in
position order; this drafter buffers them until the next `propose()`, writes them into its own context K/V cache
once (slot p = position p, so rejected drafts need no rollback), and drafts [anchor, mask, ...] in one pass, the
anchor being the last committed token. Drafts are greedy; under sampling they count as point masses, which keeps
verification lossless.

Static steps (`static=True`, and as a CUDA graph with `cuda_graphs=True` on a GPU): after the first step, a step
feeds at most block_size new context positions, so the context is padded to block_size rows and the block attends
over the whole draft cache (static shapes). Padding rows are written at positions >= the anchor, which the
draft mask hides (it shows only slots below the anchor) and which real context overwrites before any later
anchor passes them. Why: eagerly the draft pass is host-bound (~12 ms of a 15 ms step on the H200, BENCHMARKS.md).
The first step (the whole prompt) runs eagerly. Asked for fewer than block_size - 1 tokens, the static step drafts the
whole block and returns its first tokens (the eager step, like z-lab's loop, drafts a shorter block instead: the
block's attention is non-causal, so the two can differ; both are verified, so outputs cannot).

With the attention kernel (`DFlashDrafter.use_attention_kernel`, the engine's CUDA default) the block's own K/V go
to slots anchor .. anchor+B-1 as well, written after the context in each layer, so they replace the padding rows
there; a later step's context overwrites them in turn before its anchor passes them. The cache's block_size spare
slots past max_seq_len hold a block at the last anchor (and the graph's capture-time positions).

Host timing (read by drafters/timing.py for `specpilot profile`; always kept, one perf_counter a pass): on CUDA the
draft stage starts with the GPU idle (the step before ended in its host sync), so the device waits for the host
until the graph replay is launched. `last_launch_t` is when the last pass was launched (perf_counter just before
the replay, the eager static step or the eager pass), `last_pass` which one, `last_eager_launches` the (before,
after) counts of device launches outside the pass: before the replay the pending context's cat, its copy into
the static buffer and the scalars' host-to-device copy (3; their device time hides under the host's way to the
replay), after it the drafts' clone (1, queued behind the graph). `graph_events` (None: off) collects CUDA event
pairs around each replay: the graph's own device time, measured.

Early launch (`launch_early`, EngineConfig.early_draft; engine/spec.py): right after a verify step, before
the host has read its verdict, the next block's static pass is launched from the device: the verify block's
features (all K+1 rows) go into the context buffer and the scalars are derived from the packed verdict [a, next]
on the device (anchor id = next, c = a + 1 new context rows, anchor position = fed + a + 1). Rows past c are
rejected drafts' features: they sit at padding positions (>= the anchor), like the stale rows a normal step leaves
there. The engine then reports how many rows were committed (`took_early`) instead of calling `observe`, and the
next `propose` returns these drafts without launching anything: the same tokens as the normal step.
"""

from __future__ import annotations

import time

import torch

from specpilot.drafters.base import Draft
from specpilot.engine.graphs import capture, or_eager
from specpilot.engine.runner import padded_length
from specpilot.models.dflash import DFlashDrafter, _target_io, context_features, draft_block, target_capture_layers


class DFlashBlockDrafter:
    name = "dflash"

    def __init__(self, network: DFlashDrafter, target, max_seq_len: int, *, static: bool = False,
                 cuda_graphs: bool = False):
        self.network, self.target = network, target
        self.num_target_layers = target.config.num_hidden_layers
        self.layer_ids = tuple(network.config.target_layer_ids)
        self.target_layers = target_capture_layers(self.layer_ids, self.num_target_layers)
        self.cache = network.new_cache(1, max_seq_len + network.block_size)
        self.device = network.fc.weight.device
        # eager passes (the first, over the whole prompt) padded to a few context lengths on CUDA (engine/runner.py
        # `padded_length`; EngineConfig.pad_shapes, set by build_drafter)
        self.pad_shapes = self.device.type == "cuda"
        self.graph = None
        self.last_launch_t, self.last_pass, self.last_eager_launches = 0.0, "", (0, 0)  # see the module docstring
        self.last_eager_pass_s = 0.0  # host seconds spent launching the last eager pass (0 for a static one)
        self.graph_events: list | None = None
        self.static = static or (cuda_graphs and self.device.type == "cuda")
        # a static (graphed) pass takes at most a block of new context tokens: the engine ends a run of plain steps
        # (EngineConfig.adaptive) before more pile up (more would take the slower eager pass, still correct)
        self.max_catch_up = network.block_size if self.static else None
        if self.static:
            self._init_static(max_seq_len)
            if cuda_graphs and self.device.type == "cuda":
                self.graph, self.drafts = or_eager(self._capture, "DFlash draft step") or (None, None)
        self.reset()

    # -- the static step: fixed-size buffers in, drafts out (the same code is eager, or captured) --

    def _init_static(self, max_seq_len: int) -> None:
        B, dev = self.network.block_size, self.device
        self.base = torch.arange(B, device=dev)
        self.masks = torch.full((1, B - 1), self.network.mask_token_id, dtype=torch.long, device=dev)
        self.ctx = torch.zeros(1, B, self.network.fc.in_features, dtype=self.network.fc.weight.dtype, device=dev)
        # the step's scalars [anchor id, fed, new context rows c, anchor position], written with one copy per step
        # (the positions are derived from them inside the step: in its graph, not as ~8 eager launches, which were
        # most of propose()'s 0.26 ms of host time on the H200, session 10). Start: the spare tail slots, harmless.
        self.scalars = torch.tensor([0, max_seq_len, 0, max_seq_len], dtype=torch.long, device=dev)
        self._scalars_host = torch.zeros(4, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._copied = None  # a CUDA event after the last copy out of the pinned buffer
        self.drafts = None
        # early launch: scalars += verdict[[1, 0, 0, 0]] * [1, 0, 1, 1] (the host wrote [0, fed, 1, fed + 1])
        self._pick = torch.tensor([1, 0, 0, 0], device=dev)
        self._mult = torch.tensor([1, 0, 1, 1], device=dev)

    def _static_step(self) -> torch.Tensor:
        embed_w, lm_head = _target_io(self.target)
        anchor_id, fed, c, anchor_pos = self.scalars.unbind()
        # rows [0, c): the new context at fed..anchor-1; rows [c, B): padding at anchor..anchor+B-c-1 (the offset
        # chosen first, then one add: 4 launches, not 5)
        pos_ctx = (self.base + torch.where(self.base < c, fed, anchor_pos - c))[None]
        pos_blk = (self.base + anchor_pos)[None]
        ids = torch.cat((anchor_id.view(1, 1), self.masks), dim=1)
        hidden = self.network(self.network.embed(ids, embed_w), self.network.project_context(self.ctx), pos_ctx,
                              pos_blk, self.cache, kv_len=None)
        return self.network.compute_logits(hidden[:, 1:], lm_head).argmax(dim=-1)[0]

    @torch.inference_mode()
    def _capture(self):
        return capture(self._static_step)

    def _write_scalars(self, values: tuple[int, int, int, int]) -> None:
        """The static step's scalars from the host: one non-blocking copy out of a pinned buffer."""
        host = self._scalars_host
        if self._copied is not None:  # the last copy out of the pinned buffer has run before it is rewritten
            self._copied.synchronize()  # (in the engine it has: the step synced since; this costs nothing then)
        host[0], host[1], host[2], host[3] = values
        self.scalars.copy_(host, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _propose_static(self, anchor_id: int, ctx: torch.Tensor, anchor_pos: int) -> torch.Tensor:
        c = ctx.shape[0]
        self.ctx[0, :c].copy_(ctx)
        self._write_scalars((anchor_id, self.fed, c, anchor_pos))
        return self._run_static()

    def _run_static(self) -> torch.Tensor:
        if self.graph is not None:
            timed = self.graph_events is not None
            if timed:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            self.last_launch_t, self.last_pass = time.perf_counter(), "graph"
            self.graph.replay()
            if timed:
                end.record()
                self.graph_events.append((start, end))
            self.last_eager_launches = (3, 1)  # cat, copy, scalars' copy; the clone
            return self.drafts.clone()
        self.last_launch_t, self.last_pass = time.perf_counter(), "static"
        self.last_eager_launches = (3, 0)
        return self._static_step()

    def reset(self) -> None:
        self.fed = 0  # context positions [0, fed) are in the draft cache
        self.pending: list[torch.Tensor] = []
        self._early: torch.Tensor | None = None  # drafts of an early launch (launch_early), not yet proposed
        self._early_rows: int | None = None  # its committed context rows (took_early), once the host knows them

    def launch_early(self, verdict: torch.Tensor, features: torch.Tensor) -> bool:
        """Launch the next block's pass now, from the verify step's packed verdict [a, next, ...] and its
        features [K+1, F] (both on the device, not yet read by the host; see the module docstring). -> whether it
        was launched: only the static step can (no pending context, at most a block of rows, after the first pass)."""
        if not self.static or self.pending or self.fed == 0 or self._early is not None:
            return False
        rows = features.shape[0]
        if rows > self.network.block_size:
            return False
        self.ctx[0, :rows].copy_(features)
        self._write_scalars((0, self.fed, 1, self.fed + 1))
        self.scalars.add_(verdict[self._pick] * self._mult)
        self._early = self._run_static()
        return True

    def took_early(self, committed: int) -> None:
        """The engine's word, after its sync, for `observe`: `committed` (a + 1) of the early pass's context rows
        were committed; the next propose() returns that pass's drafts."""
        if self._early is None:
            raise RuntimeError("took_early without an early launch")
        self._early_rows = committed

    def features(self, hidden: torch.Tensor, layers: list[torch.Tensor]) -> torch.Tensor:
        """What the target runner keeps per token: the reference's context features [B, T, n*H]."""
        return context_features(hidden, layers, self.layer_ids, self.num_target_layers)

    def observe(self, features: torch.Tensor) -> None:
        self.pending.append(features)

    def _pending_context(self, context_ids: list[int]) -> tuple[int, torch.Tensor]:
        anchor_pos = len(context_ids) - 1
        ctx = torch.cat(self.pending) if self.pending else self.network.fc.weight.new_zeros(0, self.network.fc.in_features)
        if self.fed + ctx.shape[0] != anchor_pos:
            raise RuntimeError(f"DFlash context out of step: {self.fed} fed + {ctx.shape[0]} new != {anchor_pos}")
        return anchor_pos, ctx

    @torch.inference_mode()
    def propose(self, context_ids: list[int], num_tokens: int) -> Draft:
        return Draft(self._draft(context_ids, num_tokens, return_logits=False).to(torch.long))

    @torch.inference_mode()
    def propose_logits(self, context_ids: list[int], num_tokens: int) -> torch.Tensor:
        """`propose`'s eager step, returning the draft logits [k, V] instead of their argmax (analysis:
        scripts/tree_tau.py ranks each position's candidates). Same bookkeeping as `propose`."""
        return self._draft(context_ids, num_tokens, return_logits=True)

    def _draft(self, context_ids: list[int], num_tokens: int, return_logits: bool) -> torch.Tensor:
        """The block at the last committed token -> its tokens [k] (the static graphed step where it applies) or,
        with return_logits, the eager step's logits [k, V]; the pending context counts as fed afterwards."""
        k = min(num_tokens, self.network.block_size - 1)
        self.last_eager_pass_s = 0.0
        if self._early is not None:  # launched after the last verify step: its drafts, nothing to launch now
            anchor_pos = len(context_ids) - 1
            if return_logits:  # (scripts/tree_tau.py runs without early launches)
                raise RuntimeError("propose_logits after an early launch: its pass kept only the tokens")
            if self._early_rows is None or self.pending or self.fed + self._early_rows != anchor_pos:
                raise RuntimeError(f"DFlash early draft out of step: {self.fed} fed + {self._early_rows} rows != "
                                   f"{anchor_pos}")
            out, self._early, self._early_rows = self._early, None, None
            self.fed, self.last_pass = anchor_pos, "early"
            return out[:k]
        anchor_pos, ctx = self._pending_context(context_ids)
        if not return_logits and self.static and self.fed > 0 and 0 < ctx.shape[0] <= self.network.block_size:
            out = self._propose_static(context_ids[-1], ctx, anchor_pos)[:k]
        else:
            C = ctx.shape[0]
            pad_to = padded_length(C, self.cache.max_seq_len - (anchor_pos - C)) if self.pad_shapes and C else None
            self.last_launch_t, self.last_pass, self.last_eager_launches = time.perf_counter(), "eager", (1, 0)
            out = draft_block(self.network, self.target, context_ids[-1], ctx, anchor_pos=anchor_pos,
                              cache=self.cache, num_tokens=k, return_logits=return_logits, pad_to=pad_to)
            self.last_eager_pass_s = time.perf_counter() - self.last_launch_t  # launch-bound: ~its device time
        self.fed, self.pending = anchor_pos, []
        return out
