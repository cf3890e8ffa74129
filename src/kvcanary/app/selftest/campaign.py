"""The self-test campaign: every fault mode and planted bug on many seeds, plus a clean baseline."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvcanary.app.selftest.correlate import Correlation, correlate
from kvcanary.app.selftest.faults import RelatedSlots, faults_of, faults_of_plants
from kvcanary.app.session import RunSettings, build_stack, run_session
from kvcanary.app.workload import WorkloadSpec
from kvcanary.canary import CanaryConfig, CanaryMode, PerturbConfig, RealDataMode
from kvcanary.canary.perturb import Perturber
from kvcanary.engine.config import EngineConfig
from kvcanary.engine.model import ModelConfig
from kvcanary.engine.plants import PLANT_NAMES

__all__ = [
    "CAMPAIGN_MODES",
    "EXPECTED_REASONS",
    "CampaignSpec",
    "CaseOutcome",
    "NameSummary",
    "run_campaign",
    "run_case",
]

# swa_lut_tamper needs a sliding-window pool, which the reference engine does not have yet;
# it is exercised by the canary's unit tests on a hand-built SWA group.
CAMPAIGN_MODES: tuple[str, ...] = (
    "req_to_token", "real_kv_used", "real_kv_unused_cache", "real_kv_post_forward",
    "next_token_swap", "canary_tamper", "late_write", "stale_prefix", "double_alloc",
    "position_off_by_one",
)  # fmt: skip
_NEEDS_REJECTED_DRAFTS = frozenset({"spec_rollback_stale"})
_CP = frozenset({"verify_chain_hash", "verify_position"})
_RKV = frozenset({"verify_real_kv_hash"})
EXPECTED_REASONS: dict[str, frozenset[str]] = {
    "req_to_token": _CP,
    "real_kv_used": _RKV,
    "real_kv_unused_cache": _RKV,
    "real_kv_post_forward": _RKV,
    "next_token_swap": frozenset({"write_token"}),
    "canary_tamper": _CP | _RKV | {"verify_token"},
    "late_write": _CP | _RKV,
    "stale_prefix": _CP,
    "double_alloc": _CP | _RKV,
    "position_off_by_one": frozenset({"write_position", "verify_position"}),
    "radix_evict_locked": _CP | _RKV,
    "chunk_boundary_off_by_one": _CP | {"write_position"},
    "retract_stale_row": _CP | _RKV,
    "spec_rollback_stale": _CP | _RKV,
    "prefix_reused_slots": _CP | _RKV,
}


@dataclass(frozen=True, slots=True)
class CampaignSpec:
    """Which faults, how many seeds, and the fixture each case runs on."""

    modes: tuple[str, ...] = CAMPAIGN_MODES
    plants: tuple[str, ...] = PLANT_NAMES
    seeds: int = 20
    first_seed: int = 0
    requests: int = 24
    sweep_interval: int = 2
    warmup_steps: int = 8
    #: `tiny` serves every case with the real tiny transformer, whose output depends on the KV it
    #: reads (next_token_swap keeps the oracle: its detection needs the write-input assert);
    #: None keeps the default fixture (the token oracle, tiny for spec_rollback_stale)
    model: str | None = None
    #: the `CanaryConfig` fields the user's `KVCANARY_*` variables set away from their defaults
    #: (name, value), applied to every case's canary as `kvcanary run` applies them; the write-input
    #: assert and the token oracle only where the case serves the token oracle (the only model
    #: that has one). `KVCANARY_PERTURB_*` is refused: the campaign injects its own faults.
    canary_knobs: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        for mode in self.modes:
            if mode not in CAMPAIGN_MODES:
                raise ValueError(
                    f"--modes: unknown mode {mode!r}; choose from {', '.join(CAMPAIGN_MODES)}"
                )
        for plant in self.plants:
            if plant not in PLANT_NAMES:
                raise ValueError(
                    f"--plants: unknown plant {plant!r}; choose from {', '.join(PLANT_NAMES)}"
                )
        if self.seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {self.seeds}")
        for name, _ in self.canary_knobs:
            if name in ("mode", "real_data", "sweep_interval", "perturb"):
                raise ValueError(f"canary_knobs: {name} is the campaign's own, not a knob")
        if self.model not in (None, "tiny", "oracle"):
            raise ValueError(f"--model must be tiny or oracle, got {self.model!r}")


def case_settings(
    spec: CampaignSpec, seed: int, *, mode: str | None = None, plant: str | None = None
) -> RunSettings:
    """The fixture of one case: oracle model, small pool, chunked prefill, speculation, sweeps."""
    # Oracle drafts are always accepted, so the rollback plant needs the tiny model's n-gram drafts;
    # plants run without aborts (a retracted request aborted while waiting never shows its row).
    model_kind = "tiny" if plant in _NEEDS_REJECTED_DRAFTS else "oracle"
    if spec.model == "tiny" and mode != "next_token_swap":
        model_kind = "tiny"
    perturb = PerturbConfig(
        probabilities={mode: 1.0} if mode else {}, seed=seed, warmup_steps=spec.warmup_steps,
        target_group="full" if mode else None,
    )  # fmt: skip
    canary = CanaryConfig(
        mode=CanaryMode.LOG, real_data=RealDataMode.PARTIAL, sweep_interval=spec.sweep_interval,
        stats_print_every_n_steps=0, enable_write_input_assert=model_kind == "oracle", perturb=perturb,
    )  # fmt: skip
    knobs = dict(spec.canary_knobs)
    if model_kind != "oracle":  # both need the token oracle, which the tiny model has not
        knobs.pop("enable_write_input_assert", None)
        knobs.pop("enable_token_oracle", None)
    canary = dataclasses.replace(canary, **knobs)  # type: ignore[arg-type]
    engine = EngineConfig(
        num_slots=320, max_context_len=256, vocab_size=256, max_running_requests=8, max_batch_size=8,
        chunked_prefill_size=16, max_prefill_tokens=64, speculative_num_draft_tokens=2, seed=seed,
        plants=(plant,) if plant else (),
    )  # fmt: skip
    # and long-lived requests, so a request hit by a plant still reads its KV after the damage
    workload = WorkloadSpec(num_requests=spec.requests, seed=seed, vocab_size=256,
                            abort_fraction=0.0 if plant else 0.1,
                            max_new_tokens=(16, 40) if plant else (4, 24))  # fmt: skip
    return RunSettings(
        canary=canary, engine=engine, model=ModelConfig(vocab_size=256, seed=seed), model_kind=model_kind,
        workload=workload,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class CaseOutcome:
    """One (fault, seed) run, or a clean baseline run when `name` is `clean`."""

    name: str
    kind: str  # mode | plant | clean
    seed: int
    correlation: Correlation
    violations: int

    @property
    def replay(self) -> str:
        """The command that replays this case alone."""
        which = (
            f"--modes {self.name} --plants none"
            if self.kind == "mode"
            else f"--modes none --plants {self.name}"
        )
        return f"kvcanary selftest {which} --first-seed {self.seed} --seeds 1"


def run_case(
    spec: CampaignSpec, seed: int, *, mode: str | None = None, plant: str | None = None
) -> CaseOutcome:
    """Run one case and correlate its faults with its violations."""
    settings = case_settings(spec, seed, mode=mode, plant=plant)
    proxy = RelatedSlots(Perturber(settings.canary.perturb, max_fires_per_mode=1)) if mode else None
    stack = build_stack(settings, perturb=proxy)
    run_session(settings, stack=stack)
    violations = stack.hooks.violations
    if proxy is not None:
        faults = faults_of(proxy.injections(), proxy.successors, sweep_interval=spec.sweep_interval)
    else:
        faults = faults_of_plants(stack.engine.plant_journal(), sweep_interval=spec.sweep_interval)
    kind = "mode" if mode else "plant" if plant else "clean"
    correlation = correlate(faults, violations, cascades=plant is not None)
    return CaseOutcome(mode or plant or "clean", kind, seed, correlation, len(violations))


@dataclass(frozen=True, slots=True)
class NameSummary:
    """One row of the result table: a mode or plant over all seeds."""

    name: str
    kind: str
    outcomes: tuple[CaseOutcome, ...]
    reasons_expected: frozenset[str] = field(default=frozenset())

    @property
    def passed(self) -> bool:
        """Caught 1:1 on every seed, with an expected reason among those seen."""
        return all(o.correlation.one_to_one for o in self.outcomes) and bool(
            self.reasons_seen & self.reasons_expected
        )

    @property
    def reasons_seen(self) -> set[str]:
        """Fail-reason labels of the rows the faults explain, over all seeds."""
        return set().union(*(o.correlation.reasons_seen for o in self.outcomes))

    def as_json(self) -> dict[str, object]:
        """The JSON object of the `results` list."""
        lat = [x for o in self.outcomes for x in o.correlation.latencies if x is not None]
        return {
            "name": self.name,
            "kind": self.kind,
            "seeds": len(self.outcomes),
            "injections": sum(len(o.correlation.faults) for o in self.outcomes),
            "seeds_caught_1to1": sum(o.correlation.one_to_one for o in self.outcomes),
            "seeds_caught_any": sum(
                o.violations > 0 and bool(o.correlation.faults) for o in self.outcomes
            ),
            "missed": sum(o.correlation.missed for o in self.outcomes),
            "false_alarms": sum(len(o.correlation.false_alarms) for o in self.outcomes),
            "cascade_rows": sum(len(o.correlation.cascades) for o in self.outcomes),
            "latency_steps_median": statistics.median(lat) if lat else None,
            "latency_steps_max": max(lat) if lat else None,
            "reasons_seen": sorted(self.reasons_seen),
            "reasons_expected": sorted(self.reasons_expected),
            "failing_seeds": [o.seed for o in self.outcomes if not o.correlation.one_to_one],
        }


def run_campaign(
    spec: CampaignSpec, progress: Callable[[str], None] | None = None
) -> tuple[list[CaseOutcome], list[NameSummary]]:
    """The clean baseline on every seed, then every mode and plant on every seed."""
    seeds = range(spec.first_seed, spec.first_seed + spec.seeds)
    baseline = []
    for seed in seeds:
        baseline.append(run_case(spec, seed))
        if progress:
            progress(f"clean seed {seed}")
    summaries = []
    jobs: Sequence[tuple[str, str]] = [("mode", m) for m in spec.modes] + [
        ("plant", p) for p in spec.plants
    ]
    for kind, name in jobs:
        outcomes = []
        for seed in seeds:
            if kind == "mode":
                outcomes.append(run_case(spec, seed, mode=name))
            else:
                outcomes.append(run_case(spec, seed, plant=name))
            if progress:
                progress(f"{name} seed {seed}")
        summaries.append(
            NameSummary(name, kind, tuple(outcomes), EXPECTED_REASONS.get(name, frozenset()))
        )
    return baseline, summaries
