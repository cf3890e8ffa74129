"""`install`: the one way to attach a canary to a KV pool (SPEC §2.1)."""

from __future__ import annotations

from collections.abc import Sequence

from kvcanary.canary.capacities import CanaryLaunchCapacities
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.perturb_seam import PerturbHooks
from kvcanary.canary.runtime import Canary
from kvcanary.contract.groups import BufferGroupSpec
from kvcanary.contract.oracle import TokenOracle

__all__ = ["install"]


def install(
    config: CanaryConfig,
    groups: Sequence[BufferGroupSpec],
    capacities: CanaryLaunchCapacities,
    token_oracle: TokenOracle | None = None,
    *,
    kernels: str = "fast",
    perturb: PerturbHooks | None = None,
) -> Canary | None:
    """A Canary with zeroed buffers for one KV pool, or None in mode `none`.

    Call once per pool (target and draft pools separately). `kernels` picks `fast` (numba) or
    `reference` (plain Python, for tests).
    """
    if not config.enabled:
        return None
    return Canary(
        config, groups, capacities, token_oracle=token_oracle, kernels=kernels, perturb=perturb
    )
