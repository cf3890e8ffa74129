"""The warm-up gate (SPEC §11.1 "Warm-up gate")."""

from __future__ import annotations

import logging

__all__ = ["WarmupGate"]

logger = logging.getLogger("kvcanary")


class WarmupGate:
    """Blocks every mode while `step < warmup_steps`.

    Logs `disabled during warmup window` the first time it blocks and `enabled after warmup
    window` the first time it opens; each message at most once per gate.
    """

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self._said_disabled = False
        self._said_enabled = False

    def open(self, step: int) -> bool:
        """True when injections may run at `step`."""
        if step < self.warmup_steps:
            if not self._said_disabled:
                self._said_disabled = True
                logger.info(
                    "kv_canary perturb: disabled during warmup window (first %d forward steps)",
                    self.warmup_steps,
                )
            return False
        if not self._said_enabled:
            self._said_enabled = True
            logger.info("kv_canary perturb: enabled after warmup window at step=%d", step)
        return True
