"""Ring, pump, log and raise modes, and the message format (SPEC §7; items 28-34)."""

from __future__ import annotations

import logging

import pytest
import torch

from kvcanary.canary import CanaryMode, CanaryViolationError
from kvcanary.canary.report import canary_kind, format_violation
from kvcanary.contract import fail_reason_labels
from tests.canary.conftest import MakeCanary, forward
from tests.canary.handpool import HandPool

N = 10_000


def test_verify_message_is_exact() -> None:
    row = [2, 17, 3, 42, -1, -5, 0x1234, 6]
    assert format_violation(row, total_violations=3, ring_capacity=2, step_when_pumped=9) == (
        "kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_position+verify_real_kv_hash slot_idx=17 "
        "position=3 stored_token=42 expected_token=-1 stored_chain_hash=0xfffffffffffffffb expected_aux=0x0000000000001234\n"
        "KV cache canary violation detected (kernel_kind=TAIL_K_FULL, slot_idx=17, position=3)\n"
        "canary_kind:       per_forward_tail_k_full\n"
        "  fail_reasons: verify_position verify_real_kv_hash\n"
        "  stored:   token_id=42   position=3 prev_hash=0xfffffffffffffffb\n"
        "  expected: prev_hash=0x0000000000001234\n"
        "  total_violations=3 ring_overflow=True step_when_pumped=9"
    )


def test_write_message_and_kinds() -> None:
    text = format_violation(
        [4, 1, 5, 7, 8, 0, 6, 24], total_violations=1, ring_capacity=4, step_when_pumped=0
    )
    assert text.splitlines()[2] == "canary_kind:       sweep_k_full"
    assert text.splitlines()[4:6] == ["  actual:   token_id=7   position=5 prev_hash=0x0000000000000000",
                                      "  expected: token_id=8   position=6"]  # fmt: skip
    assert canary_kind(0) == "per_forward_head_k_full" and canary_kind(99) == "unknown(99)"
    assert format_violation(
        [99, 1, 1, 1, 1, 1, 1, 0], total_violations=1, ring_capacity=1, step_when_pumped=0
    ).startswith("kv_canary violation: launch_tag=unknown(99) fail_reason=none ")
    assert "+".join(fail_reason_labels(3)) == "verify_chain_hash+verify_position"


def _zeroed_history(
    make_canary: MakeCanary, mode: CanaryMode, ring: int
) -> tuple[HandPool, object]:
    pool, canary = make_canary(
        pool=HandPool(num_slots=N + 8, num_rows=2, max_len=N + 4),
        mode=mode,
        ring_capacity=ring,
        read_bytes=None,
    )
    forward(pool, canary, pool.view([(1, list(range(N)))]))
    canary.group("full").buffer("head", "k")[:] = 0  # every HEAD record of the history is gone
    return pool, canary


@pytest.mark.parametrize("make_canary", ["fast"], indirect=True)
def test_log_mode_ten_thousand_violations(
    make_canary: MakeCanary, caplog: pytest.LogCaptureFixture
) -> None:
    pool, canary = _zeroed_history(make_canary, CanaryMode.LOG, 16)
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        forward(pool, canary, pool.view([(1, [1])]))  # does not raise
    assert canary.total_violations == N and canary.ring.overflowed
    violations = canary.drain_violations()
    assert len(violations) == 16 and [v.slot_idx for v in violations] == list(range(1, 17))
    assert sum("ring full" in m for m in caplog.messages) == 1
    assert (
        "kv-canary: violation ring full (capacity=16); further violation details are dropped, total=10000"
        in caplog.messages
    )
    assert sum(m.startswith("kv_canary violation:") for m in caplog.messages) == 16


@pytest.mark.parametrize("make_canary", ["fast"], indirect=True)
def test_raise_mode_raises_once_in_the_detecting_step(make_canary: MakeCanary) -> None:
    pool, canary = _zeroed_history(make_canary, CanaryMode.RAISE, 8)
    view = pool.view([(1, [1])])
    with pytest.raises(CanaryViolationError) as err:
        canary.pre_forward(view=view)  # HEAD fails before the model runs
    assert isinstance(err.value, RuntimeError)
    assert str(err.value).count("kv_canary violation:") == 8
    assert all(v.step_when_pumped == canary.step for v in canary.drain_violations())
    canary.group("full").buffer("head", "k")[:] = 0
    forward(pool, canary, pool.view([(1, [2])]))  # tripped: logs, never raises again
    assert canary.total_violations > N


def test_fill_once_ring_capacity_two(
    make_canary: MakeCanary, caplog: pytest.LogCaptureFixture
) -> None:
    pool, canary = make_canary(ring_capacity=2, read_bytes=None)
    forward(pool, canary, pool.view([(1, [1, 2, 3, 4, 5])]))
    canary.group("full").buffer("head", "k")[:] = 0
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        forward(pool, canary, pool.view([(1, [6])]))
    violations = canary.drain_violations()
    assert [v.slot_idx for v in violations] == [1, 2]
    assert canary.total_violations == 5 and canary.ring.overflowed
    assert "total_violations=5 ring_overflow=True" in violations[0].message
    assert sum("ring full" in m for m in caplog.messages) == 1


def test_drain_has_its_own_cursor(make_canary: MakeCanary) -> None:
    pool, canary = make_canary()
    forward(pool, canary, pool.view([(1, [1, 2])]))
    pool.k[1, 0] ^= 1
    forward(pool, canary, pool.view([(1, [3])]))
    assert len(canary.drain_violations()) == 1
    assert canary.drain_violations() == []


def test_padding_rows_contribute_nothing(make_canary: MakeCanary) -> None:
    pool, canary = make_canary()
    view = pool.view([(1, [1, 2])], pad_rows=3)
    forward(pool, canary, view)
    assert canary.slot_run_counter[0] == 2  # HEAD_K_FULL: two writes, no verify entries
    assert canary.total_violations == 0
    assert torch.equal(view.rows, torch.tensor([1, 0, 0, 0]))
