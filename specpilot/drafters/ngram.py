"""Prompt lookup: a training-free drafter that copies what followed the last occurrence of the context's suffix.

For n from `ngram_max` down to `ngram_min`, find the most recent earlier occurrence of the context's last n tokens
and propose the tokens that followed it (up to a whole block). Code and chat answers quote their prompts often,
which is what makes this cheap drafter useful. It has no distribution: its tokens are point masses.
"""

from __future__ import annotations

import torch

from specpilot.drafters.base import Draft


class NgramDrafter:
    name = "ngram"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1, device="cpu"):
        self.ngram_max, self.ngram_min, self.device = ngram_max, ngram_min, device

    def reset(self) -> None:
        pass

    def propose(self, context_ids: list[int], num_tokens: int) -> Draft:
        n_ctx = len(context_ids)
        for n in range(min(self.ngram_max, n_ctx - 1), self.ngram_min - 1, -1):
            suffix = context_ids[n_ctx - n:]
            # scan right to left: the most recent match predicts best
            for start in range(n_ctx - n - 1, -1, -1):
                if context_ids[start:start + n] == suffix:
                    follow = context_ids[start + n:start + n + num_tokens]
                    if follow:
                        return Draft(torch.tensor(follow, dtype=torch.long, device=self.device))
        return Draft(torch.empty(0, dtype=torch.long, device=self.device))
