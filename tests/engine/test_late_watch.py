"""`engine.late_watch`: a late landing is counted once a forward may have read it, and taken
back only when every landed slot was dropped (freed or handed out again) before any read."""

from __future__ import annotations

from kvcanary.engine.late_watch import LateWatch
from kvcanary.engine.request import Request
from kvcanary.engine.transfer_faults import TransferFaultRecord

REC = TransferFaultRecord("late_landing", 5, (7, 8), (0, 1), "late")


def _req(rid: str, slots: list[int], recoveries: int = 0) -> Request:
    return Request(rid, (1, 2, 3), 4, slots=slots, num_computed=len(slots), recoveries=recoveries)


def _watch(holder: Request) -> LateWatch:
    return LateWatch.of(REC, {7: 1, 8: 1}, [holder], [holder])


def never_again(slot: int) -> int:
    return 1


def test_a_holder_that_runs_reads_the_landing() -> None:
    h = _req("req-5", [7, 8, 9])
    w = _watch(h)
    assert w.settle([h], set(), (), never_again) is None  # still held, not run yet
    assert w.settle([h], set(), {"req-5"}, never_again) == "counted"


def test_a_holder_retracted_unread_takes_the_landing_back() -> None:
    h = _req("req-5", [7, 8, 9])
    assert _watch(h).settle([], set(), (), never_again) == "unread"


def test_slots_handed_out_again_hold_their_new_owner_kv() -> None:
    h = _req("req-5", [7, 8, 9])
    w = _watch(h)
    other = _req("req-6", [7, 8])  # got the freed slots and wrote them
    assert w.settle([other], set(), {"req-6"}, lambda s: 2) == "unread"
    # the same owner with the landed bytes still in place (no new allocation) has read them
    assert _watch(h).settle([other], set(), {"req-6"}, never_again) == "counted"


def test_landed_slots_in_the_prefix_cache_stay_open_and_a_recompute_counts() -> None:
    h = _req("req-5", [7, 8, 9])
    w = _watch(h)
    assert w.settle([], {7}, (), never_again) is None  # cached: a later hit may read it
    assert w.settle([_req("req-9", [3], recoveries=1)], {7}, (), never_again) == "counted"
