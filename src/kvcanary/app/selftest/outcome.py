"""The outcome campaign of `kvcanary selftest --kv-canary recover` (SPEC §14.3, issue 10).

For every fault mode and planted bug on every seed it serves the same workload three times:

| run | canary | faults |
|---|---|---|
| fault-free reference | none | none |
| recover | `recover` | the fault |
| log (side by side) | `log` | the same fault |

and compares every delivered request's output with the reference. `corrupted_delivered` counts
requests delivered with a different output (recover mode must keep it at 0); the log column is
the damage recover prevents. Failed requests (`finish_reason="kv_corruption"`) are delivered to
nobody, so they are counted apart. Requests the reference run did not finish (aborted at a step
that recovery shifted) cannot be compared and are counted as `unmatched`.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from kvcanary.app.selftest.campaign import CampaignSpec, case_settings
from kvcanary.app.selftest.faults import RelatedSlots
from kvcanary.app.session import RunSettings, build_stack, run_session
from kvcanary.app.workload import build_workload
from kvcanary.canary import CanaryMode, PerturbConfig
from kvcanary.canary.perturb import Perturber
from kvcanary.engine.request import RequestStatus

__all__ = ["OutcomeCase", "OutcomeRun", "OutcomeSummary", "run_outcome_campaign", "serve"]


@dataclass(frozen=True, slots=True)
class OutcomeRun:
    """What one served workload delivered, and what the engine did about incidents."""

    outputs: dict[str, tuple[int, ...]]  # delivered (finished) requests only
    failed: int
    incidents: int
    violations: int
    recoveries: int
    recovered: int
    recompute_tokens: int
    latency_total: int
    latency_max: int
    recoveries_completed: int
    budget_spent: int  # requests whose last recompute used the whole retry budget


@dataclass(frozen=True, slots=True)
class OutcomeCase:
    """One (fault, seed): the recover run and the log run against the fault-free reference."""

    name: str
    kind: str  # mode | plant | clean
    seed: int
    recover: OutcomeRun
    log: OutcomeRun | None
    corrupted_delivered: int
    log_corrupted_delivered: int | None
    unmatched: int

    @property
    def replay(self) -> str:
        """The command that replays this case alone."""
        if self.kind == "clean":
            which = "--modes none --plants none"
        elif self.kind == "mode":
            which = f"--modes {self.name} --plants none"
        else:
            which = f"--modes none --plants {self.name}"
        return f"kvcanary selftest --kv-canary recover {which} --first-seed {self.seed} --seeds 1"


def _with_mode(settings: RunSettings, mode: CanaryMode) -> RunSettings:
    return dataclasses.replace(settings, canary=dataclasses.replace(settings.canary, mode=mode))


def _fault_free(settings: RunSettings) -> RunSettings:
    canary = dataclasses.replace(settings.canary, mode=CanaryMode.NONE, sweep_interval=0,
                                 perturb=PerturbConfig())  # fmt: skip
    return dataclasses.replace(
        settings, canary=canary, engine=dataclasses.replace(settings.engine, plants=())
    )


def serve(settings: RunSettings, *, perturbed: bool) -> OutcomeRun:
    """Serve `settings`' workload to completion; `perturbed` wires the fault injector."""
    proxy = (
        RelatedSlots(Perturber(settings.canary.perturb, max_fires_per_mode=1))
        if perturbed
        else None
    )
    stack = build_stack(settings, perturb=proxy)
    run_session(settings, stack=stack)
    outputs: dict[str, tuple[int, ...]] = {}
    failed = spent = 0
    for planned in build_workload(settings.workload):
        req = stack.engine.request(planned.request_id)
        if req.status is RequestStatus.FINISHED:
            outputs[req.request_id] = tuple(req.output)
        elif req.status is RequestStatus.FAILED:
            failed += 1
        spent += req.recoveries >= settings.engine.recovery_retries > 0
    stats = stack.engine.stats()
    return OutcomeRun(
        outputs=outputs, failed=failed, incidents=len(stack.hooks.incidents),
        violations=stack.canary.total_violations if stack.canary else 0,
        recoveries=stats.recoveries, recovered=stats.requests_recovered,
        recompute_tokens=stats.recompute_tokens, latency_total=stats.recovery_latency_steps_total,
        latency_max=stats.recovery_latency_steps_max,
        recoveries_completed=stats.recoveries_completed, budget_spent=spent,
    )  # fmt: skip


def _corrupted(run: OutcomeRun, reference: OutcomeRun) -> tuple[int, int]:
    """(delivered with an output different from the reference, delivered but not comparable)."""
    bad = unmatched = 0
    for rid, out in run.outputs.items():
        ref = reference.outputs.get(rid)
        if ref is None:
            unmatched += 1
        elif ref != out:
            bad += 1
    return bad, unmatched


