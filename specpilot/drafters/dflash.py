"""DFlash as a drafter: one forward of a small block-diffusion network drafts a whole block.

The network (`models/dflash.py`, z-lab's checkpoint format) conditions on hidden states of chosen target layers.
The engine hands them over through `observe()` for every committed token but the last (see drafters/base.py), in
position order; this drafter buffers them until the next `propose()`, writes them into its own context K/V cache
once (slot p = position p, so rejected drafts need no rollback), and drafts [anchor, mask, ...] in one pass, the
anchor being the last committed token. Drafts are greedy; under sampling they count as point masses, which keeps
verification lossless.
"""

from __future__ import annotations

import torch

from specpilot.drafters.base import Draft
from specpilot.models.dflash import DFlashDrafter, context_features, draft_block, target_capture_layers


class DFlashBlockDrafter:
    name = "dflash"

    def __init__(self, network: DFlashDrafter, target, max_seq_len: int):
        self.network, self.target = network, target
        self.num_target_layers = target.config.num_hidden_layers
        self.layer_ids = tuple(network.config.target_layer_ids)
        self.target_layers = target_capture_layers(self.layer_ids, self.num_target_layers)
        self.cache = network.new_cache(1, max_seq_len + network.block_size)
        self.device = network.fc.weight.device
        self.reset()

    def reset(self) -> None:
        self.fed = 0  # context positions [0, fed) are in the draft cache
        self.pending: list[torch.Tensor] = []

    def features(self, hidden: torch.Tensor, layers: list[torch.Tensor]) -> torch.Tensor:
        """What the target runner keeps per token: the reference's context features [B, T, n*H]."""
        return context_features(hidden, layers, self.layer_ids, self.num_target_layers)

    def observe(self, features: torch.Tensor) -> None:
        self.pending.append(features)

    @torch.inference_mode()
    def propose(self, context_ids: list[int], num_tokens: int) -> Draft:
        anchor_pos = len(context_ids) - 1
        ctx = torch.cat(self.pending) if self.pending else self.network.fc.weight.new_zeros(0, self.network.fc.in_features)
        if self.fed + ctx.shape[0] != anchor_pos:
            raise RuntimeError(f"DFlash context out of step: {self.fed} fed + {ctx.shape[0]} new != {anchor_pos}")
        k = min(num_tokens, self.network.block_size - 1)
        tokens = draft_block(self.network, self.target, context_ids[-1], ctx, anchor_pos=anchor_pos,
                             cache=self.cache, num_tokens=k)
        self.fed, self.pending = anchor_pos, []
        return Draft(tokens.to(torch.long))
