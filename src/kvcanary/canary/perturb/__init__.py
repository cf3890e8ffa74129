"""Fault injection (SPEC §11): the eleven self-test modes behind the canary's perturb seam.

`install` builds a `Perturber` from `CanaryConfig.perturb` when any mode has p > 0; the journal
is `canary.injections()`.
"""

from kvcanary.canary.perturb.journal import Journal
from kvcanary.canary.perturb.perturber import Perturber
from kvcanary.canary.perturb.rng import mode_seed

__all__ = ["Journal", "Perturber", "mode_seed"]
