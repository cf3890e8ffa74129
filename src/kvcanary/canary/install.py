"""`install`: the one way to attach a canary to a KV pool (SPEC §2.1)."""

from __future__ import annotations

from collections.abc import Sequence

from kvcanary.canary.capacities import CanaryLaunchCapacities
from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.perturb.perturber import Perturber
from kvcanary.canary.perturb_seam import BindsCanary, PerturbHooks
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
    parallel_launches: bool = True,
) -> Canary | None:
    """A Canary with zeroed buffers for one KV pool, or None in mode `none`.

    Call once per pool (target and draft pools separately). `kernels` picks `fast` (numba) or
    `reference` (plain Python, for tests). Fault injection: when `perturb` is None and some
    `config.perturb` mode has p > 0, a `Perturber(config.perturb)` is built; a perturber that
    implements `BindsCanary` is bound to the new Canary. Its journal is `canary.injections()`.
    `parallel_launches=False` runs every launch on the calling thread (see `Canary`).
    """
    if not config.enabled:
        return None
    if perturb is None and config.perturb.any_enabled:
        perturb = Perturber(config.perturb)
    canary = Canary(
        config,
        groups,
        capacities,
        token_oracle=token_oracle,
        kernels=kernels,
        perturb=perturb,
        parallel_launches=parallel_launches,
    )
    if isinstance(perturb, BindsCanary):
        perturb.bind(canary)
    return canary
