"""A host tier below the device pool (SGLang HiCache's idea), carrying the canary's sidecars.

When the radix cache evicts a node, its KV (every layer) and its HEAD/TAIL records are backed up
into host pages. A later admission whose prefix continues past the device match restores the
node from the host, possibly into other device slots: the pages land through `land_pages`
(sidecars first and last, verified before any forward reads them) and the node is re-inserted
into the radix cache. A landing that fails its verify is a miss: the slots are freed, the host
entry is dropped and the request recomputes, so a bad copy never reaches attention.

Host entries are keyed by the token path above them and their first token, as a radix child is.
The host pool has a fixed number of pages; when it is full the least recently used entries are
dropped. Ints and tensors only; no canary import (sidecars go through `SidecarTransfer`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvcanary.contract import NullSidecars, SidecarRecords, SidecarTransfer
from kvcanary.engine.kv_pool import KvPool
from kvcanary.engine.landing import KvPages, land_pages, read_pages
from kvcanary.engine.radix_cache import RadixCache
from kvcanary.engine.slot_allocator import SlotAllocator
from kvcanary.engine.transfer_faults import TransferFaults

__all__ = ["HostStats", "HostTier"]


@dataclass(slots=True)
class _Entry:
    path: tuple[int, ...]  # tokens above the node (its depth is len(path))
    key: tuple[int, ...]  # the node's tokens
    pages: list[int]  # host pages holding its KV and records
    generation: int
    last_use: int
    prior: KvPages | None = None  # what the pages held before this store (failed-store fault)


@dataclass(slots=True)
class HostStats:
    """Counters of the host tier."""

    backups: int = 0
    backed_up_tokens: int = 0
    restores: int = 0
    restored_tokens: int = 0
    rejected_restores: int = 0
    dropped_entries: int = 0


@dataclass(slots=True)
class HostTier:
    """Host pages for evicted radix nodes, and the restore path back into the device pool.

    A host page holds one token's K and V of every layer and, beside them, its HEAD and TAIL
    records of every half, exactly as exported by the device canary.
    """

    pool: KvPool
    allocator: SlotAllocator
    radix: RadixCache
    num_pages: int
    sidecars: SidecarTransfer = field(default_factory=NullSidecars)
    faults: TransferFaults | None = None
    stats: HostStats = field(default_factory=HostStats)
    _k: torch.Tensor = field(init=False)
    _v: torch.Tensor = field(init=False)
    _records: dict[tuple[str, int], bytearray] = field(init=False, default_factory=dict)
    _halves: tuple[str, ...] = field(init=False, default=())
    _free: list[int] = field(init=False)
    _index: dict[tuple[tuple[int, ...], int], _Entry] = field(init=False, default_factory=dict)
    _clock: itertools.count[int] = field(init=False, default_factory=itertools.count)
    _generation: itertools.count[int] = field(init=False, default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.num_pages < 1:
            raise ValueError(f"HostTier.num_pages must be >= 1, got {self.num_pages}")
        shape = (self.pool.num_layers, self.num_pages, *self.pool.k(0).shape[1:])
        self._k = torch.zeros(shape, dtype=self.pool.dtype)
        self._v = torch.zeros(shape, dtype=self.pool.dtype)
        self._free = list(range(self.num_pages - 1, -1, -1))

    @property
    def cached_tokens(self) -> int:
        """Host pages in use."""
        return self.num_pages - len(self._free)

    # ---- backup (called by the radix cache just before it frees an evicted node's slots) ----

    def backup(self, path: Sequence[int], key: Sequence[int], slots: Sequence[int]) -> None:
        """Copy the node `key` (below `path`) from device `slots` to host pages, with sidecars."""
        n = len(key)
        if n == 0 or n > self.num_pages:
            return
        ident = (tuple(path), key[0])
        old = self._index.pop(ident, None)
        if old is not None:
            self._free.extend(old.pages)
        while len(self._free) < n:
            self._drop_lru()
        pages = [self._free.pop() for _ in range(n)]
        data = read_pages(self.pool, self.sidecars, list(slots), len(path), tuple(key))
        prior = None
        if self.faults is not None and self.faults.enabled("failed_store_visible"):
            prior = self._read(pages, len(path), tuple(key))
        self._write(pages, data)
        self._index[ident] = _Entry(tuple(path), tuple(key), pages, next(self._generation),
                                    next(self._clock), prior)  # fmt: skip
        self.stats.backups += 1
        self.stats.backed_up_tokens += n

    def _drop_lru(self) -> None:
        ident = min(self._index, key=lambda i: self._index[i].last_use)
        self._free.extend(self._index.pop(ident).pages)
        self.stats.dropped_entries += 1

    def _write(self, pages: list[int], data: KvPages) -> None:
        self._k[:, pages] = data.k
        self._v[:, pages] = data.v
        if data.records is None:
            return
        self._halves = data.records.halves
        for stage, bufs in (("head", data.records.head), ("tail", data.records.tail)):
            for h, buf in enumerate(bufs):
                store = self._records.setdefault((stage, h), bytearray(32 * self.num_pages))
                for j, p in enumerate(pages):
                    store[32 * p : 32 * (p + 1)] = buf[32 * j : 32 * (j + 1)]

    def _read(self, pages: list[int], start: int, tokens: tuple[int, ...]) -> KvPages:
        """What host `pages` hold now (KV and records; records never stored read as zeros)."""
        records = None
        if self._halves:
            zero = bytearray(32 * self.num_pages)

            def buf(stage: str, h: int) -> bytes:
                store = self._records.get((stage, h), zero)
                return b"".join(bytes(store[32 * p : 32 * (p + 1)]) for p in pages)

            n = range(len(self._halves))
            records = SidecarRecords("full", self._halves, tuple(buf("head", h) for h in n),
                                     tuple(buf("tail", h) for h in n))  # fmt: skip
        return KvPages(self._k[:, pages].clone(), self._v[:, pages].clone(), records, start, tokens)

    # ---- restore (called before an admission's radix match) --------------------------------

    def restore(self, tokens: Sequence[int]) -> int:
        """Restore host entries that extend the device match of `tokens`, one node at a time,
        re-inserting each into the radix cache. Returns the tokens restored."""
        restored = 0
        while True:
            matched, handle = self.radix.match_prefix(tokens)
            m = len(matched)
            entry = self._index.get((tuple(tokens[:m]), tokens[m])) if m < len(tokens) else None
            if entry is None:
                return restored
            c = _common(entry.key, tokens, m)
            pages, fault = self._pages_of(entry, c)
            # protect the matched path while making room; evictions may back up other nodes,
            # so the pages were copied out of the host first
            self.radix.lock(handle)
            short = c - self.allocator.num_free
            if short > 0:
                self.radix.evict(short)
            self.radix.unlock(handle)
            slots = self.allocator.alloc(c)
            if slots is None:
                return restored
            if fault is not None and self.faults is not None:
                self.faults.record(fault[0], slots, range(m, m + c), fault[1])
            prev = matched[-1] if m > 0 else -1
            bad = land_pages(self.pool, self.sidecars, slots, pages, prev_slot=prev,
                             faults=self.faults)  # fmt: skip
            if bad:  # a miss: free the slots, forget the entry, let the request recompute
                self.allocator.decref(slots)
                if self._index.get((entry.path, entry.key[0])) is entry:
                    del self._index[entry.path, entry.key[0]]
                    self._free.extend(entry.pages)
                self.stats.rejected_restores += 1
                return restored
            self.allocator.incref(matched)
            self.radix.insert(tokens[: m + c], [*matched, *slots])
            entry.last_use = next(self._clock)
            self.stats.restores += 1
            self.stats.restored_tokens += c
            restored += c

    def _pages_of(self, entry: _Entry, c: int) -> tuple[KvPages, tuple[str, str] | None]:
        """The first `c` pages of `entry` as the host holds them, or as a host fault reads
        them, with the fault to journal once the landing slots are known."""
        depth = len(entry.path)
        stored = self._read(entry.pages[:c], depth, entry.key[:c])
        faults = self.faults
        if faults is None or stored.records is None:
            return stored, None
        if faults.armed("failed_store_visible") and entry.prior is not None:
            prior = entry.prior.slice(0, c)
            assert prior.records is not None
            if any(_pos_chain(prior.records, j) != _pos_chain(stored.records, j) for j in range(c)):
                note = (f"host store of generation {entry.generation} failed but its entry "
                        "answered the lookup: the pages still held what they held before")  # fmt: skip
                return prior, ("failed_store_visible", note)
        if faults.armed("contiguous_block_ids"):
            # the reader takes host page `pages[0] + j` for page j: another node's page once
            # the host pages are fragmented
            first = entry.pages[0]
            assumed = [first + j for j in range(c)]
            if assumed != entry.pages[:c] and assumed[-1] < self.num_pages:
                read = self._read(assumed, depth, entry.key[:c])
                assert read.records is not None
                if any(
                    _pos_chain(read.records, j) != _pos_chain(stored.records, j) for j in range(c)
                ):
                    note = (f"restore read host pages {first}..{assumed[-1]} as if contiguous; the "
                            f"entry's pages are {entry.pages[:c]}")  # fmt: skip
                    return read, ("contiguous_block_ids", note)
        if faults.armed("stale_host_copy"):
            others = sorted((e for e in self._index.values() if e is not entry
                             and len(e.pages) >= c and len(e.path) != depth),
                            key=lambda e: e.generation)  # fmt: skip
            if others:
                other = faults.rng("stale_host_copy").choice(others)
                note = (f"host pages of generation {entry.generation} were reclaimed by generation "
                        f"{other.generation}; the restore read the newer occupant")  # fmt: skip
                return self._read(other.pages[:c], depth, entry.key[:c]), ("stale_host_copy", note)
        return stored, None


def _pos_chain(records: SidecarRecords, j: int) -> bytes:
    return records.tail[0][32 * j + 8 : 32 * j + 24]


def _common(key: Sequence[int], tokens: Sequence[int], start: int) -> int:
    n = min(len(key), len(tokens) - start)
    i = 0
    while i < n and key[i] == tokens[start + i]:
        i += 1
    return i
