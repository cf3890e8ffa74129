"""Prefix-cache sweeps across vLLM's two halves (SPEC §2.5, "hash-chained block caches").

The cached blocks live in the scheduler's `BlockPool`, the KV bytes in the worker: in vLLM's
default multiprocess layout they are different processes. The scheduler half turns the pool into
a `BlockSnapshot` (one int row per cached block) on the steps the worker will sweep, and ships it
in that step's connector metadata; the worker's `SnapshotWalker` expands it into the canary's
`(slot, position, prev_slot)` entries after that step's forward, so the walk reflects the cache at
the moment the canary reads it.

vLLM's pool keys blocks by a chained hash but keeps no parent pointer, and a block's position in
its sequence is only implied. `ParentLedger` records, when the pool caches a block, its hash, its
index in the request's block list and the previous block (id and hash). A block is swept only
while its hash still matches the ledger; its first slot links to the parent's last slot only while
the parent still holds the recorded hash, else that predecessor is reported unreachable (0).
Duck-typed over the pool (`blocks[i].block_id / block_hash / ref_cnt / is_null`): no vLLM import.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from numba import njit

__all__ = [
    "BlockSnapshot",
    "Entry",
    "LedgerEntry",
    "ParentLedger",
    "SnapshotWalker",
    "runs",
    "snapshot_pool",
]

FIRST = -1  #: the block starts its sequence
UNREACHABLE = -2  #: the parent was evicted or re-filled: the chain check is skipped
_INT64 = np.dtype(np.int64)
#: snapshots of at most this many blocks are ordered in Python (cold NumPy calls cost more
#: there); larger ones by NumPy (16k blocks: sorting the rows in Python took 10 of 29 ms)
_SORT_IN_PYTHON = 64


class LedgerEntry(NamedTuple):
    """Provenance of one cached block, in the field order of the ledger's plain tuples."""

    block_hash: Any
    index: int
    parent_id: int
    parent_hash: Any


#: a ledger entry as `note_cached` stores it: a plain tuple in `LedgerEntry`'s field order (a
#: `LedgerEntry` is one too). Built per cached block on the scheduler's critical path: a
#: named tuple took ~0.7 us apiece there (its `__new__` is Python), a plain one ~0.15 us.
Entry = tuple[Any, int, int, Any]


class ParentLedger:
    """block_id -> provenance (`Entry`) for blocks cached as full blocks."""

    def __init__(self) -> None:
        self.entries: dict[int, Entry] = {}

    def note_cached(self, blocks: Sequence[Any], num_cached_blocks: int,
                    num_full_blocks: int) -> None:  # fmt: skip
        """Record blocks `[num_cached_blocks, num_full_blocks)` of a request's block list after
        `BlockPool.cache_full_blocks` hashed them."""
        entries = self.entries
        if num_cached_blocks > 0:
            parent = blocks[num_cached_blocks - 1]
            parent_id, parent_hash = parent.block_id, parent.block_hash
        else:
            parent_id, parent_hash = FIRST, None
        for i in range(num_cached_blocks, num_full_blocks):
            blk = blocks[i]
            h = blk.block_hash
            block_id = blk.block_id
            if h is not None and not blk.is_null:
                entries[block_id] = (h, i, parent_id, parent_hash)
            parent_id, parent_hash = block_id, h


@dataclass(frozen=True)
class BlockSnapshot:
    """`rows[i] = (block_id, index, parent, held)`: parent is a block id, `FIRST` or
    `UNREACHABLE`; held is 1 while a running request holds the block. `skipped`: cached blocks
    whose hash is not the one the ledger recorded for them (not swept)."""

    rows: npt.NDArray[np.int64]
    block_size: int
    skipped: int = 0


def snapshot_pool(pool: Any, ledger: ParentLedger, block_size: int) -> BlockSnapshot:
    """Every cached full block the ledger recorded whose hash still matches, in block-id order.

    The work is proportional to the ledger (the cached blocks), not to the pool: a sweep every
    few steps over a pool of 100k blocks would otherwise walk every block in Python. Entries of
    blocks that lost their hash (evicted, freed) leave the ledger here; a block cached again is
    recorded again by `note_cached`. `skipped` counts cached blocks whose hash is not the one
    recorded (provenance unknown: not swept)."""
    blocks = pool.blocks
    n = len(blocks)
    found: list[tuple[int, int, int, int]] = []  # the rows, then one NumPy conversion
    gone: list[int] = []
    skipped = 0
    # `is` first: a block still cached under the recorded hash holds the very object the
    # ledger took from it (a hash compare costs ~10x an identity test, per block, in Python).
    # No `is_null` test: the ledger never records the null block (`note_cached`).
    for block_id, (recorded, index, parent_id, parent_hash) in ledger.entries.items():
        blk = blocks[block_id] if 0 <= block_id < n else None
        h = None if blk is None else blk.block_hash
        if h is not recorded:
            if h is None:
                gone.append(block_id)
                continue
            if h != recorded:
                skipped += 1
                continue
        if parent_id < 0:
            parent = FIRST
        else:
            ph = blocks[parent_id].block_hash
            parent = parent_id if ph is parent_hash or ph == parent_hash else UNREACHABLE
        found.append((block_id, index, parent, 1 if blk.ref_cnt > 0 else 0))
    for block_id in gone:
        del ledger.entries[block_id]
    few = len(found) <= _SORT_IN_PYTHON
    if few:
        # a few blocks: the tuples sort by their (unique) block id before the one conversion.
        # Each NumPy call after a model forward costs ~10 us of cold caches: argsort and a
        # gather took ~20 us of a 50 us snapshot in vLLM, and a gather by a Python list of 16
        # indices 6-10 us of a 36-41 us snapshot even warm (sorting the tuples: 25-29 us)
        found.sort()
    rows = np.fromiter(chain.from_iterable(found), dtype=np.int64, count=4 * len(found))
    rows = rows.reshape(-1, 4)
    if not few:
        rows = rows[np.argsort(rows[:, 0], kind="stable")]
    return BlockSnapshot(rows=rows, block_size=block_size, skipped=skipped)


