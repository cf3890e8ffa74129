"""The detector core (SPEC §3-§9). Imports `kvcanary.contract`, never the engine.

The public names below are loaded on first access (PEP 562), not when a submodule is imported:
`kvcanary.canary.kernels` needs only numba, and the kernel-compile child processes
(`kernels.precompile`) would otherwise spend seconds importing torch through the runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcanary.canary.capacities import CanaryLaunchCapacities
    from kvcanary.canary.config import CanaryConfig, CanaryMode, PerturbConfig, RealDataMode
    from kvcanary.canary.errors import (
        CanaryContractError,
        CanaryHealthError,
        CanaryViolationError,
    )
    from kvcanary.canary.install import install
    from kvcanary.canary.perturb_seam import PerturbHooks, PerturbRecord
    from kvcanary.canary.runtime import Canary
    from kvcanary.canary.transfer import CanarySidecars

#: public name -> the submodule that defines it
_HOMES = {
    "Canary": "runtime",
    "CanaryConfig": "config",
    "CanaryContractError": "errors",
    "CanaryHealthError": "errors",
    "CanaryLaunchCapacities": "capacities",
    "CanaryMode": "config",
    "CanarySidecars": "transfer",
    "CanaryViolationError": "errors",
    "PerturbConfig": "config",
    "PerturbHooks": "perturb_seam",
    "PerturbRecord": "perturb_seam",
    "RealDataMode": "config",
    "install": "install",
}

__all__ = [
    "Canary",
    "CanaryConfig",
    "CanaryContractError",
    "CanaryHealthError",
    "CanaryLaunchCapacities",
    "CanaryMode",
    "CanarySidecars",
    "CanaryViolationError",
    "PerturbConfig",
    "PerturbHooks",
    "PerturbRecord",
    "RealDataMode",
    "install",
]
assert sorted(__all__) == sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
