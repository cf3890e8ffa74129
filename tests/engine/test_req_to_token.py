"""TorchReqToTokenTable: the ReqToTokenTable protocol over a live int32 tensor."""

from __future__ import annotations

import pytest
import torch

from kvcanary.engine.req_to_token import TorchReqToTokenTable
from kvcanary.engine.table import ReqToTokenTable


def test_table_is_zeroed_int32_with_padding_row() -> None:
    table = TorchReqToTokenTable(max_rows=3, max_context_len=8)
    assert table.tensor.shape == (4, 8) and table.shape == (4, 8)
    assert table.tensor.dtype == torch.int32 and not table.tensor.any()
    assert table.max_rows == 3 and table.max_context_len == 8


def test_write_read_clear_through_the_live_tensor() -> None:
    table = TorchReqToTokenTable(max_rows=3, max_context_len=8)
    proto: ReqToTokenTable = table  # structural conformance, checked by type checkers
    live = table.tensor
    proto.write(2, 0, [5, 6, 7])
    proto.write(2, 3, [9])
    proto.write(2, 4, [])
    assert proto.read(2, 5) == [5, 6, 7, 9, 0]
    assert live[2, :4].tolist() == [5, 6, 7, 9]
    live[2, 1] = 42  # edits through the tensor are visible through the protocol
    assert table.read(2, 2) == [5, 42]
    table.clear(2)
    assert table.read(2, 8) == [0] * 8
    assert table.tensor is live


@pytest.mark.parametrize(
    ("row", "start", "slots"), [(0, 0, [1]), (4, 0, [1]), (1, -1, [1]), (1, 7, [1, 2])]
)
def test_write_rejects_out_of_range(row: int, start: int, slots: list[int]) -> None:
    table = TorchReqToTokenTable(max_rows=3, max_context_len=8)
    with pytest.raises(IndexError):
        table.write(row, start, slots)
    assert not table.tensor.any()


def test_read_and_clear_reject_the_padding_row() -> None:
    table = TorchReqToTokenTable(max_rows=1, max_context_len=4)
    with pytest.raises(IndexError):
        table.clear(0)
    with pytest.raises(IndexError):
        table.read(1, 5)
