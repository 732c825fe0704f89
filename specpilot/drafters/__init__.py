"""Drafters behind one interface (`base.Drafter`): small AR model, n-gram prompt lookup."""

from specpilot.drafters.base import Draft, Drafter
from specpilot.drafters.ngram import NgramDrafter
from specpilot.drafters.small_ar import SmallARDrafter

__all__ = ["Draft", "Drafter", "NgramDrafter", "SmallARDrafter"]
