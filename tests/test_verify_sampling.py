"""Chain verification: exact greedy cases, and losslessness of rejection sampling on a small vocabulary."""

import pytest
import torch

from specpilot.config import SamplingConfig
from specpilot.sampling import probs_from_logits
from specpilot.verify import verify_chain


def _logits_with_argmax(seq, V=8):
    logits = torch.zeros(len(seq), V)
    logits[torch.arange(len(seq)), torch.tensor(seq)] = 5.0
    return logits


@pytest.mark.parametrize(
    "draft,target_argmax,accepted,next_tok",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, 4),  # all accepted, bonus token
        ([1, 2, 3], [1, 5, 3, 4], 1, 5),  # second rejected: recovered = target's argmax
        ([1, 2, 3], [0, 2, 3, 4], 0, 0),  # first rejected
        ([], [6], 0, 6),  # nothing drafted: plain decode step
    ],
)
def test_greedy_cases(draft, target_argmax, accepted, next_tok):
    v = verify_chain(torch.tensor(draft, dtype=torch.long), _logits_with_argmax(target_argmax))
    assert (int(v.num_accepted), int(v.next_token)) == (accepted, next_tok)


def _committed_first_token_freq(p, q, n=60000, point_mass=False):
    """Sample the first committed token of a 1-token draft many times; return its empirical distribution."""
    g = torch.Generator().manual_seed(0)
    V = p.shape[-1]
    counts = torch.zeros(V)
    target_probs = torch.stack([p, p])  # [K+1, V]
    for _ in range(n):
        d = torch.multinomial(q, 1, generator=g)  # the drafter's draw
        v = verify_chain(
            d, torch.zeros(2, V), target_probs=target_probs, draft_probs=None if point_mass else q[None], generator=g
        )
        counts[int(d[0]) if int(v.num_accepted) == 1 else int(v.next_token)] += 1
    return counts / n


def test_rejection_sampling_is_lossless():
    """Committed tokens follow the target distribution p, whatever the drafter's q (chi-square-ish bound)."""
    p = torch.tensor([0.05, 0.40, 0.25, 0.10, 0.20])
    q = torch.tensor([0.30, 0.10, 0.30, 0.20, 0.10])
    freq = _committed_first_token_freq(p, q)
    assert (freq - p).abs().max() < 0.01
    # and the test can fail: committing drafts unverified would give q, not p
    assert (q - p).abs().max() > 0.1


def test_point_mass_drafter_is_lossless():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.0, 0.0, 1.0])  # an n-gram drafter that always proposes token 2
    freq = _committed_first_token_freq(p, q, n=40000, point_mass=True)
    assert (freq - p).abs().max() < 0.01


def test_top_k_top_p_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and p[0, :2].sum().item() == pytest.approx(1.0)
    full = logits.softmax(-1)[0]
    p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=float(full[0]) + 1e-3))
    assert (p[0] > 0).tolist() == [True, True, False, False, False]
    g = probs_from_logits(logits, SamplingConfig())
    assert g[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