def run_outcome_case(
    spec: CampaignSpec,
    seed: int,
    *,
    mode: str | None = None,
    plant: str | None = None,
    with_log: bool = True,
    references: dict[tuple[int, str, bool], OutcomeRun] | None = None,
) -> OutcomeCase:
    """One fault (or the clean baseline when neither is given) on one seed."""
    settings = case_settings(spec, seed, mode=mode, plant=plant)
    key = (seed, settings.model_kind, plant is not None)
    cache = references if references is not None else {}
    if key not in cache:
        cache[key] = serve(_fault_free(settings), perturbed=False)
    reference = cache[key]
    faulted = mode is not None
    recover = serve(_with_mode(settings, CanaryMode.RECOVER), perturbed=faulted)
    log = serve(_with_mode(settings, CanaryMode.LOG), perturbed=faulted) if with_log else None
    bad, unmatched = _corrupted(recover, reference)
    log_bad = _corrupted(log, reference)[0] if log is not None else None
    kind = "mode" if mode else "plant" if plant else "clean"
    return OutcomeCase(mode or plant or "clean", kind, seed, recover, log, bad, log_bad, unmatched)


@dataclass(frozen=True, slots=True)
class OutcomeSummary:
    """One result row: a mode or plant (or the clean baseline) over all seeds."""

    name: str
    kind: str
    cases: tuple[OutcomeCase, ...]

    @property
    def passed(self) -> bool:
        """No corrupted output delivered on any seed (and, for the baseline, no incident)."""
        clean_ok = self.kind != "clean" or all(c.recover.incidents == 0 for c in self.cases)
        return clean_ok and all(c.corrupted_delivered == 0 for c in self.cases)

    def as_json(self) -> dict[str, object]:
        """The JSON object of the `results` list."""
        cases = self.cases
        completed = sum(c.recover.recoveries_completed for c in cases)
        latency_total = sum(c.recover.latency_total for c in cases)
        log_bad = [
            c.log_corrupted_delivered for c in cases if c.log_corrupted_delivered is not None
        ]
        return {
            "name": self.name,
            "kind": self.kind,
            "seeds": len(cases),
            "seeds_corrupted_delivered_0": sum(c.corrupted_delivered == 0 for c in cases),
            "corrupted_delivered": sum(c.corrupted_delivered for c in cases),
            "failed": sum(c.recover.failed for c in cases),
            "recovered": sum(c.recover.recovered for c in cases),
            "recoveries": sum(c.recover.recoveries for c in cases),
            "recompute_tokens": sum(c.recover.recompute_tokens for c in cases),
            "recovery_latency_steps_mean": round(latency_total / completed, 2)
            if completed
            else None,
            "recovery_latency_steps_max": max((c.recover.latency_max for c in cases), default=0),
            "retry_budget_spent": sum(c.recover.budget_spent for c in cases),
            "incidents": sum(c.recover.incidents for c in cases),
            "violations": sum(c.recover.violations for c in cases),
            "delivered": sum(len(c.recover.outputs) for c in cases),
            "unmatched": sum(c.unmatched for c in cases),
            "log_corrupted_delivered": sum(log_bad) if log_bad else None,
            "log_seeds_corrupted": sum(x > 0 for x in log_bad) if log_bad else None,
            "log_violations": sum(c.log.violations for c in cases if c.log is not None),
            "failing_seeds": [c.seed for c in cases if c.corrupted_delivered],
            "delivered_median_per_seed": statistics.median(len(c.recover.outputs) for c in cases),
        }


def run_outcome_campaign(
    spec: CampaignSpec, progress: Callable[[str], None] | None = None, *, with_log: bool = True
) -> list[OutcomeSummary]:
    """The clean baseline, then every mode and plant, each on every seed."""
    seeds = range(spec.first_seed, spec.first_seed + spec.seeds)
    references: dict[tuple[int, str, bool], OutcomeRun] = {}
    jobs: list[tuple[str, str | None]] = [("clean", None)]
    jobs += [("mode", m) for m in spec.modes] + [("plant", p) for p in spec.plants]
    summaries = []
    for kind, name in jobs:
        cases = []
        for seed in seeds:
            cases.append(
                run_outcome_case(
                    spec,
                    seed,
                    mode=name if kind == "mode" else None,
                    plant=name if kind == "plant" else None,
                    with_log=with_log,
                    references=references,
                )
            )
            if progress:
                progress(f"{name or 'clean'} seed {seed}")
        summaries.append(OutcomeSummary(name or "clean", kind, tuple(cases)))
    return summaries


def outcome_json(summaries: list[OutcomeSummary], spec: CampaignSpec) -> dict[str, object]:
    """The `--json` document of a recover-mode self-test."""
    return {
        "kv_canary_mode": "recover",
        "model": spec.model or "oracle (tiny for spec_rollback_stale)",
        "seeds": spec.seeds,
        "first_seed": spec.first_seed,
        "passed": all(s.passed for s in summaries),
        "results": [s.as_json() for s in summaries],
    }
