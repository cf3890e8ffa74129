"""Prefill->decode disaggregation: the two ends of one KV transfer, engine side.

The decode side reserves first (`DecodeTransfers.begin`: a row, its own cached prefix, fresh
slots for the rest of the prompt, staging pages) and sends a `PrefillOrder`; the prefill side
computes the prompt (with its own prefix cache), samples the first token, stages the pages the
decode side lacks and answers `PrefillDone` with the sidecars of exactly those pages. The decode
side then lands the pages layer by layer between the HEAD and TAIL sidecars and verifies them
before any forward reads them (`land_pages`); a failed landing is a miss and the request is
prefilled locally. An abort while the transfer is in flight frees the reservation at once; the
completion that arrives later is discarded (or, under the `late_landing` fault, written into the
freed slots anyway: the SGLang PD abort race).

Messages are frozen dataclasses of ints, tuples and bytes, so any byte transport can carry them.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from kvcanary.contract import SidecarRecords, SidecarTransfer
from kvcanary.engine.kv_pool import KvPool
from kvcanary.engine.kv_staging import KvStaging, StagingPages
from kvcanary.engine.landing import KvPages, land_pages, read_pages, write_pages
from kvcanary.engine.late_watch import LateWatch
from kvcanary.engine.plan import SamplingSpec
from kvcanary.engine.request import Request
from kvcanary.engine.scheduler import Scheduler
from kvcanary.engine.transfer_faults import TransferFaults

__all__ = ["DecodeStats", "DecodeTransfers", "PrefillDone", "PrefillOrder", "stage_prefilled"]


@dataclass(frozen=True, slots=True)
class PrefillOrder:
    """Decode -> prefill: compute `prompt`, stage positions `start ..` into `staging`."""

    request_id: str
    prompt: tuple[int, ...]
    start: int
    staging: tuple[int, ...]
    dst_slots: tuple[int, ...]  # the decode slots the pages will land in (for fault journals)
    sampling: SamplingSpec
    decode_step: int
    # a sender-side self-test fault may hit this order: the decode side will land it (it is not
    # to be aborted meanwhile), so a firing is never wasted on a discarded completion
    may_fault: bool = True


@dataclass(frozen=True, slots=True)
class PrefillDone:
    """Prefill -> decode: the pages are staged; `records` is `SidecarRecords.to_bytes()` (None
    without a canary); `fault` names a sender-side self-test fault that fired."""

    request_id: str
    first_token: int
    records: bytes | None
    fault: tuple[str, str] | None = None


def stage_prefilled(
    pool: KvPool,
    sidecars: SidecarTransfer,
    staging: KvStaging,
    order: PrefillOrder,
    slots: list[int],
    first_token: int,
    faults: TransferFaults | None = None,
) -> PrefillDone:
    """Prefill side: stage the KV and sidecars of `slots[order.start:]` (the request's prompt
    slots in this pool) into the order's staging pages."""
    start, prompt = order.start, order.prompt
    src = slots[start:]
    fault = None
    if (
        faults is not None
        and order.may_fault
        and faults.armed("contiguous_block_ids")
        and sidecars.carries_sidecars
    ):
        # the sender reads block `src[0] + j` for page j, as a connector assuming contiguous ids
        assumed = [src[0] + j for j in range(len(src))]
        if assumed != src and assumed[-1] < pool.num_slots:
            got = sidecars.export_sidecars(group="full", slots=assumed)
            want = sidecars.export_sidecars(group="full", slots=src)
            assert got is not None and want is not None
            if got.tail != want.tail:
                src = assumed
                faults.record("contiguous_block_ids", (), (), "sender side")  # counts the firing
                fault = ("contiguous_block_ids", f"sender read slots {assumed[0]}..{assumed[-1]} "
                         f"as contiguous; the request's slots were {slots[start:]}")  # fmt: skip
    kv = read_pages(pool, sidecars, src, start, prompt[start:])
    staging.write(list(order.staging), kv)
    records = kv.records.to_bytes() if kv.records is not None else None
    return PrefillDone(order.request_id, first_token, records, fault)


@dataclass(slots=True)
class _InFlight:
    req: Request
    matched: int
    slots: list[int]  # decode slots of positions matched ..
    staging: list[int]


@dataclass(slots=True)
class DecodeStats:
    """Counters of the decode side."""

    transfers: int = 0
    landed_tokens: int = 0
    cached_tokens: int = 0
    rejected: int = 0
    aborted_in_flight: int = 0
    late_completions: int = 0
    late_landings_unread: int = 0  # late_landing firings dropped unread (`engine.late_watch`)
    rejected_requests: list[str] = field(default_factory=list)  # whose landing failed verify


