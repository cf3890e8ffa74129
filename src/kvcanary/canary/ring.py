"""The fill-once violation ring and its pump (SPEC §7.1, §7.4, §7.5)."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import numpy.typing as npt

from kvcanary.canary.report import make_violation
from kvcanary.contract.tags import fail_reason_labels, tag_name
from kvcanary.contract.violation import Violation

__all__ = ["RING_COLUMNS", "ViolationRing"]

logger = logging.getLogger("kvcanary")
RING_COLUMNS = 8


class ViolationRing:
    """`[capacity, 8]` int64 rows plus a monotonic write index.

    Kernels append through `words` (the u64 view) and `state` (`state[0]` = write index), or
    the canary appends a pass's rows with `absorb`. Row 0 is always the first violation; rows
    past capacity are dropped while the index keeps counting. Dropped rows absorbed this way
    still reach the log: the pump summarises them by tag and reason, at most one line per step,
    so a long-running server never goes silent after the ring fills.
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
        self._dropped: Counter[tuple[str, str]] = Counter()
        self._dropped_rows = 0
        self._last_summary_step: int | None = None
        #: every dropped row by (tag, reason), never reset (engines' metrics read deltas)
        self.dropped_totals: Counter[tuple[str, str]] = Counter()
        #: grows whenever `drain` or `dropped_totals` would show something new, so a reader
        #: polling every step skips both on the clean path with one comparison
        self.changes = 0

    def absorb(self, rows: npt.NDArray[np.int64]) -> None:
        """Append `rows` (`[n, 8]`, in order) with fill-once semantics, counting every one."""
        if len(rows) == 0:
            return
        start = self.write_index
        self.state[0] = start + len(rows)
        room = max(0, min(len(rows), self.capacity - start))
        if room:
            self.rows[start : start + room] = rows[:room]
        dropped = rows[room:]
        if len(dropped):
            self.changes += 1
            self._dropped_rows += len(dropped)
            pairs, counts = np.unique(dropped[:, [0, 7]], axis=0, return_counts=True)
            for (kind, bits), n in zip(pairs.tolist(), counts.tolist(), strict=True):
                for label in fail_reason_labels(bits) or ["none"]:
                    self._dropped[tag_name(kind), label] += n
                    self.dropped_totals[tag_name(kind), label] += n

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
        total = int(self.state[0])
        if total == self._last_reported and not self._dropped_rows:
            return []  # nothing new (total <= capacity here): the common, clean case
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
        if new:
            self.changes += 1
            self._reported.extend(new)
        self._summarise_dropped(step, total)
        return new

    def _summarise_dropped(self, step: int, total: int) -> None:
        """One WARNING line per step at most for rows the full ring could not hold."""
        if not self._dropped_rows or self._last_summary_step == step:
            return
        self._last_summary_step = step
        counts = ", ".join(
            f"{tag}/{label}={n}" for (tag, label), n in sorted(self._dropped.items())
        )
        logger.warning(
            "kv-canary: %d further violations not kept by the full ring (capacity=%d) up to "
            "step=%d, total=%d: %s",
            self._dropped_rows,
            self.capacity,
            step,
            total,
            counts,
        )
        self._dropped.clear()
        self._dropped_rows = 0

    def drain(self) -> list[Violation]:
        """Violations pumped since the previous drain, in ring order."""
        out = self._reported[self._drained :]
        self._drained = len(self._reported)
        return out
