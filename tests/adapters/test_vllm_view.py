"""The vLLM adapter's engine-neutral parts (no vLLM needed): paged tables -> ForwardView, canary
waves for same-forward prefix hits, and the block-pool sweep walker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.adapters.vllm.sweep import (
    _SORT_IN_PYTHON,
    BlockSnapshot,
    LedgerEntry,
    ParentLedger,
    SnapshotWalker,
    expand,
    runs,
    snapshot_pool,
)
from kvcanary.adapters.vllm.view import build_forward_view, paged_req_to_token, split_waves
from kvcanary.canary.view_checks import runs_entries


@given(
    st.integers(1, 4).flatmap(
        lambda b: st.tuples(
            st.just(b),
            st.lists(st.lists(st.integers(0, 20), min_size=3, max_size=3), min_size=1, max_size=4),
        )
    )
)
@settings(max_examples=100, deadline=None)
def test_paged_req_to_token_matches_block_arithmetic(case: tuple[int, list[list[int]]]) -> None:
    b, rows = case
    table = np.array(rows, dtype=np.int32)
    out = paged_req_to_token(table, len(rows), b, width=3 * b)
    assert out.shape == (len(rows) + 1, 3 * b)
    assert not out[0].any()  # row 0 is the reserved padding row
    for r, blocks in enumerate(rows):
        for p in range(3 * b):
            block = blocks[p // b]
            assert out[r + 1, p] == (0 if block == 0 else block * b + p % b)


def _view(block_table: list[list[int]], computed: list[int], scheduled: list[int], b: int = 2):
    table = np.array(block_table, dtype=np.int32)
    slots, ids, pos = [], [], []
    for r, (c, n) in enumerate(zip(computed, scheduled, strict=True)):
        for p in range(c, c + n):
            slots.append(table[r, p // b] * b + p % b)
            ids.append(100 + p)
            pos.append(p)
    return build_forward_view(
        block_table=table, block_size=b, num_computed=np.array(computed),
        num_scheduled=np.array(scheduled), input_ids=np.array(ids), positions=np.array(pos),
        slot_mapping=np.array(slots),
    )  # fmt: skip


def test_forward_view_rows_lengths_and_slots() -> None:
    view = _view([[3, 4, 0], [5, 6, 7]], computed=[2, 0], scheduled=[1, 5])
    assert view.rows.tolist() == [1, 2]
    assert view.prefix_lens.tolist() == [2, 0]
    assert view.extend_lens.tolist() == [1, 5]
    assert view.out_slots.tolist() == [8, 10, 11, 12, 13, 14]
    assert view.req_to_token[1, :3].tolist() == [6, 7, 8]
    assert view.mutable is False


def test_split_waves_orders_a_same_forward_prefix_hit_after_its_writer() -> None:
    # row 2 hits block 5 (slots 10, 11) that row 1 computes in this very forward
    view = _view([[5, 6, 0], [5, 7, 0]], computed=[0, 2], scheduled=[3, 1])
    waves = split_waves(view)
    assert [w.rows.tolist() for w in waves] == [[1], [2]]
    assert waves[1].out_slots.tolist() == [14]
    assert waves[0].out_slots.tolist() == [10, 11, 12]


def test_split_waves_keeps_independent_rows_together() -> None:
    view = _view([[5, 6, 0], [8, 7, 0]], computed=[0, 2], scheduled=[3, 1])
    assert split_waves(view) == [view]


@dataclass
class _Block:
    block_id: int
    block_hash: Any = None
    ref_cnt: int = 0
    is_null: bool = False


class _Pool:
    def __init__(self, n: int) -> None:
        self.blocks = [_Block(i, is_null=i == 0) for i in range(n)]


def _walk(pool, ledger, b, unlocked_only=False):
    snap = snapshot_pool(pool, ledger, b)
    return snap, {int(s): (int(p), int(q)) for s, p, q in expand(snap, unlocked_only)}


def test_snapshot_links_cached_blocks_and_drops_reused_parents() -> None:
    pool, ledger, b = _Pool(6), ParentLedger(), 2
    seq = [pool.blocks[3], pool.blocks[1], pool.blocks[4]]
    for i, blk in enumerate(seq):
        blk.block_hash = f"h{i}"
    ledger.note_cached(seq, 0, 3)
    _, got = _walk(pool, ledger, b)
    assert got[6] == (0, -1) and got[7] == (1, 6)  # block 3 starts the sequence
    assert got[2] == (2, 7) and got[3] == (3, 2)  # block 1 chains from block 3's last slot
    assert got[8] == (4, 3)
    # block 1 is evicted and reused for other content: its slots vanish, block 4 keeps its
    # slots but its first slot's predecessor becomes unreachable (0)
    pool.blocks[1].block_hash = "other"
    snap, got = _walk(pool, ledger, b)
    assert 2 not in got and 3 not in got
    assert got[8] == (4, 0)
    assert snap.skipped == 1
    pool.blocks[3].ref_cnt = 1
    _, got = _walk(pool, ledger, b, unlocked_only=True)
    assert set(got) == {8, 9}


def test_snapshot_walker_walks_only_the_snapshot_bound_for_this_step() -> None:
    pool, ledger, b = _Pool(4), ParentLedger(), 2
    pool.blocks[2].block_hash = "h0"
    ledger.note_cached([pool.blocks[2]], 0, 1)
    walker = SnapshotWalker()
    assert list(walker.walk()) == [] and walker.missed == 1
    walker.snapshot = snapshot_pool(pool, ledger, b)
    assert list(walker.walk()) == [(4, 0, -1), (5, 1, 4)] and walker.walks == 1


class _NoScanList(list):  # type: ignore[type-arg]
    """The pool's block list; iterating it (a walk over every block) fails the test."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("snapshot_pool walked the whole pool")


