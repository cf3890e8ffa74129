"""Mode `recover` across a prefill and a decode process (SPEC §14.3, §14.4): a bad landing is
a miss that only its own request pays for (prefilled locally instead), and a late landing into
reallocated slots recomputes only the request that holds them; no request fails and every
output equals the no-cache reference. Log mode on the same case delivers a corrupted output, so
the comparison can fail."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from kvcanary.app.disagg import DisaggResult, serve_disaggregated
from kvcanary.app.reference import ReferenceOutputs
from kvcanary.app.selftest.transfers import disagg_options, disagg_settings
from kvcanary.app.session import RunSettings
from kvcanary.app.workload import build_workload
from kvcanary.canary import CanaryMode
from kvcanary.engine.transfer_faults import DISAGG_FAULTS

pytestmark = pytest.mark.slow


def _serve(fault: str, seed: int, model: str, mode: CanaryMode) -> tuple[DisaggResult, bool]:
    base = disagg_settings(seed, 24)
    settings: RunSettings = replace(base, model_kind=model,
                                    canary=replace(base.canary, mode=mode))  # fmt: skip
    result = serve_disaggregated(settings, disagg_options(fault, seed))
    check = ReferenceOutputs(settings).check(build_workload(settings.workload), result.outputs)
    return result, check.identical


def test_recover_recomputes_only_the_holder_of_a_late_landing() -> None:
    result, identical = _serve("late_landing", 0, "tiny", CanaryMode.RECOVER)
    (firing,) = result.journal
    holders = re.findall(r"'(req-\d+)'", firing.description.split("held by")[1])
    assert len(holders) == 1
    f = result.figures
    assert f["recomputed_requests"] == holders and f["recoveries"] == 1
    assert f["rejected_landing_requests"] == [] and f["requests_failed"] == 0
    assert identical
    # the same case in log mode: the holder decodes over the aborted request's KV
    _, log_identical = _serve("late_landing", 0, "tiny", CanaryMode.LOG)
    assert not log_identical


@pytest.mark.parametrize("fault", [f for f in DISAGG_FAULTS if f != "late_landing"])
def test_recover_a_bad_landing_is_prefilled_locally_for_its_request_only(fault: str) -> None:
    result, identical = _serve(fault, 0, "oracle", CanaryMode.RECOVER)
    assert len(result.journal) == 1
    f = result.figures
    assert len(f["rejected_landing_requests"]) == 1 and f["incidents"] >= 1
    assert f["recomputed_requests"] == [] and f["requests_failed"] == 0
    assert identical and f["violations"] > 0


def test_a_late_landing_dropped_unread_is_taken_back_and_fires_again() -> None:
    """Tiny model, seed 6: the first late landing's holder is retracted in the landing's own
    step, so no forward ever reads the landed bytes; that firing leaves the journal (it could
    not be observed) and the fault fires again on a later abort, where it is caught."""
    result, identical = _serve("late_landing", 6, "tiny", CanaryMode.RECOVER)
    f = result.figures
    assert f["late_landings_unread"] == 1
    (firing,) = result.journal
    holders = re.findall(r"'(req-\d+)'", firing.description.split("held by")[1])
    assert f["incidents"] > 0 and set(f["recomputed_requests"]) <= set(holders)
    assert f["requests_failed"] == 0 and identical
