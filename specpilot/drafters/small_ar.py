"""A small AR model as drafter (e.g. Qwen2.5-Coder-0.5B drafting for -1.5B): any model with the target's tokenizer.

It keeps its own KV cache and the list of tokens that cache holds. Each step it finds the longest common prefix
of that list and the committed context, feeds only the tokens past it, then drafts K tokens one at a time.
Rejected drafts need no rollback: their slots are simply overwritten later (see models/cache.py).
"""

from __future__ import annotations

import torch

from specpilot.config import SamplingConfig
from specpilot.drafters.base import Draft
from specpilot.models import DenseLM
from specpilot.sampling import probs_from_logits, sample


class SmallARDrafter:
    name = "model"

    def __init__(self, model: DenseLM, max_seq_len: int, sampling: SamplingConfig, generator=None):
        self.model = model
        self.cache = model.new_cache(1, max_seq_len)
        self.sampling = sampling
        self.generator = generator
        self.device = model.lm_head.weight.device
        self.cached: list[int] = []  # tokens whose K/V the cache holds, in position order

    def reset(self) -> None:
        self.cached = []

    def _forward(self, ids: list[int], start: int) -> torch.Tensor:
        # ids at positions [start, start + len) -> logits of the last one [V]
        t = torch.tensor([ids], device=self.device)
        pos = torch.arange(start, start + len(ids), device=self.device)[None]
        hidden = self.model(t, pos, self.cache, kv_len=start + len(ids))
        return self.model.logits(hidden[:, -1])[0]

    @torch.inference_mode()
    def propose(self, context_ids: list[int], num_tokens: int) -> Draft:
        keep = 0
        limit = min(len(self.cached), len(context_ids) - 1)  # always re-feed at least the last context token
        while keep < limit and self.cached[keep] == context_ids[keep]:
            keep += 1
        new = context_ids[keep:]
        logits = self._forward(new, keep)
        self.cached = list(context_ids)
        tokens, dists = [], []
        for i in range(num_tokens):
            if self.sampling.greedy:
                tok = int(logits.argmax())
            else:
                probs = probs_from_logits(logits, self.sampling)
                tok = int(sample(probs, self.generator))
                dists.append(probs)
            tokens.append(tok)
            if i + 1 < num_tokens:
                logits = self._forward([tok], len(self.cached))
                self.cached.append(tok)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return Draft(ids, torch.stack(dists) if dists else None)
