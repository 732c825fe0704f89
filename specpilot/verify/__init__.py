"""Verification: which drafted tokens the target accepts, and the token it commits after them."""

from specpilot.verify.chain import ChainVerdict, verify_chain

__all__ = ["ChainVerdict", "verify_chain"]
