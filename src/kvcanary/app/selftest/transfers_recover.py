"""`kvcanary selftest --transfers --kv-canary recover`: a bad landing costs only its request.

The transfer fixtures of `app.selftest.transfers` in mode `recover` (SPEC §14.3, §14.4). A case
is *contained* when no request is delivered with an output different from the no-cache
reference and the damage stays with the request it hit:

- a landing fault (any fault but `late_landing`) makes exactly one landing or restore fail its
  verify; that request is prefilled locally (a miss), and no other request is recomputed;
- `late_landing` writes into slots another request already holds: only the holders the journal
  names may be recomputed (or failed, when their retry budget is spent).

Clean baselines (the same fixtures, no fault) must take no incident at all.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvcanary.app.host_tier import attach_host_tier, check_outputs
from kvcanary.app.reference import ReferenceOutputs
from kvcanary.app.selftest.transfers import (
    HOST_PAGES,
    PLACES,
    disagg_options,
    disagg_settings,
    host_settings,
)
from kvcanary.app.session import RunSettings, build_stack, run_session
from kvcanary.app.workload import build_workload
from kvcanary.canary import CanaryMode
from kvcanary.engine.request import RequestStatus
from kvcanary.engine.transfer_faults import TransferFaultRecord, TransferFaults

__all__ = ["RecoverCase", "run_recover_campaign", "run_recover_case"]


@dataclass(frozen=True, slots=True)
class RecoverCase:
    """One (fault, place, seed) in mode `recover` (`fault` = `clean` for a baseline)."""

    fault: str
    where: str
    seed: int
    firings: int
    incidents: int
    rejected: int  # landings / restores that failed their verify (prefilled locally)
    recomputed: tuple[str, ...]  # requests an incident restarted
    failed: tuple[str, ...]  # requests ended with kv_corruption
    holders: tuple[str, ...]  # late_landing: the requests whose slots it overwrote
    outputs_identical: bool

    @property
    def contained(self) -> bool:
        """Correct outputs, and the damage charged only to the request(s) it hit."""
        if self.fault == "clean":
            return self.incidents == 0 and self.rejected == 0 and self.outputs_identical
        charged = set(self.recomputed) | set(self.failed)
        if self.fault == "late_landing":
            hit = self.firings == 1 and charged <= set(self.holders) and self.rejected == 0
        else:
            hit = self.firings == 1 and self.rejected == 1 and not charged
        return hit and self.incidents > 0 and self.outputs_identical

    @property
    def replay(self) -> str:
        """The command that replays this case alone."""
        return (f"kvcanary selftest --transfers --kv-canary recover --places {self.where} "
                f"--modes {self.fault} --first-seed {self.seed} --seeds 1")  # fmt: skip


def _recover(settings: RunSettings, model: str) -> RunSettings:
    return replace(settings, model_kind=model,
                   canary=replace(settings.canary, mode=CanaryMode.RECOVER))  # fmt: skip


def _holders(journal: Sequence[TransferFaultRecord]) -> tuple[str, ...]:
    """The requests `late_landing` firings name as holders of the slots they overwrote."""
    out: set[str] = set()
    for r in journal:
        if r.fault == "late_landing" and "held by" in r.description:
            out.update(re.findall(r"'([^']+)'", r.description.split("held by", 1)[1]))
    return tuple(sorted(out))


def run_recover_case(
    fault: str | None, where: str, seed: int, requests: int, model: str = "oracle"
) -> RecoverCase:
    """Serve one fixture in mode `recover` with `fault` switched on (None: clean)."""
    names = frozenset({fault} if fault else ())
    if where == "disagg":
        from kvcanary.app.disagg import serve_disaggregated

        settings = _recover(disagg_settings(seed, requests), model)
        result = serve_disaggregated(settings, disagg_options(fault, seed))
        f = result.figures
        check = ReferenceOutputs(settings).check(build_workload(settings.workload), result.outputs)
        return RecoverCase(fault or "clean", where, seed, len(result.journal), int(f["incidents"]),
                           len(f["rejected_landing_requests"]), tuple(f["recomputed_requests"]),
                           tuple(f["failed_requests"]), _holders(result.journal), check.identical)  # fmt: skip
    settings = _recover(host_settings(seed, requests), model)
    stack = build_stack(settings)
    canary = stack.canary
    assert canary is not None
    faults = TransferFaults(names, seed=seed, warmup_steps=8, step_of=lambda: canary.step)
    host = attach_host_tier(stack, HOST_PAGES, faults)
    run_session(settings, stack=stack)
    planned = build_workload(settings.workload)
    reqs = [stack.engine.request(p.request_id) for p in planned]
    return RecoverCase(
        fault or "clean", where, seed, len(faults.journal), stack.engine.stats().incidents,
        host.stats.rejected_restores, tuple(r.request_id for r in reqs if r.recoveries),
        tuple(r.request_id for r in reqs if r.status is RequestStatus.FAILED), (),
        check_outputs(stack, planned, settings).identical,
    )  # fmt: skip


def run_recover_campaign(
    faults: Sequence[str],
    seeds: Sequence[int],
    requests: int,
    places: Sequence[str],
    model: str = "oracle",
    progress: Callable[[str], None] | None = None,
) -> tuple[list[RecoverCase], list[RecoverCase]]:
    """Clean baselines per place, then every fault on every seed at every place it applies to;
    returns (baselines, fault cases)."""
    baseline = []
    for where in places:
        for seed in seeds:
            baseline.append(run_recover_case(None, where, seed, requests, model))
            if progress:
                progress(f"clean {where} seed {seed}")
    cases = []
    for fault in faults:
        for where in places:
            if fault not in PLACES[where]:
                continue
            for seed in seeds:
                cases.append(run_recover_case(fault, where, seed, requests, model))
                if progress:
                    progress(f"{fault} {where} seed {seed}")
    return baseline, cases
