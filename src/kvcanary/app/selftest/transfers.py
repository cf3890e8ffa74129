"""`kvcanary selftest --transfers`: every transfer fault on many seeds, correlated 1:1.

Host-tier faults run on the reference engine with a host tier (a restore is the transfer);
`late_landing` and the landing faults also run across a prefill and a decode process
(`app.disagg`). Each case journals its firings (`engine.transfer_faults`) with the receiver's
slots, and `correlate` assigns every violation to exactly one firing. A fault is caught when its
first row comes in the step of the landing (latency 0): the receiver verifies landed pages
before the first forward that reads them. Clean baselines run the same fixtures with no fault.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcanary.app.host_tier import attach_host_tier, check_outputs
from kvcanary.app.reference import ReferenceOutputs
from kvcanary.app.selftest.correlate import Correlation, Fault, correlate
from kvcanary.app.session import RunSettings, build_stack, run_session
from kvcanary.app.workload import WorkloadSpec, build_workload
from kvcanary.canary import CanaryConfig, CanaryMode, RealDataMode
from kvcanary.engine.config import EngineConfig
from kvcanary.engine.model import ModelConfig
from kvcanary.engine.transfer_faults import (
    DISAGG_FAULTS,
    HOST_FAULTS,
    TransferFaultRecord,
    TransferFaults,
)

if TYPE_CHECKING:
    from kvcanary.app.disagg import DisaggOptions

__all__ = [
    "TRANSFER_EXPECTED_REASONS",
    "TransferCase",
    "TransferSummary",
    "disagg_options",
    "disagg_settings",
    "faults_of_transfers",
    "host_settings",
    "run_disagg_case",
    "run_host_case",
    "run_transfer_campaign",
]

_CP = frozenset({"verify_chain_hash", "verify_position"})
TRANSFER_EXPECTED_REASONS: dict[str, frozenset[str]] = {
    "wrong_slots": _CP,
    "page_never_written": _CP,
    # a late landing into the same slots at the same positions brings a self-consistent chain:
    # only the receiver's verify-token assert sees it (`app.disagg.receiver_settings`)
    "late_landing": _CP | {"verify_token"},
    "partial_layers": _CP,
    "bit_flip_in_transit": frozenset({"verify_real_kv_hash"}),
    "stale_host_copy": _CP,
    "failed_store_visible": _CP,
    "contiguous_block_ids": _CP,
}
#: requests of the disaggregated fixture aborted while their transfer is in flight (arrivals
#: every 3 steps: all after the faults' warm-up of 8 steps)
IN_FLIGHT_ABORTS: tuple[str, ...] = ("req-4", "req-9", "req-14", "req-19")
#: the host fixture's pages: small enough that the host tier drops entries (reusing pages)
HOST_PAGES = 512


def host_settings(
    seed: int,
    requests: int,
    *,
    sweep_interval: int = 2,
    abort_fraction: float = 0.1,
    arrivals_per_step: int = 4,
    arrival_interval_steps: int = 1,
) -> RunSettings:
    """The host-tier fixture: oracle model, a pool small enough to evict shared prefixes that
    later requests hit again (restores), aborts, chunked prefill, speculation, sweeps."""
    canary = CanaryConfig(mode=CanaryMode.LOG, real_data=RealDataMode.PARTIAL,
                          sweep_interval=sweep_interval, stats_print_every_n_steps=0)  # fmt: skip
    engine = EngineConfig(
        num_slots=256, max_context_len=256, vocab_size=256, max_running_requests=6,
        max_batch_size=6, chunked_prefill_size=16, max_prefill_tokens=64,
        speculative_num_draft_tokens=2, seed=seed,
    )  # fmt: skip
    workload = WorkloadSpec(num_requests=requests, seed=seed, vocab_size=256,
                            num_system_prompts=6, abort_fraction=abort_fraction,
                            arrivals_per_step=arrivals_per_step,
                            arrival_interval_steps=arrival_interval_steps)  # fmt: skip
    return RunSettings(canary=canary, engine=engine, model=ModelConfig(vocab_size=256, seed=seed),
                       model_kind="oracle", workload=workload)  # fmt: skip


def faults_of_transfers(records: Sequence[TransferFaultRecord], window: int) -> list[Fault]:
    """One `Fault` per journaled firing: the receiver's slots and the positions they held."""
    return [
        Fault(
            r.fault,
            r.step,
            "full",
            frozenset(s for s in r.slots if s > 0),
            window,
            positions=frozenset(r.positions),
            detail=r.description,
        )
        for r in records
    ]


@dataclass(frozen=True, slots=True)
class TransferCase:
    """One (fault, seed) run, or a clean one (`fault` = `clean`)."""

    fault: str
    where: str  # host | disagg
    seed: int
    correlation: Correlation
    violations: int
    outputs_identical: bool

    @property
    def replay(self) -> str:
        """The command that replays this case alone."""
        return (
            f"kvcanary selftest --transfers --modes {self.fault} --first-seed {self.seed} --seeds 1"
        )


