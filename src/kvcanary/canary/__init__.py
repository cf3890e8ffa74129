"""The detector core (SPEC §3-§9). Imports `kvcanary.contract`, never the engine."""

from kvcanary.canary.capacities import CanaryLaunchCapacities
from kvcanary.canary.config import CanaryConfig, CanaryMode, PerturbConfig, RealDataMode
from kvcanary.canary.errors import CanaryContractError, CanaryHealthError, CanaryViolationError
from kvcanary.canary.install import install
from kvcanary.canary.perturb_seam import PerturbHooks, PerturbRecord
from kvcanary.canary.runtime import Canary
from kvcanary.canary.transfer import CanarySidecars

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
