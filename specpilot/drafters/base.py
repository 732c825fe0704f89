"""The drafter interface: propose a block of tokens that continue a context.

A drafter is told the whole committed context each step and works out itself what it has already seen (its own
cache), so the engine never has to tell it how many tokens were accepted. Implementations: `small_ar` (a small
AR model with the target's tokenizer) and `ngram` (training-free prompt lookup).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Draft:
    token_ids: torch.Tensor  # [K] long, K may be 0 (nothing to propose)
    probs: torch.Tensor | None = None  # [K, V] the distribution each token was drawn from; None = point mass


class Drafter(Protocol):
    name: str
    # decoder layers of the target whose outputs this drafter conditions on (None: not conditioned). When set,
    # the engine calls `observe(features)` for every newly committed token but the last (prefill, then each
    # step's accepted tokens), in position order; features are `features(final_hidden, layer_outputs)` if the
    # drafter defines it, else the layer outputs concatenated ([n, len(layers) * H]).
    target_layers: tuple[int, ...] | None = None

    def reset(self) -> None:
        """Forget all state (a new prompt follows)."""

    def observe(self, features) -> None:
        """Target hidden features of newly committed tokens (only called when `target_layers` is non-empty)."""

    def propose(self, context_ids: list[int], num_tokens: int) -> Draft:
        """Draft up to `num_tokens` tokens continuing `context_ids` (prompt + everything committed so far)."""
