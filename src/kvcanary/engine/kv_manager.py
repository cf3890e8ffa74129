"""KvManager: what each request holds (slots, a row, a radix lock) and how it gives them back.

It composes the slot allocator, the row allocator, the radix cache and the `req_to_token` table
and keeps them consistent; the scheduler decides *who* gets memory, this module does the
bookkeeping. Ints only.

Invariants between calls (checked by `check_integrity`):

| structure | holds |
|---|---|
| allocator | `refcount[s]` = (1 if the radix tree stores `s`) + (number of running requests whose `slots` list `s`) |
| `req_to_token[row]` of a running request | `slots[p]` at every `p < len(slots)`, 0 after |
| released rows | all zero |
| radix locks | one per running request that matched a prefix |
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvcanary.engine.radix_cache import RadixCache
from kvcanary.engine.req_rows import RowAllocator
from kvcanary.engine.request import Request
from kvcanary.engine.slot_allocator import SlotAllocator
from kvcanary.engine.table import ReqToTokenTable

__all__ = ["KvManager"]


class KvManager:
    """Slots, rows, prefix cache and `req_to_token` table of one engine."""

    __slots__ = ("_allocator", "_prefix_cache_on", "_radix", "_rows", "_table")

    def __init__(
        self,
        *,
        num_slots: int,
        num_rows: int,
        table: ReqToTokenTable,
        enable_prefix_cache: bool,
        seed: int | None = None,
    ) -> None:
        """Pools of `num_slots` slots and `num_rows` rows (reserved 0 included in both)."""
        self._allocator = SlotAllocator(num_slots, seed=seed)
        self._rows = RowAllocator(num_rows)
        self._radix = RadixCache(self._allocator)
        self._table = table
        self._prefix_cache_on = enable_prefix_cache

    @property
    def allocator(self) -> SlotAllocator:
        """The slot allocator."""
        return self._allocator

    @property
    def rows(self) -> RowAllocator:
        """The `req_to_token` row allocator."""
        return self._rows

    @property
    def prefix_cache(self) -> RadixCache:
        """The radix cache (empty when prefix caching is off)."""
        return self._radix

    @property
    def table(self) -> ReqToTokenTable:
        """The `req_to_token` table."""
        return self._table

    def attach(self, req: Request) -> int:
        """Give `req` a row and its cached prefix (locked, one reference per slot, written to
        the table). The match leaves at least one token to compute. Returns the match length."""
        row = self._rows.alloc()
        if row is None:
            raise RuntimeError("KvManager.attach: no free req_to_token row")
        matched: list[int] = []
        if self._prefix_cache_on:
            matched, handle = self._radix.match_prefix(req.tokens[: req.seq_len - 1])
            self._radix.lock(handle)
            self._allocator.incref(matched)
            req.handle = handle
        req.row, req.slots, req.num_computed = row, matched, len(matched)
        self._table.write(row, 0, matched)
        return len(matched)

    def alloc(self, n: int) -> tuple[list[int] | None, int]:
        """`n` fresh slots, evicting unlocked radix leaves if needed; returns `(slots or None,
        slots evicted)`."""
        short = n - self._allocator.num_free
        evicted = self._radix.evict(short) if short > 0 and self._prefix_cache_on else 0
        return self._allocator.alloc(n), evicted

    def extend(self, req: Request, slots: Sequence[int]) -> None:
        """Append freshly allocated `slots` (the request takes their reference) after its last
        slot and record them in its row."""
        start = len(req.slots)
        req.slots.extend(slots)
        self._table.write(req.row, start, slots)

    def drop_uncomputed(self, req: Request) -> None:
        """Release the slots past `num_computed` (rejected drafts, a discarded chunk) and zero
        their table entries, so they are never read as history."""
        extra = req.slots[req.num_computed :]
        if extra:
            del req.slots[req.num_computed :]
            self._allocator.decref(extra)
            self._table.write(req.row, req.num_computed, [0] * len(extra))

    def release(self, req: Request, *, cache: bool) -> None:
        """Give back everything `req` holds: its computed prefix goes to the radix cache when
        `cache` (and caching is on), every other slot reference is dropped, the radix lock is
        released and the row is zeroed and freed."""
        done = req.num_computed
        if cache and self._prefix_cache_on and done > 0:
            self._radix.insert(req.tokens[:done], req.slots[:done])
            self._allocator.decref(req.slots[done:])
        else:
            self._allocator.decref(req.slots)
        if req.handle is not None:
            self._radix.unlock(req.handle)
        self._table.clear(req.row)
        self._rows.free(req.row)
        req.slots, req.num_computed, req.handle, req.row = [], 0, None, 0

    def check_integrity(self, running: Iterable[Request], max_context_len: int) -> None:
        """Raise AssertionError unless the invariants in the module docstring hold. Costs a full
        table read per running request: for tests and debugging."""
        self._allocator.check_integrity()
        self._rows.check_integrity()
        self._radix.check_integrity()
        refs: dict[int, int] = {}
        for slot, _, _ in self._radix.walk():
            refs[slot] = refs.get(slot, 0) + 1
        rows: set[int] = set()
        for req in running:
            assert self._rows.is_used(req.row) and req.row not in rows, f"{req.request_id}: bad row"
            rows.add(req.row)
            for slot in req.slots:
                refs[slot] = refs.get(slot, 0) + 1
            cells = self._table.read(req.row, max_context_len)
            assert cells[: len(req.slots)] == req.slots, f"{req.request_id}: row out of sync"
            assert not any(cells[len(req.slots) :]), f"{req.request_id}: stale row entries"
        assert self._rows.num_used == len(rows), "a row is used by no running request"
        assert self._allocator.num_held == len(refs), (
            f"{self._allocator.num_held} slots held but {len(refs)} referenced: a slot leaked"
        )
        for slot, count in refs.items():
            assert self._allocator.refcount(slot) == count, (
                f"slot {slot}: {self._allocator.refcount(slot)} references, {count} holders"
            )
