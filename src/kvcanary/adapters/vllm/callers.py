"""Find the vLLM object whose method is calling into the connector.

vLLM hands a connector some of its parts (the KV caches, the scheduler's cache manager) but not
the object that owns them, whose per-step state the canary must read or act in: the model
runner whose persistent batch describes each forward, the scheduler whose update drops a
failing step's tokens. Both are on the call stack when vLLM binds the connector, as `self` of a
caller frame. This is read once, at binding time, never per step.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["calling_instance"]


def calling_instance(cls: type) -> Any:
    """The nearest caller's `self` that is an instance of `cls` (None when no caller is)."""
    frame = sys._getframe(2)  # skip this function and the adapter function asking
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, cls):
            return candidate
        frame = frame.f_back  # type: ignore[assignment]
    return None
