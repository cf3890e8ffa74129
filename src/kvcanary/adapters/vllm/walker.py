"""A sweep walker over vLLM's hash-chained prefix cache (SPEC §2.5, "hash-chained block caches").

vLLM's `BlockPool` keys cached blocks by a chained hash but keeps no parent pointer, and a block's
position in its sequence is only implied by `block_hash_num_tokens`. The adapter therefore keeps a
`ParentLedger`, filled when `BlockPool.cache_full_blocks` caches a block: the block's hash, its
index in the request's block list and the previous block (id and hash). The walker emits a cached
block's slots only while its hash still matches the ledger, and links the first slot to the
parent's last slot only while the parent still holds the recorded hash; otherwise that slot's
predecessor is reported as 0 (unreachable, chain check skipped).

Duck-typed over the pool (`blocks[i].block_id / block_hash / ref_cnt / is_null`): no vLLM import.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BlockPoolWalker", "LedgerEntry", "ParentLedger"]


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """Provenance of one cached block."""

    block_hash: Any
    index: int
    parent_id: int
    parent_hash: Any
    block_size: int


class ParentLedger:
    """block_id -> LedgerEntry for blocks cached as full blocks."""

    def __init__(self) -> None:
        self.entries: dict[int, LedgerEntry] = {}

    def note_cached(
        self,
        blocks: Sequence[Any],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
    ) -> None:
        """Record blocks `[num_cached_blocks, num_full_blocks)` of a request's block list after
        `cache_full_blocks` hashed them."""
        for i in range(num_cached_blocks, num_full_blocks):
            blk = blocks[i]
            if getattr(blk, "is_null", False) or blk.block_hash is None:
                continue
            parent = blocks[i - 1] if i > 0 else None
            self.entries[blk.block_id] = LedgerEntry(
                block_hash=blk.block_hash,
                index=i,
                parent_id=-1 if parent is None else int(parent.block_id),
                parent_hash=None if parent is None else parent.block_hash,
                block_size=block_size,
            )


class BlockPoolWalker:
    """`PrefixCacheWalker` over a vLLM `BlockPool` plus the adapter's `ParentLedger`.

    Slots are `block_id * B + offset` and positions `index * B + offset`; B is the block size the
    scheduler cached with (the same slot numbering as the kernel block table).
    """

    def __init__(self, pool: Any, ledger: ParentLedger) -> None:
        self.pool = pool
        self.ledger = ledger
        self.skipped_unknown = 0

    def walk(
        self, *, unlocked_only: bool = False, swa_resident_only: bool = False
    ) -> Iterator[tuple[int, int, int]]:
        """Yield `(slot, position, prev_slot)` for every slot of every cached full block."""
        blocks = self.pool.blocks
        entries = self.ledger.entries
        skipped = 0
        for blk in blocks:
            h = blk.block_hash
            if h is None or getattr(blk, "is_null", False):
                continue
            if unlocked_only and blk.ref_cnt > 0:
                continue
            e = entries.get(blk.block_id)
            if e is None or e.block_hash != h:
                skipped += 1
                continue
            b = e.block_size
            base_slot, base_pos = blk.block_id * b, e.index * b
            if e.parent_id < 0:
                prev = -1
            elif blocks[e.parent_id].block_hash == e.parent_hash:
                prev = e.parent_id * b + b - 1
            else:
                prev = 0  # parent evicted or reused: first slot's chain is unreachable
            for j in range(b):
                yield base_slot + j, base_pos + j, prev
                prev = base_slot + j
        self.skipped_unknown = skipped
