"""Errors shared by every side of the contract."""

from __future__ import annotations

__all__ = ["CanaryContractError"]


class CanaryContractError(ValueError):
    """An engine broke the contract: a malformed ForwardView, a phase-order error or a capacity
    overrun that a correctly sized install can never reach. Raised in every canary mode."""