def _full_scan(pool: _Pool, ledger: ParentLedger) -> tuple[list[tuple[int, ...]], int]:
    """The snapshot as a scan of every pool block would take it (the earlier implementation)."""
    rows, skipped = [], 0
    for blk in pool.blocks:
        if blk.block_hash is None or blk.is_null:
            continue
        got = ledger.entries.get(blk.block_id)
        e = None if got is None else LedgerEntry(*got)
        if e is None or e.block_hash != blk.block_hash:
            skipped += e is not None
            continue
        if e.parent_id < 0:
            parent = -1
        elif pool.blocks[e.parent_id].block_hash == e.parent_hash:
            parent = e.parent_id
        else:
            parent = -2
        rows.append((blk.block_id, e.index, parent, int(blk.ref_cnt > 0)))
    return rows, skipped


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_snapshot_reads_only_the_ledger_and_equals_a_scan_of_the_whole_pool(data) -> None:  # type: ignore[no-untyped-def]
    """Random caching, eviction (hash dropped), re-filling (another hash) and holding: the
    snapshot equals a scan of every block, without iterating the pool."""
    n = data.draw(st.integers(3, 24))
    pool, ledger, epoch = _Pool(n), ParentLedger(), 0
    for _ in range(data.draw(st.integers(1, 30))):
        op = data.draw(st.sampled_from(["cache", "evict", "refill", "hold"]))
        ids = data.draw(st.lists(st.integers(1, n - 1), min_size=1, max_size=5, unique=True))
        seq = [pool.blocks[i] for i in ids]
        if op == "cache":
            for blk in seq:
                epoch += 1
                blk.block_hash = f"h{epoch}"
            start = data.draw(st.integers(0, len(seq) - 1))
            ledger.note_cached(seq, start, len(seq))
        elif op == "evict":
            for blk in seq:
                blk.block_hash = None
        elif op == "refill":  # cached again under content the ledger never saw
            for blk in seq:
                epoch += 1
                blk.block_hash = f"x{epoch}"
        else:
            for blk in seq:
                blk.ref_cnt = 1 - blk.ref_cnt
        want_rows, want_skipped = _full_scan(pool, ledger)
        guarded = _Pool(0)
        guarded.blocks = _NoScanList(pool.blocks)
        snap = snapshot_pool(guarded, ledger, 2)
        assert [tuple(r) for r in snap.rows.tolist()] == want_rows
        assert snap.skipped == want_skipped


@pytest.mark.parametrize("seed", range(4))
def test_a_large_snapshot_is_ordered_by_numpy_and_equals_a_scan(seed: int) -> None:
    """Past `_SORT_IN_PYTHON` blocks the snapshot is ordered by NumPy: still in block-id
    order, still equal to a scan of every block (sequences cached in shuffled id order, some
    evicted, some re-filled, some held)."""
    rng = np.random.default_rng(seed)
    n = 400
    pool, ledger = _Pool(n), ParentLedger()
    ids = rng.permutation(np.arange(1, n))
    for k, seq_ids in enumerate(np.array_split(ids, 40)):
        seq = [pool.blocks[int(i)] for i in seq_ids]
        for j, blk in enumerate(seq):
            blk.block_hash = f"h{k}.{j}"
            blk.ref_cnt = int(rng.integers(0, 2))
        ledger.note_cached(seq, int(rng.integers(0, 3)), len(seq))
    for i in rng.choice(ids, 60, replace=False):
        pool.blocks[int(i)].block_hash = None if rng.random() < 0.5 else f"x{i}"
    want_rows, want_skipped = _full_scan(pool, ledger)
    assert len(want_rows) > _SORT_IN_PYTHON
    snap = snapshot_pool(pool, ledger, 2)
    assert [tuple(r) for r in snap.rows.tolist()] == want_rows
    assert snap.skipped == want_skipped


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, 500),
            st.integers(0, 50),
            st.sampled_from([-2, -1, 0, 3, 77]),
            st.integers(0, 1),
        ),
        max_size=12,
    ),
    block_size=st.sampled_from([1, 2, 16, 32]),
    unlocked_only=st.booleans(),
)
def test_expand_lists_each_block_slot_linked_to_its_predecessor(
    rows: list[tuple[int, int, int, int]], block_size: int, unlocked_only: bool
) -> None:
    """The compiled expansion equals the walk written out slot by slot: slots in block order,
    positions from the block's index, prev the slot before, and a block's first slot linked to
    its parent's last slot (-1 for a first block, 0 when the parent is unreachable)."""
    b = block_size
    snap = BlockSnapshot(rows=np.array(rows, dtype=np.int64).reshape(-1, 4), block_size=b)
    want = []
    for block, index, parent, held in rows:
        if unlocked_only and held:
            continue
        for j in range(b):
            prev = block * b + j - 1
            if j == 0:
                prev = parent * b + b - 1 if parent >= 0 else (-1 if parent == -1 else 0)
            want.append((block * b + j, index * b + j, prev))
    got = expand(snap, unlocked_only)
    assert got.dtype == np.int64 and got.shape == (len(want), 3)
    assert [tuple(r) for r in got.tolist()] == want
    # the same walk as runs (`walk_runs`): one per block, expanded by the canary's rule
    block_runs = runs(snap, unlocked_only)
    assert block_runs.dtype == np.int64 and block_runs.flags.c_contiguous
    assert block_runs.shape == (len(want) // b, 4) and (block_runs[:, 3] == b).all()
    assert [tuple(r) for r in runs_entries(block_runs).tolist()] == want
