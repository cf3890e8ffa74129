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

from collections.abc import Collection, Iterable, Sequence
from typing import Protocol

from kvcanary.engine.plants import PlantSet
from kvcanary.engine.radix_cache import RadixCache
from kvcanary.engine.req_rows import RowAllocator
from kvcanary.engine.request import Request
from kvcanary.engine.slot_allocator import SlotAllocator
from kvcanary.engine.table import ReqToTokenTable

__all__ = ["KvManager", "PrefixRestorer"]


class PrefixRestorer(Protocol):
    """A lower cache tier (e.g. `engine.host_tier.HostTier`) that re-inserts evicted prefix
    nodes into the radix cache before a match, and backs nodes up when they are evicted."""

    def restore(self, tokens: Sequence[int]) -> int:
        """Restore what extends the device match of `tokens`; returns the tokens restored."""
        ...

    def backup(self, path: Sequence[int], key: Sequence[int], slots: Sequence[int]) -> None:
        """Back up an evicted node before its slots are released."""
        ...


class KvManager:
    """Slots, rows, prefix cache and `req_to_token` table of one engine."""

    __slots__ = (
        "_allocator", "_host", "_plants", "_prefix_cache_on", "_radix", "_rows", "_table",
    )  # fmt: skip

    def __init__(
        self,
        *,
        num_slots: int,
        num_rows: int,
        table: ReqToTokenTable,
        enable_prefix_cache: bool,
        seed: int | None = None,
        plants: PlantSet | None = None,
    ) -> None:
        """Pools of `num_slots` slots and `num_rows` rows (reserved 0 included in both);
        `plants` (self-test only) switches planted bugs on."""
        self._allocator = SlotAllocator(num_slots, seed=seed)
        self._rows = RowAllocator(num_rows)
        self._plants = plants if plants is not None else PlantSet()
        self._radix = RadixCache(self._allocator, self._plants)
        self._table = table
        self._prefix_cache_on = enable_prefix_cache
        self._plants.bind(self._allocator, self._row_mapping)
        self._host: PrefixRestorer | None = None

    def attach_host_tier(self, host: PrefixRestorer) -> None:
        """Back evicted radix nodes up into `host` and restore them on later matches."""
        self._host = host
        self._radix.evict_listener = host.backup

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
        if self._plants.enabled("retract_stale_row") and req.request_id in self._plants.stale_rows:
            stale = self._plants.take_stale(self._plants.stale_rows, req.request_id, None, 0)
            if stale:
                return self._plant_resume_stale_row(req, row, stale)
        matched: list[int] = []
        if self._prefix_cache_on:
            if self._host is not None:
                self._host.restore(req.tokens[: req.seq_len - 1])
            matched, handle = self._radix.match_prefix(req.tokens[: req.seq_len - 1])
            self._radix.lock(handle)
            self._allocator.incref(matched)
            req.handle = handle
        req.row, req.slots, req.num_computed = row, matched, len(matched)
        self._table.write(row, 0, matched)
        if self._plants.enabled("prefix_reused_slots") and self._plants.ghost_slots:
            self._plant_note_ghost_match(req, matched)
        return len(matched)

    def alloc(self, n: int) -> tuple[list[int] | None, int]:
        """`n` fresh slots, evicting unlocked radix leaves if needed; returns `(slots or None,
        slots evicted)`."""
        short = n - self._allocator.num_free
        evicted = self._radix.evict(short) if short > 0 and self._prefix_cache_on else 0
        slots = self._allocator.alloc(n)
        if slots is not None and self._plants.names:
            self._plants.note_alloc(slots)
        return slots, evicted

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

    def truncate(self, req: Request, num_computed: int, phantom: Collection[int] = ()) -> None:
        """Forget `req`'s KV from position `num_computed` on (a recompute after a canary
        incident): drop its references on those slots and zero their table entries, so the
        recompute writes into freshly allocated slots. Slots in `phantom` are dropped without
        a decref: `req` lists them but its reference is gone (a bug freed them and they now
        belong to someone else), so a decref would free another request's slot."""
        extra = req.slots[num_computed:]
        if extra:
            del req.slots[num_computed:]
            self._allocator.decref([s for s in extra if s not in phantom])
            self._table.write(req.row, num_computed, [0] * len(extra))
        req.num_computed = num_computed

    def release(self, req: Request, *, cache: bool) -> None:
        """Give back everything `req` holds: its computed prefix goes to the radix cache when
        `cache` (and caching is on), every other slot reference is dropped, the radix lock is
        released and the row is zeroed and freed."""
        if self._plants.unread:
            self._plants.note_dropped(req.request_id)
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

    # ---- planted bugs (engine/plants.py); reached only when a plant is configured -----------

    def plant_note_read(self, req: Request) -> None:
        """A forward of `req` ran (its stale state, if any, has been read)."""
        if self._plants.unread:
            self._plants.note_read(req.request_id)

    def plant_retract_stale(self, req: Request) -> bool:
        """`retract_stale_row`: release `req` for a retraction but free its computed slots
        outright (no radix insert) and keep its row contents, which it reinstalls and reads on
        resume. Returns False (and does nothing) when none of its computed slots would become
        free, so the bug would have no effect."""
        done = req.num_computed
        computed = req.slots[:done]
        freed = [s for s in computed if self._allocator.refcount(s) == 1]
        if not freed:
            return False
        self._plants.record(
            "retract_stale_row",
            slots=computed,
            row=req.row,
            positions=range(done),
            description=f"retracted {req.request_id!r}: freed {len(freed)} of its {done} computed "
            f"slots but kept its stale row {req.row}, read again when it resumes",
            request_id=req.request_id,
        )
        self._plants.save_stale(self._plants.stale_rows, req.request_id, req.row, 0, computed)
        self._allocator.decref(req.slots)
        # the retraction frees memory for someone else, who takes these slots next
        self._allocator.reuse_first(freed)
        if req.handle is not None:
            self._radix.unlock(req.handle)
        self._rows.free(req.row)  # the row is freed but not zeroed
        req.slots, req.num_computed, req.handle, req.row = [], 0, None, 0
        return True

    def _plant_resume_stale_row(self, req: Request, row: int, stale: tuple[int, ...]) -> int:
        """`retract_stale_row`, second half: `req` resumes through its stale row entries as if
        they still held its KV (it re-takes references on those still held)."""
        self._plants.record(
            "retract_stale_row",
            slots=stale,
            row=row,
            positions=range(len(stale)),
            description=f"{req.request_id!r} resumed in row {row} through its {len(stale)} stale "
            "entries (freed at retraction)",
            request_id=req.request_id,
            counted=False,
        )
        self._allocator.incref(stale)
        self._plants.unread[req.request_id] = "retract_stale_row"
        req.row, req.slots, req.num_computed, req.handle = row, list(stale), len(stale), None
        self._table.write(row, 0, stale)
        return len(stale)

    def plant_free_rejected_drafts(self, req: Request) -> None:
        """`spec_rollback_stale`: like `drop_uncomputed` after a verify, but the rejected draft
        slots stay mapped in the row (the table is not rolled back); the next forward of `req`
        writes into them again (`plant_take_stale_drafts`) while the allocator reuses them."""
        start = req.num_computed
        extra = req.slots[start:]
        if not extra:
            return
        self._plants.record(
            "spec_rollback_stale",
            slots=extra,
            row=req.row,
            positions=range(start, start + len(extra)),
            description=f"verify of {req.request_id!r} rejected {len(extra)} drafts: freed their "
            f"slots but left them mapped in row {req.row} from position {start}",
            request_id=req.request_id,
        )
        self._plants.save_stale(self._plants.stale_drafts, req.request_id, req.row, start, extra)
        del req.slots[start:]
        self._allocator.decref(extra)

    def plant_take_stale_drafts(self, req: Request, n: int) -> list[int]:
        """`spec_rollback_stale`, second half: up to `n` rejected draft slots still mapped in
        `req`'s row at `num_computed ..`, which its next forward reuses instead of allocating."""
        stale = self._plants.take_stale(
            self._plants.stale_drafts, req.request_id, req.row, req.num_computed
        )
        reuse = list(stale[:n])
        if reuse:
            self._plants.record(
                "spec_rollback_stale",
                slots=reuse,
                row=req.row,
                positions=range(req.num_computed, req.num_computed + len(reuse)),
                description=f"{req.request_id!r} writes its freed draft slots again (the row "
                "still maps them)",
                request_id=req.request_id,
                counted=False,
            )
            self._allocator.incref(reuse)
        return reuse

    def plant_shift_chunk(self, req: Request, start: int, slots: list[int], width: int) -> None:
        """`chunk_boundary_off_by_one`: rewrite the `req_to_token` window of the chunk just
        added at `start` one position early (or late, when it fits and the chunk has at least
        two tokens); `req.slots` and the chunk's `out_slots` stay right."""
        n = len(slots)
        shifts = [-1] + ([1] if n >= 2 and start + n + 1 <= width else [])
        shift = self._plants.rng("chunk_boundary_off_by_one").choice(shifts)
        first = start + shift
        self._plants.record(
            "chunk_boundary_off_by_one",
            slots=slots,
            row=req.row,
            positions=range(first, first + n),
            description=f"chunk of {req.request_id!r} at prefix_len={start}: req_to_token window "
            f"written at {first} ({'one early' if shift < 0 else 'one late'}); position "
            f"{start + n - 1 if shift < 0 else start} left unmapped",
            request_id=req.request_id,
        )
        self._table.write(req.row, first, slots)
        self._table.write(req.row, start + n - 1 if shift < 0 else start, [0])

    def _plant_note_ghost_match(self, req: Request, matched: list[int]) -> None:
        """`prefix_reused_slots`, second half: journal a match that returned freed slots."""
        ghost = self._plants.ghost_slots
        hits = [(p, s) for p, s in enumerate(matched) if ghost.get(s) == p]
        if hits:
            self._plants.record(
                "prefix_reused_slots",
                slots=[s for _, s in hits],
                row=req.row,
                positions=[p for p, _ in hits],
                description=f"prefix match of {req.request_id!r} returned {len(hits)} slots of "
                "a node whose slots were freed",
                request_id=req.request_id,
                counted=False,
            )

    def _row_mapping(self, slot: int, position: int) -> int:
        """The first used row whose entry at `position` is `slot`, or 0 (plant journals)."""
        for row in range(1, self._rows.num_rows):
            if self._rows.is_used(row) and self._table.read(row, position + 1)[position] == slot:
                return row
        return 0

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
