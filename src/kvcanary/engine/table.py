"""The `req_to_token` table seen from the scheduler: a Protocol plus a pure-Python reference.

The scheduler owns *what* goes into the table (which slot backs each position of each running
request); the runner side owns the storage (a torch int32 tensor `[max_running_requests + 1,
max_context_len]`, row 0 reserved for padding, zero-initialised). The scheduler writes through
this narrow interface only, so it never touches tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["ListReqToTokenTable", "ReqToTokenTable"]


class ReqToTokenTable(Protocol):
    """Row `r`, column `p` holds the KV slot of position `p` of the request assigned row `r`.

    Row 0 is the padding row and stays zero. A zero entry means "no slot".
    """

    def write(self, row: int, start: int, slots: Sequence[int]) -> None:
        """Set `table[row, start + j] = slots[j]` for every `j`."""
        ...

    def clear(self, row: int) -> None:
        """Zero the whole row (the request released it)."""
        ...

    def read(self, row: int, length: int) -> list[int]:
        """The first `length` entries of `row` as Python ints."""
        ...


class ListReqToTokenTable:
    """`ReqToTokenTable` on nested Python lists, for tests and tensor-free use."""

    __slots__ = ("_cols", "_rows")

    def __init__(self, num_rows: int, num_cols: int) -> None:
        """A zeroed table of `num_rows` rows (row 0 included) by `num_cols` positions."""
        if num_rows < 2:
            raise ValueError(f"ListReqToTokenTable needs num_rows >= 2, got {num_rows}")
        if num_cols < 1:
            raise ValueError(f"ListReqToTokenTable needs num_cols >= 1, got {num_cols}")
        self._cols = num_cols
        self._rows = [[0] * num_cols for _ in range(num_rows)]

    @property
    def shape(self) -> tuple[int, int]:
        """`(rows, columns)`, like the tensor it stands in for."""
        return len(self._rows), self._cols

    def write(self, row: int, start: int, slots: Sequence[int]) -> None:
        """Set `table[row, start + j] = slots[j]`; writing into row 0 or past the end raises."""
        if not 0 < row < len(self._rows):
            raise IndexError(f"req_to_token row {row} is outside [1, {len(self._rows)})")
        if start < 0 or start + len(slots) > self._cols:
            raise IndexError(
                f"req_to_token write [{start}, {start + len(slots)}) is outside [0, {self._cols})"
            )
        self._rows[row][start : start + len(slots)] = [int(s) for s in slots]

    def clear(self, row: int) -> None:
        """Zero the whole row."""
        self._rows[row] = [0] * self._cols

    def read(self, row: int, length: int) -> list[int]:
        """The first `length` entries of `row`."""
        return list(self._rows[row][:length])

    def nonzero_rows(self) -> list[int]:
        """Rows holding at least one non-zero entry (for integrity checks in tests)."""
        return [r for r, cells in enumerate(self._rows) if any(cells)]
