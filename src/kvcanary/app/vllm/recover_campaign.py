"""`kvcanary vllm --kv-canary recover --faults ...`: the outcome campaign against real vLLM.

Per seed, on one engine in mode `recover` (vLLM's `kv_load_failure_policy=recompute`): a clean
run (the fault-free reference: it must report no incident), then each fault armed once on the
same workload. Every request vLLM delivers is compared with the reference:

| column | meaning |
|---|---|
| `corrupted_delivered` | finished normally with an output different from the reference (must be 0) |
| `failed` | ended with `finish_reason` `error` (retry budget spent, or policy `fail`) |
| `recovered` | needed a recompute and then finished normally |
| `recompute_tokens` | positions dropped from the first bad block on and computed again |
| `incidents` | damaged request-forwards the scheduler acted on |

The figures reach the driver through vLLM's own channels, so any process layout works (vLLM's
default engine-core child process included): `incidents` and `recompute_tokens` from the
scheduler half's connector stats on vLLM's metrics, `recovered` from each output's
`kv_transfer_params` (`kvcanary_recomputes`, set by the connector's `request_finished`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcanary.app.vllm.campaign import VllmCampaignSpec
from kvcanary.app.vllm.engine import VllmEngine, VllmRun
from kvcanary.app.vllm.workload import VllmRequest, VllmWorkload

__all__ = ["VllmOutcome", "recover_json", "recover_passed", "recover_rows",
           "run_vllm_recover_campaign"]  # fmt: skip


@dataclass(frozen=True)
class VllmOutcome:
    """One (fault, seed) against the fault-free run of the same workload."""

    name: str
    seed: int
    requests: int
    corrupted_delivered: int
    failed: int
    recovered: int
    recompute_tokens: int
    incidents: int
    violations: int
    fired: bool

    def as_json(self) -> dict[str, Any]:
        """JSON-ready."""
        return dict(self.__dict__)


def _compare(name: str, seed: int, run: VllmRun, reference: VllmRun,
             fired: bool) -> VllmOutcome:  # fmt: skip
    failed = [r == "error" for r in run.finish_reasons]
    corrupted = sum(1 for out, ref, bad in zip(run.outputs, reference.outputs, failed, strict=True)
                    if not bad and out != ref)  # fmt: skip
    recovered = sum(1 for n, bad in zip(run.recomputes, failed, strict=True) if n and not bad)
    return VllmOutcome(
        name=name, seed=seed, requests=len(run.outputs), corrupted_delivered=corrupted,
        failed=sum(failed), recovered=recovered,
        recompute_tokens=int(run.figures["recompute_tokens"]),
        incidents=int(run.figures["incidents"]),
        violations=int(run.figures["violations"]), fired=fired,
    )  # fmt: skip


def _serve(engine: VllmEngine, spec: VllmCampaignSpec, workload: Sequence[VllmRequest],
           seed: int, mode: str | None, reference: VllmRun | None
           ) -> tuple[VllmRun, VllmOutcome]:  # fmt: skip
    engine.reset_prefix_cache()
    if mode is not None:
        offset = random.Random(f"{mode}:{seed}").randrange(spec.warmup_steps)
        engine.arm(mode, seed=seed, steps_ahead=spec.warmup_steps + offset)
    fired = False
    try:
        run = engine.run(workload, seed=seed)
    finally:
        if mode is not None:
            fired = bool(engine.disarm(sweep_interval=spec.sweep_interval))
    outcome = _compare(mode or "clean", seed, run, reference or run, fired)
    return run, outcome


def run_vllm_recover_campaign(
    engine: VllmEngine,
    spec: VllmCampaignSpec,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[VllmOutcome], dict[str, list[VllmOutcome]]]:
    """The clean reference and every armed fault on every seed (engine in mode `recover`, built
    with `faults=True`, single rank)."""
    baseline: list[VllmOutcome] = []
    per_mode: dict[str, list[VllmOutcome]] = {m: [] for m in spec.modes}
    for seed in range(spec.first_seed, spec.first_seed + spec.seeds):
        workload = VllmWorkload(num_requests=spec.requests, seed=seed,
                                max_tokens=spec.max_tokens).requests()  # fmt: skip
        reference, clean = _serve(engine, spec, workload, seed, None, None)
        baseline.append(clean)
        if progress:
            progress(f"clean seed {seed}")
        for mode in spec.modes:
            _, outcome = _serve(engine, spec, workload, seed, mode, reference)
            per_mode[mode].append(outcome)
            if progress:
                progress(f"{mode} seed {seed}")
    return baseline, per_mode


def recover_rows(baseline: list[VllmOutcome], per_mode: dict[str, list[VllmOutcome]]
                 ) -> list[dict[str, Any]]:  # fmt: skip
    """One row per fault (and the clean baseline): totals over seeds."""
    rows = []
    for name, outs in [("clean", baseline), *per_mode.items()]:
        rows.append({
            "name": name, "seeds": len(outs),
            "fired": sum(o.fired for o in outs) if name != "clean" else 0,
            "corrupted_delivered": sum(o.corrupted_delivered for o in outs),
            "seeds_with_corrupted": sum(o.corrupted_delivered > 0 for o in outs),
            "failed": sum(o.failed for o in outs),
            "recovered": sum(o.recovered for o in outs),
            "recompute_tokens": sum(o.recompute_tokens for o in outs),
            "incidents": sum(o.incidents for o in outs),
            "violations": sum(o.violations for o in outs),
        })  # fmt: skip
    return rows


def recover_passed(baseline: list[VllmOutcome], per_mode: dict[str, list[VllmOutcome]]) -> bool:
    """No corrupted delivery anywhere; the clean baseline silent and identical (trivially: it is
    the reference, so its own incidents and violations must be 0)."""
    clean_ok = all(o.incidents == 0 and o.violations == 0 and o.failed == 0 for o in baseline)
    return clean_ok and all(o.corrupted_delivered == 0 for outs in per_mode.values() for o in outs)


def recover_json(baseline: list[VllmOutcome], per_mode: dict[str, list[VllmOutcome]]
                 ) -> dict[str, Any]:  # fmt: skip
    """The JSON document (top level `kv_canary_mode`, per result the outcome columns)."""
    return {
        "kv_canary_mode": "recover",
        "engine": "vllm",
        "passed": recover_passed(baseline, per_mode),
        "summary": recover_rows(baseline, per_mode),
        "results": [o.as_json() for outs in [baseline, *per_mode.values()] for o in outs],
    }
