"""Two byte-equal implementations of the canary kernels: `fast` (numba) and `reference`."""

from __future__ import annotations

from types import ModuleType

from kvcanary.canary.kernels import compile_cache

compile_cache.configure()  # before any @njit(cache=True) runs: the cache folder is fixed then

from kvcanary.canary.kernels import fast, reference  # noqa: E402

__all__ = ["KERNEL_IMPLEMENTATIONS", "fast", "reference"]

KERNEL_IMPLEMENTATIONS: dict[str, ModuleType] = {"fast": fast, "reference": reference}
