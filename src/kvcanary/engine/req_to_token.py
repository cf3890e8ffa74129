"""The live `req_to_token` table as a torch tensor: row -> position -> KV slot.

Attention gathers K/V through this exact tensor, and the canary's `ForwardView.req_to_token` is
this exact tensor too, so a wrong entry is both what the model reads and what the canary checks
(SPEC §2.7, obligation 2). Row 0 is reserved padding; the table is zero-initialised, and 0 means
"no slot".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import torch

__all__ = ["TorchReqToTokenTable"]


@final
class TorchReqToTokenTable:
    """`ReqToTokenTable` over a zero-initialised int32 tensor `[max_rows + 1, max_context_len]`.

    Usable rows are `1..max_rows`; row 0 stays all-zero padding.
    """

    __slots__ = ("_table",)

    def __init__(self, *, max_rows: int, max_context_len: int) -> None:
        """A zeroed table with rows `0..max_rows` and `max_context_len` positions per row."""
        if max_rows < 1 or max_context_len < 1:
            raise ValueError(
                "TorchReqToTokenTable max_rows and max_context_len must be positive, got "
                f"{max_rows} and {max_context_len}"
            )
        self._table = torch.zeros((max_rows + 1, max_context_len), dtype=torch.int32)

    @property
    def tensor(self) -> torch.Tensor:
        """The live table (not a copy): `[max_rows + 1, max_context_len]` int32."""
        return self._table

    @property
    def shape(self) -> tuple[int, int]:
        """`(rows, columns)` of the tensor, row 0 included."""
        return int(self._table.shape[0]), int(self._table.shape[1])

    @property
    def max_rows(self) -> int:
        """Usable rows, row 0 excluded."""
        return int(self._table.shape[0]) - 1

    @property
    def max_context_len(self) -> int:
        """Positions per row."""
        return int(self._table.shape[1])

    def write(self, row: int, start: int, slots: Sequence[int]) -> None:
        """Set `table[row, start + i] = slots[i]`."""
        self._check_row(row)
        end = start + len(slots)
        if start < 0 or end > self.max_context_len:
            raise IndexError(
                f"req_to_token positions [{start}, {end}) are outside [0, {self.max_context_len})"
            )
        if slots:
            self._table[row, start:end] = torch.as_tensor(list(slots), dtype=torch.int32)

    def clear(self, row: int) -> None:
        """Zero `row`, so its stale slots can no longer be read through it."""
        self._check_row(row)
        self._table[row].zero_()

    def read(self, row: int, length: int) -> list[int]:
        """Slots at positions `[0, length)` of `row`."""
        self._check_row(row)
        if length < 0 or length > self.max_context_len:
            raise IndexError(f"req_to_token length {length} is outside [0, {self.max_context_len}]")
        return [int(s) for s in self._table[row, :length].tolist()]

    def _check_row(self, row: int) -> None:
        if not 1 <= row <= self.max_rows:
            raise IndexError(f"req_to_token row {row} is outside [1, {self.max_rows}]")
