"""The fill-once violation ring and its pump (SPEC §7.1, §7.4, §7.5)."""

from __future__ import annotations

import logging

import numpy as np
import numpy.typing as npt

from kvcanary.canary.report import make_violation
from kvcanary.contract.violation import Violation

__all__ = ["RING_COLUMNS", "ViolationRing"]

logger = logging.getLogger("kvcanary")
RING_COLUMNS = 8


class ViolationRing:
    """`[capacity, 8]` int64 rows plus a monotonic write index.

    Kernels append through `words` (the u64 view) and `state` (`state[0]` = write index). Row 0 is
    always the first violation; rows past capacity are dropped while the index keeps counting.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(
                f"kv-canary: ViolationLog ring_capacity must be positive, got {capacity}"
            )
        self.capacity = capacity
        self.rows: npt.NDArray[np.int64] = np.zeros((capacity, RING_COLUMNS), dtype=np.int64)
        self.words: npt.NDArray[np.uint64] = self.rows.view(np.uint64)
        self.state: npt.NDArray[np.int64] = np.zeros(1, dtype=np.int64)
        self._last_reported = 0
        self._full_notice_logged = False
        self._reported: list[Violation] = []
        self._drained = 0

    @property
    def write_index(self) -> int:
        """Total violations recorded so far (including dropped rows)."""
        return int(self.state[0])

    @property
    def overflowed(self) -> bool:
        """True once more violations were recorded than the ring holds."""
        return self.write_index > self.capacity

    def pump(self, step: int) -> list[Violation]:
        """Turn rows recorded since the last pump into Violations stamped with `step`."""
        total = self.write_index
        end = min(total, self.capacity)
        if total > self.capacity and not self._full_notice_logged:
            self._full_notice_logged = True
            logger.warning(
                "kv-canary: violation ring full (capacity=%d); further violation details are "
                "dropped, total=%d",
                self.capacity,
                total,
            )
        new = [
            make_violation(
                self.rows[i].tolist(),
                total_violations=total,
                ring_capacity=self.capacity,
                step_when_pumped=step,
            )
            for i in range(self._last_reported, end)
        ]
        self._last_reported = end
        self._reported.extend(new)
        return new

    def drain(self) -> list[Violation]:
        """Violations pumped since the previous drain, in ring order."""
        out = self._reported[self._drained :]
        self._drained = len(self._reported)
        return out
