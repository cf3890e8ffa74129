"""Allocation of `req_to_token` row indices (ints only).

Row 0 is the padding row and is never handed out; rows `1 .. num_rows - 1` go to running
requests, lowest free index first, so the order is deterministic.
"""

from __future__ import annotations

import heapq

__all__ = ["RowAllocator"]


class RowAllocator:
    """Free list of `req_to_token` rows; one row per running request."""

    __slots__ = ("_free", "_num_rows", "_used")

    def __init__(self, num_rows: int) -> None:
        """`num_rows` counts padding row 0, so `num_rows - 1` requests can run at once."""
        if num_rows < 2:
            raise ValueError(
                f"RowAllocator needs num_rows >= 2 (row 0 is reserved), got {num_rows}"
            )
        self._num_rows = num_rows
        self._free = list(range(1, num_rows))
        heapq.heapify(self._free)
        self._used: set[int] = set()

    @property
    def num_rows(self) -> int:
        """Total rows, padding row 0 included."""
        return self._num_rows

    @property
    def num_free(self) -> int:
        """Rows available to `alloc`."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Rows assigned to requests."""
        return len(self._used)

    def alloc(self) -> int | None:
        """The lowest free row, or None when every row is in use."""
        if not self._free:
            return None
        row = heapq.heappop(self._free)
        self._used.add(row)
        return row

    def free(self, row: int) -> None:
        """Return `row`; freeing a row that is not in use raises ValueError."""
        if row not in self._used:
            raise ValueError(f"RowAllocator.free: row {row} is not in use")
        self._used.remove(row)
        heapq.heappush(self._free, row)

    def is_used(self, row: int) -> bool:
        """Whether `row` is assigned to a request."""
        return row in self._used

    def check_integrity(self) -> None:
        """Raise AssertionError unless free and used rows partition `1 .. num_rows - 1`."""
        free = set(self._free)
        assert len(free) == len(self._free), "free row list holds a row twice"
        assert not free & self._used, f"rows both free and used: {sorted(free & self._used)}"
        assert free | self._used == set(range(1, self._num_rows)), "row set is not a partition"