@njit(cache=True)
def _expand(rows, b, unlocked_only):  # type: ignore[no-untyped-def]
    """`expand` in one compiled pass (a dozen NumPy calls per sweep otherwise)."""
    n = 0
    for i in range(rows.shape[0]):
        n += b if not unlocked_only or rows[i, 3] == 0 else 0
    out = np.empty((n, 3), dtype=np.int64)
    k = 0
    for i in range(rows.shape[0]):
        if unlocked_only and rows[i, 3] != 0:
            continue
        block, index, parent = rows[i, 0], rows[i, 1], rows[i, 2]
        for j in range(b):
            out[k, 0] = block * b + j
            out[k, 1] = index * b + j
            out[k, 2] = block * b + j - 1
            k += 1
        first = k - b
        if parent >= 0:
            out[first, 2] = parent * b + b - 1
        elif parent == FIRST:
            out[first, 2] = -1
        else:
            out[first, 2] = 0  # UNREACHABLE: the chain check of the block's first slot is off
    return out


@njit(cache=True)
def _runs(rows, b, unlocked_only):  # type: ignore[no-untyped-def]
    """`runs` in one compiled pass."""
    n = 0
    for i in range(rows.shape[0]):
        n += 1 if not unlocked_only or rows[i, 3] == 0 else 0
    out = np.empty((n, 4), dtype=np.int64)
    k = 0
    for i in range(rows.shape[0]):
        if unlocked_only and rows[i, 3] != 0:
            continue
        block, parent = rows[i, 0], rows[i, 2]
        out[k, 0] = block * b
        out[k, 1] = rows[i, 1] * b
        # the parent's last slot; -1 starts a sequence; 0 turns the chain check off
        out[k, 2] = parent * b + b - 1 if parent >= 0 else (-1 if parent == FIRST else 0)
        out[k, 3] = b
        k += 1
    return out


def runs(snapshot: BlockSnapshot, unlocked_only: bool = False) -> npt.NDArray[np.int64]:
    """The snapshot as canary walk runs (`PrefixCacheWalker.walk_runs`): one `[m, 4]` row
    `(first slot, first position, prev_slot, block size)` per block, the walk `expand` gives
    without a row per slot."""
    rows = snapshot.rows
    if rows.dtype != _INT64:
        rows = rows.astype(np.int64)
    out: npt.NDArray[np.int64] = _runs(rows, snapshot.block_size, unlocked_only)
    return out


def expand(snapshot: BlockSnapshot, unlocked_only: bool = False) -> npt.NDArray[np.int64]:
    """The snapshot as canary walker entries, `[n, 3]` rows of `(slot, position, prev_slot)`:
    each block's slots in order, the first one linked to its parent block's last slot (-1 for
    a sequence's first block, 0 when the parent is unreachable)."""
    rows = snapshot.rows
    if rows.dtype != _INT64:  # `snapshot_pool` builds int64 rows; anything else is converted
        rows = rows.astype(np.int64)
    out: npt.NDArray[np.int64] = _expand(rows, snapshot.block_size, unlocked_only)
    return out


class SnapshotWalker:
    """`PrefixCacheWalker` over the snapshot bound for the current step (empty without one)."""

    def __init__(self) -> None:
        self.snapshot: BlockSnapshot | None = None
        self.walks = 0  # sweeps that had this step's snapshot
        self.missed = 0  # sweeps the canary ran on a step without one

    def walk(
        self, *, unlocked_only: bool = False, swa_resident_only: bool = False
    ) -> Iterator[tuple[int, int, int]]:
        """Yield `(slot, position, prev_slot)` for every slot of every snapshot block."""
        yield from (tuple(e) for e in self.walk_array(unlocked_only=unlocked_only).tolist())

    def walk_array(
        self, *, unlocked_only: bool = False, swa_resident_only: bool = False
    ) -> npt.NDArray[np.int64]:
        """The same walk as one `[n, 3]` int64 array (`PrefixCacheWalker.walk_array`: the
        canary takes it without a Python step per slot)."""
        snap = self._counted()
        return np.zeros((0, 3), dtype=np.int64) if snap is None else expand(snap, unlocked_only)

    def walk_runs(
        self, *, unlocked_only: bool = False, swa_resident_only: bool = False
    ) -> npt.NDArray[np.int64]:
        """The same walk as `[m, 4]` int64 runs, one per block (`PrefixCacheWalker.walk_runs`:
        the canary's small sweep expands them inside its compiled call)."""
        snap = self._counted()
        return np.zeros((0, 4), dtype=np.int64) if snap is None else runs(snap, unlocked_only)

    def _counted(self) -> BlockSnapshot | None:
        """This step's snapshot, counted as a walk (or, without one, as a missed sweep)."""
        snap = self.snapshot
        if snap is None:
            self.missed += 1
        else:
            self.walks += 1
        return snap
