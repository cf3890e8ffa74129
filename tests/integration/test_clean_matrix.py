"""Clean serving matrix: seeded scenarios over the engine's paths, with the canary in log mode.

Every scenario must end with zero violations, and its counters must prove that the paths it
targets really ran (radix hits, chunked prefill, retraction and re-prefill, aborts mid-prefill and
mid-decode, evictions, speculative acceptance, sweeps). Independently of the canary, every finished
request must equal the no-cache greedy reference (tiny model) or the token oracle (oracle model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvcanary.app.session import build_stack
from kvcanary.canary import RealDataMode
from kvcanary.engine.model import TinyLlama
from kvcanary.engine.reference import greedy_reference
from tests.integration.stacks import (
    DECODE,
    PREFILL,
    WorkloadShape,
    assert_clean,
    canary_config,
    oracle_output,
    plan_workload,
    run_settings,
    serve,
)

NONE, PARTIAL, ALL = RealDataMode.NONE, RealDataMode.PARTIAL, RealDataMode.ALL

RADIX, CHUNKED, RETRACT, EVICT = "radix", "chunked", "retract", "evict"
ABORT_PREFILL, ABORT_DECODE, SPEC = "abort-prefill", "abort-decode", "spec"

# Engine shapes. `tight` pools force retractions; `evicting` pools leave room for running requests
# but not for every finished prefix, so cached leaves are evicted.
ROOMY: dict[str, Any] = {"num_slots": 400}
CHUNKED_8: dict[str, Any] = {"num_slots": 400, "chunked_prefill_size": 8, "max_prefill_tokens": 32}
TIGHT: dict[str, Any] = {"num_slots": 160, "chunked_prefill_size": 16, "max_prefill_tokens": 64}
EVICTING: dict[str, Any] = {"num_slots": 200, "max_running_requests": 3, "max_batch_size": 3}

DEFAULT = WorkloadShape()
LONG_DECODE = WorkloadShape(num_requests=12, max_new_tokens=(10, 20), user_len=(10, 30))
MANY = WorkloadShape(num_requests=16, arrivals_per_step=4)
ABORTS = WorkloadShape(num_requests=10, abort_prefill=2, abort_decode=2)


@dataclass(frozen=True, slots=True)
class Scenario:
    """One seeded run: stack knobs, workload shape and the paths it must exercise."""

    id: str
    targets: frozenset[str]
    real_data: RealDataMode
    sweep: int
    seed: int
    model: str = "tiny"
    engine: dict[str, Any] = field(default_factory=dict)
    shape: WorkloadShape = DEFAULT
    stride: int = 1  # the canary's verify stride (docs/spec.md §5.5)


def sc(
    id: str,
    targets: tuple[str, ...],
    real_data: RealDataMode,
    sweep: int,
    seed: int,
    model: str = "tiny",
    shape: WorkloadShape = DEFAULT,
    stride: int = 1,
    **engine: Any,
) -> Scenario:
    return Scenario(id, frozenset(targets), real_data, sweep, seed, model, engine, shape, stride)


SCENARIOS = [
    # radix sharing
    sc("radix-tiny-none-sweep0", (RADIX,), NONE, 0, 1, **ROOMY),
    sc("radix-tiny-partial-sweep1", (RADIX,), PARTIAL, 1, 2, **ROOMY),
    sc("radix-oracle-all-sweep7", (RADIX,), ALL, 7, 3, "oracle", **ROOMY),
    sc("radix-off-tiny-partial-sweep1", (), PARTIAL, 1, 4, enable_prefix_cache=False, **ROOMY),
    # chunked prefill
    sc("chunked-tiny-none-sweep1", (CHUNKED, RADIX), NONE, 1, 5, **CHUNKED_8),
    sc("chunked-tiny-all-sweep0", (CHUNKED, RADIX), ALL, 0, 6, **CHUNKED_8),
    sc("chunked-oracle-partial-sweep7", (CHUNKED, RADIX), PARTIAL, 7, 7, "oracle", **CHUNKED_8),
    # retraction and re-prefill under a tight pool
    sc("retract-tiny-none-sweep0", (RETRACT,), NONE, 0, 8, shape=LONG_DECODE, **TIGHT),
    sc("retract-tiny-partial-sweep7", (RETRACT,), PARTIAL, 7, 9, shape=LONG_DECODE, **TIGHT),
    sc("retract-tiny-all-sweep1", (RETRACT,), ALL, 1, 10, shape=LONG_DECODE, **TIGHT),
    sc("retract-oracle-partial-sweep1", (RETRACT,), PARTIAL, 1, 11, "oracle", LONG_DECODE, **TIGHT),
    # aborts at a known phase
    sc("abort-tiny-partial-sweep1", (ABORT_PREFILL, ABORT_DECODE), PARTIAL, 1, 12, shape=ABORTS, **CHUNKED_8),
    sc("abort-tiny-none-sweep7", (ABORT_PREFILL, ABORT_DECODE), NONE, 7, 13, shape=ABORTS, **CHUNKED_8),
    sc("abort-oracle-all-sweep0", (ABORT_PREFILL, ABORT_DECODE), ALL, 0, 14, "oracle", ABORTS, **CHUNKED_8),
    # eviction of cached prefixes under pressure
    sc("evict-tiny-partial-sweep1", (EVICT, RADIX), PARTIAL, 1, 15, shape=MANY, **EVICTING),
    sc("evict-tiny-all-sweep7", (EVICT, RADIX), ALL, 7, 16, shape=MANY, **EVICTING),
    sc("evict-oracle-none-sweep1", (EVICT, RADIX), NONE, 1, 17, "oracle", MANY, **EVICTING),
    # speculative decoding
    sc("spec2-tiny-partial-sweep1", (SPEC,), PARTIAL, 1, 18, speculative_num_draft_tokens=2, **ROOMY),
    sc("spec3-tiny-all-sweep0", (SPEC,), ALL, 0, 19, shape=LONG_DECODE, speculative_num_draft_tokens=3, **ROOMY),
    sc("spec4-oracle-partial-sweep7", (SPEC,), PARTIAL, 7, 20, "oracle", speculative_num_draft_tokens=4, **ROOMY),
    sc("spec2-oracle-none-sweep1", (SPEC,), NONE, 1, 21, "oracle", LONG_DECODE, speculative_num_draft_tokens=2, **ROOMY),
    # everything at once
    sc("mixed-tiny-partial-sweep1", (RADIX, CHUNKED, RETRACT, ABORT_PREFILL, ABORT_DECODE, SPEC),
       PARTIAL, 1, 22, shape=WorkloadShape(num_requests=14, max_new_tokens=(8, 16), abort_prefill=1,
       abort_decode=1), speculative_num_draft_tokens=2, num_slots=180, chunked_prefill_size=8,
       max_prefill_tokens=40),
    sc("mixed-oracle-all-sweep7", (RADIX, CHUNKED, RETRACT, ABORT_PREFILL, ABORT_DECODE, SPEC),
       ALL, 7, 23, "oracle", WorkloadShape(num_requests=14, max_new_tokens=(8, 16),
       abort_prefill=1, abort_decode=1), speculative_num_draft_tokens=3, num_slots=180,
       chunked_prefill_size=8, max_prefill_tokens=40),
    # a verify stride through the same paths: thinner plans, still no false alarm
    sc("mixed-tiny-partial-sweep1-stride3", (RADIX, CHUNKED, RETRACT, ABORT_PREFILL, ABORT_DECODE,
       SPEC), PARTIAL, 1, 24, shape=WorkloadShape(num_requests=14, max_new_tokens=(8, 16),
       abort_prefill=1, abort_decode=1), stride=3, speculative_num_draft_tokens=2, num_slots=180,
       chunked_prefill_size=8, max_prefill_tokens=40),
    sc("evict-oracle-all-sweep7-stride2", (EVICT, RADIX), ALL, 7, 25, "oracle", MANY, stride=2,
       **EVICTING),
]  # fmt: skip


def test_matrix_covers_every_dimension() -> None:
    assert len(SCENARIOS) >= 20
    assert len({s.id for s in SCENARIOS}) == len(SCENARIOS)
    assert {s.real_data for s in SCENARIOS} == {NONE, PARTIAL, ALL}
    assert {s.sweep for s in SCENARIOS} == {0, 1, 7}
    assert {s.model for s in SCENARIOS} == {"tiny", "oracle"}
    assert {t for s in SCENARIOS for t in s.targets} == {
        RADIX, CHUNKED, RETRACT, EVICT, ABORT_PREFILL, ABORT_DECODE, SPEC
    }  # fmt: skip
    spec = {s.engine.get("speculative_num_draft_tokens", 0) > 0 for s in SCENARIOS}
    assert spec == {True, False}
    assert {s.stride > 1 for s in SCENARIOS} == {True, False}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.id)
def test_clean_scenario(scenario: Scenario) -> None:
    oracle = scenario.model == "oracle"
    cfg = run_settings(
        canary_config(
            real_data=scenario.real_data,
            sweep=scenario.sweep,
            oracle=oracle,
            verify_stride=scenario.stride,
        ),
        model_kind=scenario.model,
        seed=scenario.seed,
        **scenario.engine,
    )
    stack = build_stack(cfg)
    planned = plan_workload(scenario.shape, scenario.seed)
    served = serve(stack, planned)
    engine, canary = stack.engine, stack.canary
    assert canary is not None
    stats = engine.stats()

    # -- the canary saw every forward and reported nothing
    assert_clean(stack)
    cache_on = scenario.engine.get("enable_prefix_cache", True)
    sweeps = scenario.sweep > 0 and cache_on  # sweeps walk the prefix cache
    ran = [t for t in canary.active_tags if not t.is_sweep or sweeps]
    assert ran and all(canary.kernel_run_counter[t] > 0 for t in ran), "a launch tag never ran"
    if sweeps:
        assert canary.sweep_passes >= served.steps // scenario.sweep > 0
    else:
        assert canary.sweep_passes == 0

    # -- every request ended: finished with all its tokens, or aborted at its target phase
    aborted = set(served.aborted)
    assert set(served.finished) | aborted == set(served.planned)
    assert not set(served.finished) & aborted
    assert stats.requests_finished == len(served.finished)
    assert stats.requests_aborted == len(aborted)
    for rid, phase in served.aborted.items():
        assert phase == served.planned[rid].abort_phase
        computed, prompt_len, outputs = served.abort_snapshots[rid]
        if phase == PREFILL:
            assert 0 < computed < prompt_len and outputs == 0
        else:
            assert outputs >= 2 and computed == prompt_len + outputs - 1
    assert not engine.scheduler.running and engine.scheduler.kv.rows.num_used == 0
    kv = engine.scheduler.kv
    assert kv.allocator.num_held == engine.scheduler.prefix_cache.cached_tokens

    # -- each targeted path ran
    targets = scenario.targets
    if RADIX in targets:
        assert stats.radix_hit_tokens > 0
    if not cache_on:
        assert stats.radix_hit_tokens == 0 and stats.evictions == 0
    if CHUNKED in targets:
        assert served.partial_prefill_chunks > 0
    if RETRACT in targets:
        assert stats.retractions > 0
        assert served.retracted & set(served.finished), "no retracted request was re-prefilled"
    if EVICT in targets:
        assert stats.evictions > 0
    if ABORT_PREFILL in targets:
        assert PREFILL in served.aborted.values()
    if ABORT_DECODE in targets:
        assert DECODE in served.aborted.values()
    if SPEC in targets:
        assert served.verify_forwards > 0
        assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0
    else:
        assert stats.spec_draft_tokens == 0 and served.verify_forwards == 0

    # -- engine correctness, independent of the canary
    model = stack.runner.model
    for rid, output in served.finished.items():
        p = served.planned[rid]
        assert len(output) == p.max_new_tokens
        if oracle:
            expected = oracle_output(rid, len(p.prompt), p.max_new_tokens)
        else:
            assert isinstance(model, TinyLlama)
            expected = greedy_reference(model, p.prompt, p.max_new_tokens)
        assert list(output) == expected, f"{rid} diverged from the reference"
