"""Verification: which drafted tokens the target accepts, and the token it commits after them."""

from specpilot.verify.chain import ChainVerdict, greedy_verdict_packed, verify_chain

__all__ = ["ChainVerdict", "greedy_verdict_packed", "verify_chain"]
