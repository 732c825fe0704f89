"""A model drafter (DFlash block or small AR) with prompt lookup beside it, choosing per step on the device.

Why: on the H200 loop (BENCHMARKS.md, session 11) prompt lookup alone drafted better than the DFlash drafter on
code prompts (dev x1.36) and worse elsewhere (held-out x0.70-0.78): it is right for long stretches where the output
copies the prompt, and has nothing or the wrong thing to say otherwise. Here the model drafts every step as usual
(a conditioned drafter stays in step with the context it has seen), and prompt lookup drafts beside it on the host.
The lookup's continuation is verified instead of the model's when

  * its suffix match is at least `min_match` tokens long (`EngineConfig.ngram_assist`), and
  * its first token equals the model's first drafted token (the two agree where the next token is concerned; the
    lookup then proposes how the copied stretch goes on).

The second test reads the model's draft, which is on the device: the choice is made there (`torch.where` over the
whole block), so it costs no host sync. A lookup shorter than the block is padded with the model's own later
tokens, so the block keeps its length (one verify bucket). Any draft is verified, so the output is the target's
either way; only tau changes. Greedy drafts only: a sampled model draft (with probabilities) is passed through.
"""

from __future__ import annotations

import torch

from specpilot.drafters.base import Draft
from specpilot.drafters.ngram import NgramDrafter


class NgramAssistedDrafter:
    """`long_tokens` > the engine's draft length: steps where the lookup has a match (known on the host before the
    model drafts) draft and verify that many tokens, the others the engine's usual number (`max_draft_tokens` tells
    the engine to allow it and to keep a verify bucket for it)."""

    def __init__(self, inner, lookup: NgramDrafter, min_match: int, short_tokens: int = 0, long_tokens: int = 0):
        self.inner, self.lookup, self.min_match = inner, lookup, min_match
        self.short_tokens = short_tokens
        self.max_draft_tokens = max(short_tokens, long_tokens) if short_tokens else None
        self.name = f"{inner.name}+ngram"
        # what the engine asks a drafter for (drafters/base.py): the inner drafter's conditioning, unchanged
        self.target_layers = getattr(inner, "target_layers", None)
        self.features = getattr(inner, "features", None)
        self.device = getattr(inner, "device", torch.device("cpu"))
        self._host = self._dev = None  # lookup tokens: a pinned host buffer, copied without a sync
        self._copied = None  # CUDA event after the last copy out of the pinned buffer

    def __getattr__(self, name):  # the rest (a DFlash `network`, a small model's `runner`, ...) is the inner one's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def reset(self) -> None:
        self.inner.reset()

    def observe(self, features) -> None:
        self.inner.observe(features)

    def _to_device(self, tokens: list[int]) -> torch.Tensor:
        n = len(tokens)
        if self._host is None or self._host.shape[0] < n:
            cuda = torch.device(self.device).type == "cuda"
            self._host = torch.zeros(max(n, 16), dtype=torch.long, pin_memory=cuda)
            self._dev = torch.zeros(max(n, 16), dtype=torch.long, device=self.device)
            self._copied = None
        if self._copied is not None:  # the previous copy has left the pinned buffer (free in the engine: it synced)
            self._copied.synchronize()
        self._host[:n] = torch.tensor(tokens, dtype=torch.long)
        self._dev[:n].copy_(self._host[:n], non_blocking=True)
        if self._dev.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self._dev[:n]

    def propose(self, context_ids: list[int], num_tokens: int) -> Draft:
        if self.short_tokens:  # the lookup decides the block's length: it runs before the model drafts
            follow, n = self.lookup.lookup(context_ids, num_tokens)
            match = n >= self.min_match and bool(follow)
            if not match:  # no copy in sight: the usual short block
                num_tokens = min(num_tokens, self.short_tokens)
            draft = self.inner.propose(context_ids, num_tokens)
        else:  # the model's pass is queued first, so the host's lookup runs while the GPU drafts (same drafts)
            draft = self.inner.propose(context_ids, num_tokens)
            follow, n = self.lookup.lookup(context_ids, num_tokens)
            match = n >= self.min_match and bool(follow)
        before, after = getattr(self.inner, "last_eager_launches", (0, 0))
        model = draft.token_ids
        K = model.shape[0]
        if K == 0 or draft.probs is not None or not match:
            self.last_eager_launches = (before, after)
            return draft
        follow = follow[:K]
        look = self._to_device(follow)
        cand = look if len(follow) == K else torch.cat((look, model[len(follow):]))
        # launched after the model's pass (drafters/timing.py prices them): the lookup's host-to-device copy, the
        # padding cat when it is shorter than the block, the agreement test and the choice
        self.last_eager_launches = (before, after + 3 + (len(follow) < K))
        return Draft(torch.where(self._agree(look, model), cand, model))

    @staticmethod
    def _agree(look: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
        """0-dim bool on the device: the lookup stands in (its first token is the model's first)."""
        return look[0] == model[0]
