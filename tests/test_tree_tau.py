"""scripts/tree_tau.py's pure parts: candidate ranks, tree acceptance (chain / top-b / budgeted), node counts."""

import importlib.util
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location("tree_tau", Path(__file__).resolve().parent.parent / "scripts" / "tree_tau.py")
tt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tt)

# draft logits of 4 positions over a 5-token vocabulary
LOGITS = torch.tensor([
    [5.0, 4.0, 3.0, 2.0, 1.0],  # ranks: 0 1 2 3 4
    [1.0, 2.0, 9.0, 3.0, 0.0],  # token 2 first, 3 second, 1 third
    [0.0, 7.0, 7.0, 1.0, 6.0],  # tie: 1 before 2 (argmax picks the lower id), then 4
    [3.0, 0.0, 0.0, 0.0, 8.0],  # 4, then 0, then 1
])


def test_target_ranks():
    assert tt.target_ranks(LOGITS, [0, 3, 2, 1]) == [0, 1, 1, 2]
    assert tt.target_ranks(LOGITS, [4, 2, 1, None]) == [4, 0, 0, None]
    for row in LOGITS:  # rank 0 is exactly the argmax (the chain's draft token)
        assert tt.target_ranks(row[None], [int(row.argmax())]) == [0]


@pytest.mark.parametrize("variant,targets,want", [
    ("chain", [0, 2, 1, 4], 4),       # the argmax everywhere: all accepted
    ("chain", [0, 3, 1, 4], 1),       # second position's target ranks 1: stops there
    ("chain", [1, 2, 1, 4], 0),
    ("top2", [1, 3, 2, 0], 4),        # all rank 1
    ("top2", [1, 3, 4, 0], 2),        # third ranks 2
    ("top3", [1, 3, 4, 1], 4),        # ranks 1 1 2 2
    ("top3", [3, 2, 1, 4], 0),        # rank 3 at the first position
    ("top2x2", [1, 3, 1, 4], 4),      # ranks 1 1 then top-1
    ("top2x2", [1, 3, 2, 4], 2),      # third position is top-1 only, its target ranks 1
    ("top2x1", [1, 3, 1, 4], 1),
    ("top2x4", [1, 3, 2, 0], 4),
    ("chain", [0, 2, None, 4], 2),    # past the known output: rejected
])
def test_accepted_length(variant, targets, want):
    ranks = tt.target_ranks(LOGITS, targets)
    assert tt.accepted_length(ranks, tt.widths(variant, len(targets))) == want


@pytest.mark.parametrize("variant,k,want_widths,want_nodes", [
    ("chain", 15, [1] * 15, 15),
    ("top2", 3, [2, 2, 2], 2 + 4 + 8),
    ("top3", 2, [3, 3], 3 + 9),
    ("top2x2", 5, [2, 2, 1, 1, 1], 2 + 4 * 4),
    ("top2x4", 15, [2] * 4 + [1] * 11, 2 + 4 + 8 + 16 * 12),
    ("top2x4", 2, [2, 2], 6),          # a short block at the end of a run
    ("top2", 15, [2] * 15, 2 ** 16 - 2),
])
def test_widths_and_nodes(variant, k, want_widths, want_nodes):
    assert tt.widths(variant, k) == want_widths
    assert tt.tree_nodes(want_widths) == want_nodes


def test_bad_variant():
    with pytest.raises(ValueError):
        tt.parse_variant("top0")
    with pytest.raises(ValueError):
        tt.parse_variant("beam2")


def test_acceptance_by_position():
    # drafted 3 / accepted 1: positions 0 (accepted) and 1 (rejected) reached; drafted 3 / accepted 3: all three
    assert tt.acceptance_by_position([3, 3], [1, 3]) == [1.0, 0.5, 1.0]
