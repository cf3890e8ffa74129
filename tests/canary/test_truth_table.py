"""`contract.TruthTable` (truth tokens read in place from an engine's token table) gives the
plan builder the same tokens and lengths as the per-row sequences it stands for."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.canary.plan import _truth_table
from kvcanary.contract import ForwardView, TruthTable

_Z = torch.zeros(0, dtype=torch.int64)


def _view(truth: object) -> ForwardView:
    return ForwardView(rows=_Z, prefix_lens=_Z, extend_lens=_Z, input_ids=_Z, positions=_Z,
                       out_slots=_Z, req_to_token=torch.zeros((1, 1), dtype=torch.int64),
                       truth_tokens=truth)  # type: ignore[arg-type]  # fmt: skip


@given(st.integers(0, 2**32 - 1), st.integers(0, 5), st.integers(1, 12),
       st.sampled_from([np.int32, np.int64]))  # fmt: skip
@settings(max_examples=200, deadline=None)
def test_table_and_row_sequences_snapshot_alike(seed: int, nrows: int, ncols: int, dt) -> None:
    rng = np.random.default_rng(seed)
    rows_in_table = int(rng.integers(0, nrows + 2))
    tokens = rng.integers(0, 1000, (rows_in_table + 1, 10)).astype(dt)
    lens = rng.integers(0, 11, rows_in_table).astype(np.int32)
    tt = TruthTable(tokens, lens)
    seqs = [tokens[r, : lens[r]] for r in range(rows_in_table)]
    assert [list(s) for s in tt] == [list(s) for s in seqs]
    got = _truth_table(_view(tt), nrows, ncols, True)
    want = _truth_table(_view(seqs), nrows, ncols, True)
    np.testing.assert_array_equal(got[1], want[1])
    assert got[1].dtype == np.int64
    # what the plan builder reads (kernels/fast_plan.py, reference.py): row r's first
    # min(lens[r], ncols, table width) tokens; a TruthTable's table is passed as it is (no copy)
    assert got[0] is tt.tokens
    for r in range(nrows):

        def readable(table: np.ndarray, lens: np.ndarray, r: int = r) -> list[int]:
            if r >= table.shape[0]:
                return []
            return [int(x) for x in table[r, : min(int(lens[r]), ncols, table.shape[1])]]

        assert readable(got[0], got[1]) == readable(want[0], want[1])


def test_bad_tables_are_type_errors() -> None:
    with pytest.raises(TypeError, match="int32 or int64"):
        _truth_table(_view(TruthTable(np.zeros((2, 3)), np.ones(2, dtype=np.int64))), 2, 3, True)
    with pytest.raises(TypeError, match="negative"):
        _truth_table(_view(TruthTable(np.zeros((2, 3), dtype=np.int64),
                                      np.array([1, -1]))), 2, 3, True)  # fmt: skip
    with pytest.raises(TypeError, match="only 1 rows"):
        _truth_table(_view(TruthTable(np.zeros((1, 3), dtype=np.int64),
                                      np.array([1, 1]))), 2, 3, True)  # fmt: skip
