"""The vLLM fault campaign: on each seed a clean run, then each fault armed once, on one engine.

The faults are armed and read back through `collective_rpc` wherever vLLM runs the canary (its
default multiprocess engine core included). Runs on one engine are made independent by dropping vLLM's prefix cache before each run (a
corrupted block is then never read again before it is rewritten). A fault that never found a
target counts as missed, not as skipped.

Each fault run's outputs are also compared with the clean run of the same seed: in mode `log`
`outputs_differing` counts what the fault delivered to clients (what mode `recover` prevents,
see `recover_campaign`); it is information, not a pass criterion (in bf16 a changed prefix-cache
hit pattern alone can change an output of the random tiny model).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvcanary.app.selftest.campaign import CaseOutcome, NameSummary
from kvcanary.app.selftest.correlate import Fault, correlate
from kvcanary.app.vllm.engine import VllmEngine
from kvcanary.app.vllm.faults import VLLM_FAULT_MODES
from kvcanary.app.vllm.workload import VllmRequest, VllmWorkload

__all__ = ["VLLM_EXPECTED_REASONS", "VllmCampaignResult", "VllmCampaignSpec", "replay_command",
           "run_vllm_campaign"]  # fmt: skip

_CP = frozenset({"verify_chain_hash", "verify_position", "verify_token"})
VLLM_EXPECTED_REASONS: dict[str, frozenset[str]] = {
    "block_table_swap": _CP,
    "kv_flip_used": frozenset({"verify_real_kv_hash"}),
    "kv_flip_cached": frozenset({"verify_real_kv_hash"}),
    "stale_prefix_hit": _CP,
}


@dataclass(frozen=True)
class VllmCampaignSpec:
    """Seeds, faults and the per-seed workload size."""

    modes: tuple[str, ...] = VLLM_FAULT_MODES
    seeds: int = 10
    first_seed: int = 0
    requests: int = 64
    max_tokens: int = 32
    warmup_steps: int = 8
    sweep_interval: int = 4

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in VLLM_FAULT_MODES]
        if bad:
            raise ValueError(
                f"--faults: unknown fault {bad[0]!r}; choose from all, none, "
                + ", ".join(VLLM_FAULT_MODES)
            )
        if self.seeds <= 0:
            raise ValueError(f"--seeds must be positive, got {self.seeds}")


def replay_command(name: str, seed: int) -> str:
    """The command that replays one case."""
    faults = "none" if name == "clean" else name
    return f"kvcanary vllm --faults {faults} --first-seed {seed} --seeds 1"


@dataclass(frozen=True)
class VllmCampaignResult:
    """The clean baselines, one summary per fault, and per fault the outputs (over all seeds)
    that differed from the clean run of the same seed."""

    baseline: list[CaseOutcome]
    summaries: list[NameSummary]
    outputs_differing: dict[str, int] = field(default_factory=dict)


def run_vllm_campaign(
    engine: VllmEngine,
    spec: VllmCampaignSpec,
    progress: Callable[[str], None] | None = None,
) -> VllmCampaignResult:
    """Clean baseline and every armed fault on every seed (`engine` built with `faults=True`)."""
    seeds = range(spec.first_seed, spec.first_seed + spec.seeds)
    per_mode: dict[str, list[CaseOutcome]] = {m: [] for m in spec.modes}
    differing = dict.fromkeys(spec.modes, 0)
    baseline = []
    for seed in seeds:
        workload = VllmWorkload(
            num_requests=spec.requests, seed=seed, max_tokens=spec.max_tokens
        ).requests()
        clean, reference = _case(engine, spec, workload, seed, None)
        baseline.append(clean)
        if progress:
            progress(f"clean seed {seed}")
        for mode in spec.modes:
            outcome, outputs = _case(engine, spec, workload, seed, mode)
            per_mode[mode].append(outcome)
            differing[mode] += sum(a != b for a, b in zip(outputs, reference, strict=True))
            if progress:
                progress(f"{mode} seed {seed}")
    summaries = [
        NameSummary(m, "vllm", tuple(per_mode[m]), VLLM_EXPECTED_REASONS[m]) for m in spec.modes
    ]
    return VllmCampaignResult(baseline, summaries, differing)


def _case(
    engine: VllmEngine,
    spec: VllmCampaignSpec,
    workload: Sequence[VllmRequest],
    seed: int,
    mode: str | None,
) -> tuple[CaseOutcome, tuple[tuple[int, ...], ...]]:
    engine.reset_prefix_cache()
    faults: list[Fault] = []
    if mode is not None:
        offset = random.Random(f"{mode}:{seed}").randrange(spec.warmup_steps)
        engine.arm(mode, seed=seed, steps_ahead=spec.warmup_steps + offset)
    try:
        run = engine.run(workload, seed=seed)
    finally:
        if mode is not None:
            faults = engine.disarm(sweep_interval=spec.sweep_interval)
    if len(run.violations) != run.figures["violations"]:
        raise RuntimeError(
            f"kv-canary: ring dropped rows ({len(run.violations)} kept of "
            f"{run.figures['violations']}); raise KVCANARY_RING_CAPACITY"
        )
    missing = [] if faults or mode is None else [Fault(mode, -1, "full", frozenset(), 0)]
    correlation = correlate([*faults, *missing], run.violations)
    outcome = CaseOutcome(mode or "clean", "vllm" if mode else "clean", seed, correlation,
                          len(run.violations))  # fmt: skip
    return outcome, run.outputs
