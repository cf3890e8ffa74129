"""Mode `recover` (SPEC §14.3): incidents, their attribution to view rows, and a ring that never
goes silent after it fills."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from kvcanary.canary import CanaryMode
from kvcanary.contract import ExpectedInputs, FailReason, LaunchTag, TokenOracle
from tests.canary.conftest import MakeCanary, forward


def test_log_mode_makes_no_incidents(make_canary: MakeCanary) -> None:
    pool, canary = make_canary()
    forward(pool, canary, pool.view([(1, [1, 2])]))
    pool.k[1, 0] ^= 1
    forward(pool, canary, pool.view([(1, [3])]))
    assert canary.total_violations == 1 and canary.take_incidents() == []


def test_clean_recover_run_has_no_incidents(make_canary: MakeCanary) -> None:
    pool, canary = make_canary(mode=CanaryMode.RECOVER)
    forward(pool, canary, pool.view([(1, [1, 2, 3]), (2, [4, 5])]))
    forward(pool, canary, pool.view([(1, [6]), (2, [7])]))
    assert canary.total_violations == 0 and canary.take_incidents() == []


def test_verify_row_belongs_to_the_row_whose_plan_failed(make_canary: MakeCanary) -> None:
    pool, canary = make_canary(mode=CanaryMode.RECOVER)
    forward(pool, canary, pool.view([(1, [1, 2, 3]), (2, [4, 5, 6])]))
    bad = int(pool.r2t[2, 1])
    pool.k[bad, 0] ^= 1  # real-KV corruption of row 2, position 1
    view = pool.view([(1, [7]), (2, [8])])
    canary.pre_forward(view=view)
    assert canary.take_incidents() == []  # HEAD has no sources
    pool.write_kv(view)
    canary.post_forward(view=view)  # does not raise
    [incident] = canary.take_incidents()
    assert (incident.stage, incident.tag, incident.step) == ("tail", LaunchTag.TAIL_K_FULL, 1)
    assert incident.slots == (bad,) and incident.reasons == ["verify_real_kv_hash"]
    [row] = incident.rows
    assert (row.view_row, row.req_row, row.first_position, row.slots) == (1, 2, 1, (bad,))
    assert canary.take_incidents() == []  # taken once


def test_shared_slot_is_charged_only_to_the_reader_it_fails_for(make_canary: MakeCanary) -> None:
    """A stale prefix: row 2's table points at row 1's slot at the wrong position."""
    pool, canary = make_canary(mode=CanaryMode.RECOVER, read_bytes=None)
    forward(pool, canary, pool.view([(1, [1, 2, 3]), (2, [1, 2, 3])]))
    owner = int(pool.r2t[1, 2])
    pool.r2t[2, 1] = owner  # row 2 position 1 -> row 1's position-2 slot
    canary.pre_forward(view=pool.view([(1, [9]), (2, [9])]))
    incidents = canary.take_incidents()
    assert incidents and {i.stage for i in incidents} == {"head"}
    rows = {(r.view_row, r.first_position) for i in incidents for r in i.rows}
    assert rows == {(1, 1)}  # the reader only; row 1 verifies its own slot clean


def test_write_rows_belong_to_their_write_entry(make_canary: MakeCanary) -> None:
    pool, canary = make_canary(mode=CanaryMode.RECOVER, read_bytes=None)
    canary.mark_init_finished()
    forward(pool, canary, pool.view([(1, [1, 2]), (2, [3, 4])]))
    view = pool.view([(1, [5]), (2, [6, 7])])
    view.positions[2] += 1  # row 2's second entry (position 3) written one late
    canary.pre_forward(view=view)
    [incident] = canary.take_incidents()
    assert incident.reasons == ["write_position"]
    [row] = incident.rows
    assert (row.view_row, row.first_position) == (1, 3)
    assert row.slots == (int(view.out_slots[2]),)


def test_write_token_rows_are_marked_as_a_bad_input(make_canary: MakeCanary) -> None:
    oracle = TokenOracle(64)
    pool, canary = make_canary(
        mode=CanaryMode.RECOVER, read_bytes=None, oracle=oracle, enable_write_input_assert=True
    )
    view = pool.view([(1, [1, 2, 3])])
    expected = view.input_ids.clone()
    expected[1] += 1
    view = dataclasses.replace(
        view, expected_inputs=ExpectedInputs(tokens=expected, positions=view.positions.clone())
    )
    canary.pre_forward(view=view)
    [incident] = canary.take_incidents()
    [row] = incident.rows
    assert row.first_position == 1 and row.bad_input_token
    assert row.fail_reason_bits & FailReason.WRITE_TOKEN_MISMATCH


def test_sweep_incident_names_slots_and_no_request(make_canary: MakeCanary) -> None:
    pool, canary = make_canary(mode=CanaryMode.RECOVER, sweep_interval=1)
    forward(pool, canary, pool.view([(1, [1, 2, 3])]))
    cached = [int(s) for s in pool.r2t[1, :3]]

    class Walker:
        def walk(self, *, unlocked_only: bool = False, swa_resident_only: bool = False):  # type: ignore[no-untyped-def]
            return [(s, p, cached[p - 1] if p else -1) for p, s in enumerate(cached)]

    canary.attach_prefix_cache(walker=Walker())
    pool.k[cached[1], 3] ^= 0x10
    canary.end_step()
    [incident] = canary.take_incidents()
    assert incident.stage == "sweep" and incident.rows == ()
    assert incident.slots == (cached[1],) and incident.tag == LaunchTag.SWEEP_K_FULL


def test_incidents_do_not_depend_on_the_ring_having_room(
    make_canary: MakeCanary, caplog: pytest.LogCaptureFixture
) -> None:
    pool, canary = make_canary(mode=CanaryMode.RECOVER, ring_capacity=1, read_bytes=None)
    forward(pool, canary, pool.view([(1, [1, 2, 3]), (2, [4, 5, 6])]))
    canary.group("full").buffer("head", "k")[:] = 0  # every HEAD record gone
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        canary.pre_forward(view=pool.view([(1, [7]), (2, [8])]))
    [incident] = canary.take_incidents()
    assert incident.violations == 6 and [r.first_position for r in incident.rows] == [0, 0]
    assert canary.total_violations == 6 and len(canary.drain_violations()) == 1
    summary = [m for m in caplog.messages if "not kept by the full ring" in m]
    assert summary == [
        "kv-canary: 5 further violations not kept by the full ring (capacity=1) up to step=1, "
        "total=6: HEAD_K_FULL/verify_chain_hash=1, HEAD_K_FULL/verify_position=4, "
        "HEAD_K_FULL/verify_token=5"
    ]


def test_dropped_rows_are_summarised_at_most_once_per_step(
    make_canary: MakeCanary, caplog: pytest.LogCaptureFixture
) -> None:
    pool, canary = make_canary(ring_capacity=1, read_bytes=None)
    forward(pool, canary, pool.view([(1, [1, 2, 3])]))
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        for token in (4, 5, 6):
            canary.group("full").buffer("head", "k")[:] = 0
            canary.group("full").buffer("tail", "k")[:] = 0
            forward(pool, canary, pool.view([(1, [token])]))
    lines = [m for m in caplog.messages if "not kept by the full ring" in m]
    # three steps with dropped rows in HEAD and TAIL: one line per step, counters keep counting
    assert len(lines) == 3
    assert canary.total_violations == 3 + 4 + 5 + 3 + 4 + 5


def test_recover_turns_on_the_verify_token_assert(make_canary: MakeCanary) -> None:
    pool, canary = make_canary(mode=CanaryMode.RECOVER, read_bytes=None)
    forward(pool, canary, pool.view([(1, [1, 2, 3])]))
    slot = int(pool.r2t[1, 1])
    for stage in ("head", "tail"):
        words = canary.group("full").buffer(stage, "k").view(np.int64)
        words[slot, 0] = 99  # TOKEN field only
    canary.pre_forward(view=pool.view([(1, [4])]))
    [incident] = canary.take_incidents()
    assert "verify_token" in incident.reasons
    assert [r.first_position for r in incident.rows] == [1]


@pytest.mark.parametrize("make_canary", ["fast"], indirect=True)
def test_recover_never_raises_and_keeps_counting(make_canary: MakeCanary) -> None:
    """Ten thousand violations in every stage, a stalled-looking history, 200 steps: no raise."""
    from tests.canary.handpool import HandPool

    n = 10_000
    pool, canary = make_canary(
        pool=HandPool(num_slots=n + 8, num_rows=2, max_len=n + 4), mode=CanaryMode.RECOVER,
        ring_capacity=16, read_bytes=None, sweep_interval=1,
    )  # fmt: skip
    canary.mark_init_finished()
    forward(pool, canary, pool.view([(1, list(range(n)))]))
    for stage in ("head", "tail"):
        canary.group("full").buffer(stage, "k")[:] = 0
    view = pool.view([(1, [1])])
    view.positions[0] += 5  # a chain-position row too
    forward(pool, canary, view)  # HEAD, TAIL and end_step all report; none raises
    for _ in range(200):
        canary.end_step()  # health checks at steps 100 and 200 log, never raise
    incidents = canary.take_incidents()
    assert {i.stage for i in incidents} == {"head", "tail"}
    assert sum(i.violations for i in incidents) == canary.total_violations > 2 * n
    rows = [r for i in incidents for r in i.rows]
    assert {r.view_row for r in rows} == {0}
    assert min(r.first_position for r in rows) == 0  # verify rows: the whole history
    assert any(r.first_position == n and r.fail_reason_bits == 16 for r in rows)  # the write
