"""Token sampling: logits -> a processed distribution -> a token. Greedy is always the argmax.

`probs_from_logits` applies temperature, top-k and top-p in that order; the same function shapes both the
drafter's and the target's distributions, so lossless verification compares like with like.
"""

from __future__ import annotations

import torch

from specpilot.config import SamplingConfig


def probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits [..., V] -> probs [..., V] fp32. For greedy, a one-hot at the argmax."""
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= cfg.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [..., V] -> ids [...] (one draw per row)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def next_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """logits [..., V] -> ids [...]: argmax when greedy, else a draw from the processed distribution."""
    if cfg.greedy:
        return logits.argmax(-1)
    return sample(probs_from_logits(logits, cfg), generator)
