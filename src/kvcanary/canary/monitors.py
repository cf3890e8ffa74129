"""Health check, stats line and overflow warning (SPEC §9)."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

from kvcanary.contract.tags import NUM_LAUNCH_TAGS, LaunchTag

__all__ = ["HEALTH_PERIOD", "HealthChecker", "stats_line", "warn_verify_overflow"]

logger = logging.getLogger("kvcanary")
HEALTH_PERIOD = 100


class HealthChecker:
    """Fails when an expected tag's kernel_run_counter stopped growing between checks.

    Checks run at steps `s >= 100` with `s % 100 == 0`, and only if a forward ran since the
    previous check.
    """

    def __init__(self) -> None:
        self._baseline: dict[LaunchTag, int] = {}
        self._forwards_since = 0

    def note_forward(self) -> None:
        """Record that a forward ran."""
        self._forwards_since += 1

    def due(self, step: int) -> bool:
        """True when `check` at `step` would run (a check step with a forward since the last)."""
        return step >= HEALTH_PERIOD and step % HEALTH_PERIOD == 0 and self._forwards_since > 0

    def check(
        self, step: int, expected: Collection[LaunchTag], counters: Mapping[LaunchTag, int]
    ) -> str | None:
        """The failure message at a due step, else None. Resets the baseline when it runs."""
        if not self.due(step):
            return None
        stalled = [t for t in sorted(expected) if counters[t] <= self._baseline.get(t, 0)]
        self._baseline = dict(counters)
        self._forwards_since = 0
        if not stalled:
            return None
        names = ", ".join(t.name for t in stalled)
        return (
            f"kv-canary: kernel_run_counter did not increase since previous check for "
            f"tags=[{names}] at step={step}; canary path is not executing"
        )


def stats_line(
    *, step: int, protected_tokens: int, sweep_passes: int, violations: int, active_tags: int
) -> str:
    """The periodic INFO stats line (compat)."""
    return (
        f"[canary] step={step} protected_tokens={protected_tokens} sweep_passes={sweep_passes} "
        f"violations={violations} launch_tags_active={active_tags}/{NUM_LAUNCH_TAGS}"
    )


def warn_verify_overflow(total: int, capacity: int) -> None:
    """Log that one group's verify was skipped this forward (compat wording)."""
    logger.warning(
        "kv-canary: per-forward verify skipped this step due to overflow (total=%d, capacity=%d); "
        "check ServerArgs / pool sizing",
        total,
        capacity,
    )