_LATE_PATIENCE = 64  # steps a late completion waits for its old slots to be reallocated


class DecodeTransfers:
    """The decode side's transfers in flight, over its scheduler and pool."""

    def __init__(
        self,
        scheduler: Scheduler,
        pool: KvPool,
        sidecars: SidecarTransfer,
        staging: KvStaging,
        faults: TransferFaults | None = None,
    ) -> None:
        """Reserve from `scheduler`, land into `pool`, verify through `sidecars`."""
        self._scheduler = scheduler
        self._pool = pool
        self._sidecars = sidecars
        self._staging = staging
        self._pages = StagingPages(staging.num_pages)
        self._faults = faults
        self._in_flight: dict[str, _InFlight] = {}
        self._cancelled: dict[str, _InFlight] = {}
        self._late: list[tuple[_InFlight, KvPages, int]] = []
        self._watch: LateWatch | None = None
        self.stats = DecodeStats()

    @property
    def busy(self) -> bool:
        """Whether a transfer (or the completion of an aborted one) is outstanding."""
        return bool(self._in_flight or self._cancelled)

    def in_flight(self, request_id: str) -> bool:
        """Whether `request_id` is waiting for its KV."""
        return request_id in self._in_flight

    def begin(
        self, request_id: str, prompt: tuple[int, ...], max_new_tokens: int,
        sampling: SamplingSpec, step: int, *, may_fault: bool = True,
    ) -> PrefillOrder | None:  # fmt: skip
        """Reserve for a new request and return the order to send; None when the decode side
        has no row, slots or staging pages for it now (retry later). `may_fault`: whether a
        sender-side self-test fault may pick this order (False for one due to be aborted)."""
        if self._pages.num_free < len(prompt):
            return None
        got = self._scheduler.begin_transfer(request_id, prompt, max_new_tokens, sampling)
        if got is None:
            return None
        req, matched = got
        slots = req.slots[matched:]
        pages = self._pages.alloc(len(slots))
        assert pages is not None
        self._in_flight[request_id] = _InFlight(req, matched, list(slots), pages)
        self.stats.transfers += 1
        self.stats.cached_tokens += matched
        return PrefillOrder(request_id, prompt, matched, tuple(pages), tuple(slots), sampling, step,
                            may_fault)  # fmt: skip

    def abort(self, request_id: str) -> bool:
        """Abort a request whose KV is in flight: free its reservation now (the staging pages
        stay reserved until the prefill side's answer arrives, and that answer is discarded).
        False when it is not in flight."""
        entry = self._in_flight.pop(request_id, None)
        if entry is None:
            return False
        self._scheduler.cancel_transfer(entry.req, aborted=True)
        if self._faults is not None and self._faults.armed("late_landing"):
            # an allocator that hands the freshest pages out first (many do) reuses them at once
            self._scheduler.kv.allocator.reuse_first(entry.slots)
        self._cancelled[request_id] = entry
        self.stats.aborted_in_flight += 1
        return True

    def complete(self, done: PrefillDone) -> str:
        """Land a finished prefill: `landed`, `finished` (its first token was its last),
        `rejected` (verify failed: prefilled locally instead) or `discarded` (aborted meanwhile)."""
        records = SidecarRecords.from_bytes(done.records) if done.records is not None else None
        late = self._cancelled.pop(done.request_id, None)
        if late is not None:
            m = late.matched
            kv = self._staging.read(
                late.staging, start=m, tokens=late.req.prompt[m:], records=records
            )
            self._pages.free(late.staging)
            self.stats.late_completions += 1
            if (
                self._faults is not None
                and records is not None
                and self._faults.armed("late_landing")
            ):
                self._late.append((late, kv, _LATE_PATIENCE))
                self.tick()
            return "discarded"
        entry = self._in_flight.pop(done.request_id)
        req, m = entry.req, entry.matched
        kv = self._staging.read(entry.staging, start=m, tokens=req.prompt[m:], records=records)
        self._pages.free(entry.staging)
        if done.fault is not None and self._faults is not None:
            name, note = done.fault
            self._faults.record(name, entry.slots, range(m, len(req.prompt)), note)
        prev = req.slots[m - 1] if m > 0 else -1
        bad = land_pages(self._pool, self._sidecars, entry.slots, kv, prev_slot=prev,
                         faults=self._faults)  # fmt: skip
        if bad:
            self._scheduler.cancel_transfer(req, aborted=False)
            self.stats.rejected += 1
            self.stats.rejected_requests.append(req.request_id)
            return "rejected"
        self.stats.landed_tokens += len(entry.slots)
        return "finished" if self._scheduler.finish_transfer(req, done.first_token) else "landed"

    def tick(self, ran: Collection[str] = ()) -> None:
        """Once per step, before the forward: `late_landing` writes a discarded completion into
        its old slots as soon as another holder has them (reallocated and written since the
        abort); a completion still unplaced after a while is dropped. A landing its holders
        dropped before any forward read it is taken back (`engine.late_watch`); `ran` names the
        requests whose chunk the last forward ran."""
        if self._watch is not None and self._faults is not None:
            cached = {s for s, _, _ in self._scheduler.prefix_cache.walk()}
            verdict = self._watch.settle(self._scheduler.running, cached, ran,
                                         self._scheduler.kv.allocator.allocations)  # fmt: skip
            if verdict == "unread":
                self._faults.unrecord(self._watch.record)
                self.stats.late_landings_unread += 1
            if verdict is not None:
                self._watch = None
        keep = []
        for late, kv, patience in self._late:
            if not self._land_late(late, kv) and patience > 1:
                keep.append((late, kv, patience - 1))
        self._late = keep

    def _land_late(self, late: _InFlight, kv: KvPages) -> bool:
        faults = self._faults
        if faults is None or not faults.armed("late_landing"):
            return False
        reserved = {s for e in self._in_flight.values() for s in e.slots}
        # only slots a new holder has already written: a slot it is still to write would hide
        # the late bytes (its own write comes after), so the damage would never be readable
        written = self._written_slots()
        held = [j for j, s in enumerate(late.slots) if s in written and s not in reserved]
        if not held:
            return False
        m = late.matched
        pick = [late.slots[j] for j in held]
        write_pages(self._pool, self._sidecars, pick, _subset(kv, held))
        successors, after = self._successors(set(pick))
        owners = [r for r in self._scheduler.running
                  if not set(pick).isdisjoint(r.slots[: r.num_computed])]  # fmt: skip
        holders = sorted(r.request_id for r in owners)
        rec = faults.record("late_landing", [*pick, *successors], [*(m + j for j in held), *after],
                            f"transfer of aborted {late.req.request_id!r} landed after its slots "
                            f"were freed and reallocated ({len(pick)} slots, held by "
                            f"{', '.join(map(repr, holders)) or 'the prefix cache only'})")  # fmt: skip
        if owners:
            allocs = self._scheduler.kv.allocator.allocations
            self._watch = LateWatch.of(rec, {s: allocs(s) for s in pick}, owners,
                                       self._scheduler.running)  # fmt: skip
        return True

    def _written_slots(self) -> set[int]:
        """Slots whose KV a holder has written: the prefix cache and running requests' computed
        positions."""
        out = {s for s, _, _ in self._scheduler.prefix_cache.walk()}
        for req in self._scheduler.running:
            out.update(req.slots[: req.num_computed])
        return out

    def _successors(self, slots: set[int]) -> tuple[list[int], list[int]]:
        """Where the damage shows next: slots whose predecessor (in a running request or the
        prefix cache) is in `slots`, and the positions right after the holders' positions of
        `slots` (a holder's next write seeds from a damaged slot and fails the chain-position
        assert there, in a slot that does not exist yet)."""
        out, after = set(), set()
        for s, pos, prev in self._scheduler.prefix_cache.walk():
            if prev in slots:
                out.add(s)
            if s in slots:
                after.add(pos + 1)
        for req in self._scheduler.running:
            for p, s in enumerate(req.slots):
                if s in slots:
                    after.add(p + 1)
                    if p + 1 < len(req.slots):
                        out.add(req.slots[p + 1])
        return sorted(out - slots), sorted(after)


def _subset(kv: KvPages, rows: list[int]) -> KvPages:
    """Pages `rows` of `kv` (the records in the same order)."""
    import torch

    idx = torch.tensor(rows, dtype=torch.int64)
    recs = None
    if kv.records is not None:
        parts = [kv.records.slice(j, j + 1) for j in rows]
        recs = SidecarRecords(kv.records.group, kv.records.halves,
                              tuple(b"".join(p.head[h] for p in parts) for h in range(len(kv.records.halves))),
                              tuple(b"".join(p.tail[h] for p in parts) for h in range(len(kv.records.halves))))  # fmt: skip
    return KvPages(kv.k[:, idx], kv.v[:, idx], recs, kv.start, tuple(kv.tokens[j] for j in rows))