def run_host_case(fault: str | None, seed: int, requests: int) -> TransferCase:
    """Serve the host fixture with `fault` switched on (None: clean) and correlate."""
    settings = host_settings(seed, requests)
    stack = build_stack(settings)
    canary = stack.canary
    assert canary is not None
    faults = TransferFaults(frozenset({fault} if fault else ()), seed=seed, warmup_steps=8,
                            step_of=lambda: canary.step)  # fmt: skip
    attach_host_tier(stack, HOST_PAGES, faults)
    run_session(settings, stack=stack)
    found = faults_of_transfers(faults.journal, window=0)
    check = check_outputs(stack, build_workload(settings.workload), settings)
    correlation = correlate(found, stack.hooks.violations)
    return TransferCase(fault or "clean", "host", seed, correlation, len(stack.hooks.violations),
                        check.identical)  # fmt: skip


def disagg_settings(seed: int, requests: int) -> RunSettings:
    """The disaggregated fixture: the host fixture with more aborts and a steadier arrival
    rate, so aborts hit transfers in flight (the race)."""
    return host_settings(
        seed, requests, abort_fraction=0.3, arrivals_per_step=1, arrival_interval_steps=3
    )


def disagg_options(fault: str | None, seed: int) -> DisaggOptions:
    """`fault` (None: clean) on the fixture; some clients give up while their transfer is in
    flight, whatever the seed: the race `late_landing` needs (and that every clean baseline must
    survive) always happens."""
    from kvcanary.app.disagg import DisaggOptions

    return DisaggOptions(faults=(fault,) if fault else (), fault_seed=seed, fault_warmup_steps=8,
                         abort_in_flight=IN_FLIGHT_ABORTS)  # fmt: skip


def run_disagg_case(fault: str | None, seed: int, requests: int) -> TransferCase:
    """Serve the fixture across a prefill and a decode process with `fault` switched on."""
    from kvcanary.app.disagg import serve_disaggregated

    settings = disagg_settings(seed, requests)
    result = serve_disaggregated(settings, disagg_options(fault, seed))
    window = settings.canary.sweep_interval if fault == "late_landing" else 0
    found = faults_of_transfers(result.journal, window=window)
    check = ReferenceOutputs(settings).check(build_workload(settings.workload), result.outputs)
    # the sender stays silent: any prefill-side row is a false alarm
    correlation = correlate(found, result.violations + result.prefill_violations)
    return TransferCase(fault or "clean", "disagg", seed, correlation,
                        len(result.violations) + len(result.prefill_violations), check.identical)  # fmt: skip


PLACES: dict[str, tuple[str, ...]] = {"host": HOST_FAULTS, "disagg": DISAGG_FAULTS}


@dataclass(frozen=True, slots=True)
class TransferSummary:
    """One fault over all seeds."""

    fault: str
    where: str
    cases: tuple[TransferCase, ...]

    @property
    def reasons_seen(self) -> set[str]:
        """Fail-reason labels of the rows the faults explain."""
        return set().union(*(c.correlation.reasons_seen for c in self.cases))

    @property
    def passed(self) -> bool:
        """Caught 1:1 on every seed with an expected reason."""
        return all(c.correlation.one_to_one for c in self.cases) and bool(
            self.reasons_seen & TRANSFER_EXPECTED_REASONS[self.fault]
        )

    def as_json(self) -> dict[str, object]:
        """The JSON row of this fault."""
        lat = [x for c in self.cases for x in c.correlation.latencies if x is not None]
        tags = sorted({v.tag.name if hasattr(v.tag, "name") else str(v.tag)
                       for c in self.cases for rows in c.correlation.rows_per_fault for v in rows})  # fmt: skip
        return {
            "name": self.fault,
            "where": self.where,
            "seeds": len(self.cases),
            "injections": sum(len(c.correlation.faults) for c in self.cases),
            "seeds_caught_1to1": sum(c.correlation.one_to_one for c in self.cases),
            "missed": sum(c.correlation.missed for c in self.cases),
            "false_alarms": sum(len(c.correlation.false_alarms) for c in self.cases),
            "latency_steps_median": statistics.median(lat) if lat else None,
            "latency_steps_max": max(lat) if lat else None,
            "tags_seen": tags,
            "reasons_seen": sorted(self.reasons_seen),
            "outputs_identical_seeds": sum(c.outputs_identical for c in self.cases),
            "failing_seeds": [c.seed for c in self.cases if not c.correlation.one_to_one],
        }


CaseRunner = Callable[[str | None, int, int], TransferCase]
RUNNERS: dict[str, CaseRunner] = {"host": run_host_case, "disagg": run_disagg_case}


def run_transfer_campaign(
    faults: Sequence[str],
    seeds: Sequence[int],
    requests: int,
    progress: Callable[[str], None] | None = None,
    *,
    places: Sequence[str] = ("host", "disagg"),
) -> tuple[list[TransferCase], list[TransferSummary]]:
    """Clean baselines per place, then every fault on every seed at every place it applies to
    (host tier: `HOST_FAULTS`; prefill->decode: `DISAGG_FAULTS`)."""
    baseline: list[TransferCase] = []
    for where in places:
        for seed in seeds:
            baseline.append(RUNNERS[where](None, seed, requests))
            if progress:
                progress(f"clean {where} seed {seed}")
    summaries = []
    for fault in faults:
        for where in places:
            if fault not in PLACES[where]:
                continue
            cases = []
            for seed in seeds:
                cases.append(RUNNERS[where](fault, seed, requests))
                if progress:
                    progress(f"{fault} {where} seed {seed}")
            summaries.append(TransferSummary(fault, where, tuple(cases)))
    return baseline, summaries
