"""Two byte-equal implementations of the canary kernels: `fast` (numba) and `reference`."""

from __future__ import annotations

from types import ModuleType

from kvcanary.canary.kernels import fast, reference

__all__ = ["KERNEL_IMPLEMENTATIONS", "fast", "reference"]

KERNEL_IMPLEMENTATIONS: dict[str, ModuleType] = {"fast": fast, "reference": reference}
