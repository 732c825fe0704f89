"""Chain verification of one drafted block against one target pass.

Terms: the target pass over [last committed token, d_1 .. d_K] yields K+1 distributions p_1 .. p_{K+1}.
- accepted tokens: the longest prefix d_1 .. d_a the target keeps;
- recovered token: when d_{a+1} is rejected, a token drawn from the residual max(p - q, 0) (greedy: the argmax);
- bonus token: when all K are accepted, a token drawn from p_{K+1}.
Either way exactly one `next_token` follows the accepted prefix, so a step commits a + 1 tokens.

Greedy: accept while d_i == argmax p_i. Sampling: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), which
with the residual resampling makes the committed tokens distributed exactly as the target's own sampling
(Leviathan et al., Chen et al.). A drafter without a distribution (n-gram) is a point mass: q_i(d_i) = 1.

Everything stays on the device and branch-free: the verdict is two 0-dim tensors, read by the engine in its one
host sync per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.sampling import sample


@dataclass(frozen=True)
class ChainVerdict:
    num_accepted: torch.Tensor  # 0-dim long
    next_token: torch.Tensor  # 0-dim long


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    # accept [K] bool -> number of leading Trues (0-dim)
    return accept.long().cumprod(0).sum()


def verify_chain(
    draft_ids: torch.Tensor,  # [K] long
    target_logits: torch.Tensor,  # [K+1, V] fp32
    *,
    target_probs: torch.Tensor | None = None,  # [K+1, V] processed distribution; None = greedy
    draft_probs: torch.Tensor | None = None,  # [K, V] drafter's distribution; None = point mass at draft_ids
    generator: torch.Generator | None = None,
) -> ChainVerdict:
    K = draft_ids.shape[0]
    if target_probs is None:
        best = target_logits.argmax(-1)  # [K+1]
        a = _accepted_prefix(draft_ids == best[:K])
        return ChainVerdict(a, best[a])

    bonus = sample(target_probs[K], generator)
    if K == 0:
        return ChainVerdict(torch.zeros((), dtype=torch.long, device=bonus.device), bonus)
    idx = torch.arange(K, device=draft_ids.device)
    p_x = target_probs[idx, draft_ids]  # [K]
    q_x = draft_probs[idx, draft_ids] if draft_probs is not None else torch.ones_like(p_x)
    u = torch.rand(K, generator=generator, device=draft_ids.device)
    a = _accepted_prefix(u * q_x < p_x)  # P(accept) = min(1, p/q)
    j = a.clamp(max=K - 1)  # the first rejected position (meaningless, and unused, when a == K)
    p = target_probs[j]
    q = draft_probs[j] if draft_probs is not None else torch.nn.functional.one_hot(draft_ids[j], p.shape[-1]).to(p.dtype)
    residual = (p - q).clamp_min(0)
    total = residual.sum()
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p)  # total == 0 only if p == q
    recovered = sample(residual, generator)
    return ChainVerdict(a, torch.where(a == K, bonus, recovered))
