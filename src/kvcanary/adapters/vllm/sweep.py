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
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["BlockSnapshot", "LedgerEntry", "ParentLedger", "SnapshotWalker", "snapshot_pool"]

FIRST = -1  #: the block starts its sequence
UNREACHABLE = -2  #: the parent was evicted or re-filled: the chain check is skipped


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """Provenance of one cached block."""

    block_hash: Any
    index: int
    parent_id: int
    parent_hash: Any


class ParentLedger:
    """block_id -> LedgerEntry for blocks cached as full blocks."""

    def __init__(self) -> None:
        self.entries: dict[int, LedgerEntry] = {}

    def note_cached(self, blocks: Sequence[Any], num_cached_blocks: int,
                    num_full_blocks: int) -> None:  # fmt: skip
        """Record blocks `[num_cached_blocks, num_full_blocks)` of a request's block list after
        `BlockPool.cache_full_blocks` hashed them."""
        for i in range(num_cached_blocks, num_full_blocks):
            blk = blocks[i]
            if getattr(blk, "is_null", False) or blk.block_hash is None:
                continue
            parent = blocks[i - 1] if i > 0 else None
            self.entries[int(blk.block_id)] = LedgerEntry(
                block_hash=blk.block_hash,
                index=i,
                parent_id=FIRST if parent is None else int(parent.block_id),
                parent_hash=None if parent is None else parent.block_hash,
            )


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
    out: list[tuple[int, int, int, int]] = []
    gone: list[int] = []
    skipped = 0
    for block_id, e in ledger.entries.items():
        blk = blocks[block_id] if 0 <= block_id < n else None
        h = None if blk is None else blk.block_hash
        if h is None or getattr(blk, "is_null", False):
            gone.append(block_id)
            continue
        if h != e.block_hash:
            skipped += 1
            continue
        if e.parent_id < 0:
            parent = FIRST
        elif blocks[e.parent_id].block_hash == e.parent_hash:
            parent = e.parent_id
        else:
            parent = UNREACHABLE
        out.append((block_id, e.index, parent, int(blk.ref_cnt > 0)))
    for block_id in gone:
        del ledger.entries[block_id]
    rows = np.array(out, dtype=np.int64).reshape(-1, 4)
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    return BlockSnapshot(rows=rows, block_size=block_size, skipped=skipped)


def expand(snapshot: BlockSnapshot, unlocked_only: bool = False) -> npt.NDArray[np.int64]:
    """The snapshot as canary walker entries, `[n, 3]` rows of `(slot, position, prev_slot)`."""
    rows = snapshot.rows
    if unlocked_only:
        rows = rows[rows[:, 3] == 0]
    b = snapshot.block_size
    j = np.arange(b, dtype=np.int64)
    slots = rows[:, :1] * b + j
    positions = rows[:, 1:2] * b + j
    prev = slots - 1
    parent = rows[:, 2]
    prev[:, 0] = np.where(parent >= 0, parent * b + b - 1, np.where(parent == FIRST, -1, 0))
    return np.stack([slots.ravel(), positions.ravel(), prev.ravel()], axis=1)


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
        snap = self.snapshot
        if snap is None:
            self.missed += 1
            return np.zeros((0, 3), dtype=np.int64)
        self.walks += 1
        return expand(snap, unlocked_only)
