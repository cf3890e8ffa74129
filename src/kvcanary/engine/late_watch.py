"""Whether a `late_landing` firing was ever readable (self-test only).

A late landing writes into slots that running requests (the holders) have computed. If every
holder drops those slots before any forward of it reads them (a retraction, an abort), the
landed bytes are never read: the slots go back to the allocator and each next owner writes a
slot before it reads it. Such a firing did no harm and nothing can observe it, so, like a
planted bug's `unread:` firing (`engine.plants`), it is taken out of the journal and its budget
refunded (the fault may fire again). While a landed slot is held (by a request or the prefix
cache) the firing stays open; it is counted once a request is scheduled while holding one (its
forward verifies its computed prefix, the landed slots included) or an incident recomputes a
request after the landing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from kvcanary.engine.request import Request
from kvcanary.engine.transfer_faults import TransferFaultRecord

__all__ = ["LateWatch"]


@dataclass(slots=True)
class LateWatch:
    """One late landing, watched until it was read or dropped unread."""

    record: TransferFaultRecord
    slots: dict[int, int]  # landed slot -> its `SlotAllocator.allocations` at the landing
    holding: frozenset[str]  # requests that held a landed slot at the last check
    recoveries: int  # recomputes of the running requests at the landing, summed

    @classmethod
    def of(cls, record: TransferFaultRecord, slots: dict[int, int], holders: Iterable[Request],
           running: Iterable[Request]) -> LateWatch:  # fmt: skip
        """Watch `record`, which landed in `slots` held by `holders` (of `running`)."""
        return cls(record, dict(slots), frozenset(h.request_id for h in holders),
                   sum(r.recoveries for r in running))  # fmt: skip

    def settle(
        self,
        running: Iterable[Request],
        cached: set[int],
        ran: Collection[str],
        allocations: Callable[[int], int],
    ) -> str | None:
        """`counted` (it was or may have been read), `unread` (dropped before any read), or
        None (not decided yet). Called once per step before the forward; `ran` names the
        requests whose chunk the last forward ran; `allocations` is the allocator's."""
        running = list(running)
        # a landed slot handed out again since holds its new owner's KV, not the landed bytes
        live = {s for s, n in self.slots.items() if allocations(s) == n}
        holding = frozenset(r.request_id for r in running
                            if not live.isdisjoint(r.slots[: r.num_computed]))  # fmt: skip
        # a forward ran a request that held a landed slot before it (a holder) or after it (a
        # prefix hit): it verified its computed prefix, the landed slots included; a recompute
        # since the landing is an incident (in mode recover the reader gave the slots back)
        if not (self.holding | holding).isdisjoint(ran):
            return "counted"
        if sum(r.recoveries for r in running) > self.recoveries:
            return "counted"
        if holding or not live.isdisjoint(cached):
            self.holding = holding
            return None
        return "unread"
