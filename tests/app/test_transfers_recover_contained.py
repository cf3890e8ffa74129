"""`RecoverCase.contained`: the damage of a transfer fault stays with the request it hit."""

from __future__ import annotations

from dataclasses import replace

from kvcanary.app.selftest.transfers_recover import RecoverCase

LATE = RecoverCase("late_landing", "disagg", 0, firings=1, incidents=2, rejected=0,
                   recomputed=("req-5",), failed=(), holders=("req-5",), outputs_identical=True)  # fmt: skip
LANDING = RecoverCase("wrong_slots", "host", 0, firings=1, incidents=2, rejected=1,
                      recomputed=(), failed=(), holders=(), outputs_identical=True)  # fmt: skip
CLEAN = RecoverCase("clean", "disagg", 0, firings=0, incidents=0, rejected=0, recomputed=(),
                    failed=(), holders=(), outputs_identical=True)  # fmt: skip


def test_contained_cases() -> None:
    assert LATE.contained and LANDING.contained and CLEAN.contained
    # failing the holder (its retry budget spent) is allowed too
    assert replace(LATE, recomputed=(), failed=("req-5",)).contained


def test_damage_charged_to_another_request_is_not_contained() -> None:
    assert not replace(LATE, recomputed=("req-5", "req-6")).contained
    assert not replace(LANDING, recomputed=("req-2",)).contained
    assert not replace(LANDING, failed=("req-2",)).contained


def test_wrong_outputs_missed_faults_and_noisy_baselines_are_not_contained() -> None:
    assert not replace(LATE, outputs_identical=False).contained
    assert not replace(LANDING, rejected=0).contained
    assert not replace(LANDING, incidents=0).contained
    assert not replace(CLEAN, incidents=1).contained
    assert not replace(CLEAN, rejected=1).contained
    assert "--kv-canary recover --places host --modes wrong_slots" in LANDING.replay
