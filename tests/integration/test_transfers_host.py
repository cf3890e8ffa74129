"""Host tier (SPEC §14.4): clean runs with aborts are silent and match the no-cache reference;
every host-tier transfer fault is caught 1:1 in the step of the restore."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from kvcanary.app.host_tier import attach_host_tier, check_outputs
from kvcanary.app.selftest.transfers import (
    TRANSFER_EXPECTED_REASONS,
    host_settings,
    run_host_case,
)
from kvcanary.app.session import build_stack, run_session
from kvcanary.app.workload import build_workload
from kvcanary.canary import CanaryMode
from kvcanary.engine.transfer_faults import HOST_FAULTS
from tests.integration.stacks import canary_config

SEEDS = (0, 1, 2)


@pytest.fixture(autouse=True)
def _quiet() -> None:
    logging.getLogger("kvcanary").setLevel(logging.ERROR)


@pytest.mark.parametrize("model", ["tiny", "oracle"])
def test_clean_host_tier_run_restores_and_matches_reference(model: str) -> None:
    base = host_settings(seed=3, requests=40 if model == "tiny" else 120)
    settings = replace(base, model_kind=model)
    stack = build_stack(settings)
    host = attach_host_tier(stack, 512)
    summary = run_session(settings, stack=stack)
    assert summary.figures["violations"] == 0, [v.message for v in summary.violations[:3]]
    assert summary.figures["requests_aborted"] > 0
    assert host.stats.restores > 0 and host.stats.rejected_restores == 0
    check = check_outputs(stack, build_workload(settings.workload))
    assert check.compared > 0 and check.identical, check.mismatched
    stack.engine.scheduler.check_integrity()


def test_host_tier_without_canary_still_serves_correctly() -> None:
    base = host_settings(seed=4, requests=60)
    settings = replace(base, canary=canary_config(mode=CanaryMode.NONE))
    stack = build_stack(settings)
    assert stack.canary is None
    host = attach_host_tier(stack, 512)
    run_session(settings, stack=stack)
    assert host.stats.restores > 0
    assert check_outputs(stack, build_workload(settings.workload)).identical


@pytest.mark.parametrize("seed", SEEDS)
def test_clean_baseline_is_silent(seed: int) -> None:
    case = run_host_case(None, seed, 24)
    assert case.violations == 0 and case.outputs_identical


@pytest.mark.parametrize("fault", HOST_FAULTS)
@pytest.mark.parametrize("seed", SEEDS)
def test_host_fault_caught_one_to_one(fault: str, seed: int) -> None:
    case = run_host_case(fault, seed, 24)
    c = case.correlation
    assert len(c.faults) == 1 and c.one_to_one, (c.faults, c.false_alarms[:3])
    assert c.latencies == (0,)  # verified before the first forward that reads the pages
    assert c.reasons_seen & TRANSFER_EXPECTED_REASONS[fault]
    assert case.outputs_identical  # a failed restore is a miss: the request recomputes
