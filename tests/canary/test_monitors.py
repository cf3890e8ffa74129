"""Sweep cadence, health checker, stats line, overflow warner and counters (SPEC §8, §9)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import pytest

from kvcanary.canary import CanaryHealthError, CanaryMode
from kvcanary.contract import LaunchTag, walk_node_slots
from tests.canary.conftest import MakeCanary, forward
from tests.canary.handpool import HandPool


class ListWalker:
    """A one-node-per-request prefix cache over HandPool rows."""

    def __init__(self, pool: HandPool, rows: list[int]) -> None:
        self.pool, self.rows = pool, rows

    def walk(
        self, *, unlocked_only: bool = False, swa_resident_only: bool = False
    ) -> Iterable[tuple[int, int, int]]:
        for row in self.rows:
            yield from walk_node_slots(self.pool.r2t[row, : self.pool.lengths[row]].tolist(), 0, -1)


def test_walker_positions_and_prev() -> None:
    assert list(walk_node_slots([4, 9], 3, 7)) == [(4, 3, 7), (9, 4, 4)]


def test_sweep_cadence_interval_four(
    make_canary: MakeCanary, caplog: pytest.LogCaptureFixture
) -> None:
    pool, canary = make_canary(sweep_interval=4)
    canary.attach_prefix_cache(walker=ListWalker(pool, []))
    swept = []
    for step in range(12):
        before = canary.sweep_passes
        canary.end_step()
        if canary.sweep_passes > before:
            swept.append(step)
    assert swept == [0, 4, 8]


def test_no_sweep_without_walker_or_interval(make_canary: MakeCanary) -> None:
    _, canary = make_canary(sweep_interval=3)
    for _ in range(5):
        canary.end_step()
    assert canary.sweep_passes == 0


def test_sweep_catches_a_flip_in_an_untouched_cached_slot(
    make_canary: MakeCanary, caplog: pytest.LogCaptureFixture
) -> None:
    pool, canary = make_canary(sweep_interval=1)
    forward(pool, canary, pool.view([(1, [5, 6, 7])]))
    canary.attach_prefix_cache(walker=ListWalker(pool, [1]))
    slot = int(pool.r2t[1, 1])
    pool.k[slot, 0] ^= 0xFF
    # the sweep line's own logger (a vLLM plugin loaded by an earlier test may have quieted it)
    with (caplog.at_level(logging.INFO, logger="kvcanary"),
          caplog.at_level(logging.INFO, logger="kvcanary.sweep")):  # fmt: skip
        canary.end_step()
    [v] = canary.drain_violations()
    assert (v.tag, v.slot_idx, v.fail_reason_bits) == (LaunchTag.SWEEP_K_FULL, slot, 4)
    assert "canary_kind:       sweep_k_full" in v.message
    [line] = [r for r in caplog.records if r.getMessage().startswith("[canary] sweep pass=")]
    assert line.getMessage() == "[canary] sweep pass=1 step=1 entries=3"
    assert (line.name, line.levelno) == ("kvcanary.sweep", logging.INFO)


def test_health_check_raise_and_log(
    make_canary: MakeCanary, caplog: pytest.LogCaptureFixture
) -> None:
    for mode in (CanaryMode.RAISE, CanaryMode.LOG):
        pool, canary = make_canary(mode=mode, pool=HandPool(num_slots=256, max_len=256))
        for _ in range(101):
            forward(pool, canary, pool.view([(1, [1])]))  # steps 0..100: the check at 100 passes
        canary._run_stage = lambda stage, snap, plans: None  # type: ignore[method-assign]  # the canary path stops
        for _ in range(99):
            forward(pool, canary, pool.view([(1, [1])]))
        message = ("kv-canary: kernel_run_counter did not increase since previous check for "
                   "tags=[HEAD_K_FULL, TAIL_K_FULL] at step=200; canary path is not executing")  # fmt: skip
        if mode is CanaryMode.RAISE:
            with pytest.raises(CanaryHealthError) as err:
                forward(pool, canary, pool.view([(1, [1])]))
            assert str(err.value) == message
        else:
            with caplog.at_level(logging.ERROR, logger="kvcanary"):
                forward(pool, canary, pool.view([(1, [1])]))
            assert message in [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]


def test_stats_line(make_canary: MakeCanary, caplog: pytest.LogCaptureFixture) -> None:
    pool, canary = make_canary(stats_print_every_n_steps=2)
    with caplog.at_level(logging.INFO, logger="kvcanary"):
        for _ in range(5):
            forward(pool, canary, pool.view([(1, [1])]))
    lines = [m for m in caplog.messages if m.startswith("[canary] step=")]
    # per stage: verify 0+1+2 entries and 3 writes by step 2; verify 0..4 and 5 writes by step 4
    assert lines == [
        "[canary] step=2 protected_tokens=12 sweep_passes=0 violations=0 launch_tags_active=2/12",
        "[canary] step=4 protected_tokens=30 sweep_passes=0 violations=0 launch_tags_active=2/12",
    ]


def test_overflow_skips_verify_keeps_writing_and_recovers(
    make_canary: MakeCanary, caplog: pytest.LogCaptureFixture
) -> None:
    pool, canary = make_canary(pool=HandPool(num_slots=64, num_rows=4), caps={"pool_slot_count": 2})
    forward(pool, canary, pool.view([(1, [1, 2, 3, 4, 5, 6, 7])]))
    runs = dict(canary.kernel_run_counter)
    canary.group("full").buffer("head", "k")[:] = 0
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        forward(pool, canary, pool.view([(1, [8])]))  # 7 verify entries > capacity 6
    assert ("kv-canary: per-forward verify skipped this step due to overflow (total=7, capacity=6); "
            "check ServerArgs / pool sizing") in caplog.messages  # fmt: skip
    assert canary.total_violations == 0
    assert canary.kernel_run_counter[LaunchTag.HEAD_K_FULL] == runs[LaunchTag.HEAD_K_FULL] + 2
    forward(pool, canary, pool.view([(2, [9])]))  # small forward verifies again: clean
    assert canary.total_violations == 0


def test_slot_minus_one_and_slot_zero_counting(make_canary: MakeCanary) -> None:
    pool, canary = make_canary()
    view = pool.view([(1, [1, 2, 3])])
    view.out_slots[1] = -1  # no write, no chain advance, not counted
    forward(pool, canary, view)
    assert canary.slot_run_counter[LaunchTag.HEAD_K_FULL] == 2
    pool.r2t[1, 1] = 0  # an entry of 0 is skipped (counted) and so is its successor's chain check
    forward(pool, canary, pool.view([(1, [4])]))
    assert canary.slot_run_counter[LaunchTag.HEAD_K_FULL] == 2 + 3 + 1
    assert canary.total_violations == 0
