"""Exceptions raised by the canary."""

from __future__ import annotations

from kvcanary.contract.errors import CanaryContractError

__all__ = ["CanaryContractError", "CanaryHealthError", "CanaryViolationError"]


class CanaryViolationError(RuntimeError):
    """Raise mode found violations; the message holds every new row's message. Raised once, from
    the call that detected them, so the engine can fail closed before publishing tokens."""


class CanaryHealthError(RuntimeError):
    """Raise mode: a launch tag stopped running (SPEC §9.1)."""
