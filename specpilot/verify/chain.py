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
host sync per step. For greedy decoding the engine takes the verdict packed with the block's drafts
(`greedy_verdict_packed`): the target runner computes it inside the verify step itself (on CUDA, inside the
step's captured graph), so accepting costs no extra kernel launches and committing reads one small tensor.
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


def _at(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    # x[i] for a 0-dim long index on the device. Not `x[i]`: PyTorch indexes with a 0-dim integer tensor through
    # `i.item()`, a host sync (which a CUDA graph capture refuses); index_select reads i on the device.
    return x.index_select(0, i.view(1))[0]


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
        return ChainVerdict(a, _at(best, a))

    bonus = sample(target_probs[K], generator)
    if K == 0:
        return ChainVerdict(torch.zeros((), dtype=torch.long, device=bonus.device), bonus)
    idx = torch.arange(K, device=draft_ids.device)
    p_x = target_probs[idx, draft_ids]  # [K]
    q_x = draft_probs[idx, draft_ids] if draft_probs is not None else torch.ones_like(p_x)
    u = torch.rand(K, generator=generator, device=draft_ids.device)
    a = _accepted_prefix(u * q_x < p_x)  # P(accept) = min(1, p/q)
    j = a.clamp(max=K - 1)  # the first rejected position (meaningless, and unused, when a == K)
    p = _at(target_probs, j)
    if draft_probs is not None:
        q = _at(draft_probs, j)
    else:  # the point mass at d_j (not F.one_hot, which checks its input's range on the host: a sync)
        q = (torch.arange(p.shape[-1], device=p.device) == _at(draft_ids, j)).to(p.dtype)
    residual = (p - q).clamp_min(0)
    total = residual.sum()
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p)  # total == 0 only if p == q
    recovered = sample(residual, generator)
    return ChainVerdict(a, torch.where(a == K, bonus, recovered))


def greedy_verdict_packed(block: torch.Tensor, target_logits: torch.Tensor,
                          num_drafts: torch.Tensor | None = None) -> torch.Tensor:
    """The greedy verdict of one verify block, packed for the engine's single read:
    block [T] = [last committed token, d_1 .. d_{T-1}], target_logits [T, V] -> [T + 1] long
    = [num_accepted, next_token, d_1 .. d_{T-1}] (the rule itself is `verify_chain`'s).

    `num_drafts` (a 1-element long tensor on the device) marks a padded block, as a captured step runs it: only
    d_1 .. d_{num_drafts} are real drafts, the rest are junk tokens that must never be accepted; they are
    replaced by -1 (never an argmax) in the verdict and the output. Static shapes, no host sync: graph-safe.
    """
    drafts = block[1:]
    if num_drafts is not None:
        real = torch.arange(drafts.shape[0], device=drafts.device) < num_drafts
        drafts = torch.where(real, drafts, torch.full_like(drafts, -1))
    v = verify_chain(drafts, target_logits)
    return torch.cat([v.num_accepted.view(1), v.next_token.view(1), drafts])
