"""1:1 correlation rules of the self-test."""

from __future__ import annotations

from kvcanary.app.selftest.correlate import Fault, correlate
from kvcanary.contract import Violation


def row(step: int, slot: int, position: int = 0, tag: int = 2, bits: int = 4) -> Violation:
    return Violation(kernel_kind=tag, slot_idx=slot, position=position, stored_token=0, expected_token=-1,
                     stored_chain_hash=0, expected_aux=0, fail_reason_bits=bits, step_when_pumped=step,
                     message="")  # fmt: skip


def test_rows_go_to_the_most_recent_claiming_fault_and_latency_counts() -> None:
    a = Fault("a", 3, "full", frozenset({10}), 1)
    b = Fault("b", 5, "full", frozenset({10, 11}), 1)
    c = correlate([a, b], [row(3, 10), row(5, 10), row(6, 11)])
    assert [len(r) for r in c.rows_per_fault] == [1, 2]
    assert c.latencies == (0, 0) and c.caught == 2 and c.one_to_one


def test_unclaimed_rows_are_false_alarms_and_late_rows_miss() -> None:
    f = Fault("a", 3, "full", frozenset({10}), 1)
    c = correlate([f], [row(2, 10), row(6, 10), row(6, 99)])
    assert len(c.false_alarms) == 2  # before the fault, and at an unrelated slot
    assert c.latencies == (3,) and c.missed == 1 and not c.one_to_one


def test_group_and_position_claims() -> None:
    f = Fault("swap", 4, "full", frozenset(), 1, positions=frozenset({7}))
    swa_row = row(4, 1, position=7, tag=8)  # TAIL_K_SWA: another group
    c = correlate([f], [row(5, 123, position=7, bits=8), swa_row])
    assert c.caught == 1 and c.false_alarms == (swa_row,)


def test_plant_cascades_and_follow_ups() -> None:
    f = Fault("plant", 10, "full", frozenset({5}), 2, follow_steps=(20,))
    c = correlate([f], [row(21, 5), row(22, 77)], cascades=True)
    assert c.latencies == (1,) and c.caught == 1  # measured from the follow-up at step 20
    assert len(c.cascades) == 1 and not c.false_alarms and c.one_to_one


def test_no_fault_is_not_one_to_one() -> None:
    assert not correlate([], []).one_to_one
