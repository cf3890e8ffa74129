"""Self-test, engine side: every planted engine bug is caught by the canary (log mode, real-data
partial, sweep 4), with a violation naming a slot the plant journaled within a few steps of the
journal record; the same seeds without plants report nothing."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from kvcanary.app.session import RunSettings, Stack, build_stack
from kvcanary.app.workload import WorkloadSpec, build_workload
from kvcanary.canary import CanaryConfig, CanaryMode, RealDataMode
from kvcanary.contract import Violation, fail_reason_labels
from kvcanary.engine.config import EngineConfig
from kvcanary.engine.model import ModelConfig
from kvcanary.engine.plants import PLANT_NAMES, PlantRecord

SEEDS = (0, 1, 2)
VOCAB = 64
WARMUP = 6
WINDOW = 4  # engine steps between a journal record and the violation that names its slot
AFTER = 8  # steps served after the first firing


@dataclass(frozen=True)
class Scenario:
    """How to make one plant fire: the model, engine sizes and the workload."""

    model_kind: str
    speculative_num_draft_tokens: int
    num_slots: int
    max_running_requests: int


# spec_rollback_stale needs rejected drafts: greedy sampling on the tiny model with n-gram
# drafts (the oracle model's drafts are always accepted).
SCENARIOS = {
    name: Scenario("oracle", 0, 160, 6) for name in PLANT_NAMES if name != "spec_rollback_stale"
} | {"spec_rollback_stale": Scenario("tiny", 3, 100, 3)}

TINY = ModelConfig(vocab_size=VOCAB, hidden=32, num_layers=1, num_heads=2, num_kv_heads=1,
                   head_dim=16, intermediate=64)  # fmt: skip


def make_stack(plant: str, seed: int, *, planted: bool) -> Stack:
    sc = SCENARIOS[plant]
    settings = RunSettings(
        canary=CanaryConfig(
            mode=CanaryMode.LOG,
            real_data=RealDataMode.PARTIAL,
            sweep_interval=4,
            stats_print_every_n_steps=0,
        ),
        engine=EngineConfig(
            num_slots=sc.num_slots,
            max_context_len=128,
            vocab_size=VOCAB,
            max_running_requests=sc.max_running_requests,
            max_batch_size=sc.max_running_requests,
            chunked_prefill_size=16,
            max_prefill_tokens=48,
            speculative_num_draft_tokens=sc.speculative_num_draft_tokens,
            seed=seed,
            plants=(plant,) if planted else (),
            plant_warmup_steps=WARMUP,
        ),
        model=TINY if sc.model_kind == "tiny" else ModelConfig(vocab_size=VOCAB, seed=seed),
        model_kind=sc.model_kind,
    )
    return build_stack(settings, kernels="reference")


def arrivals(plant: str, seed: int) -> list[tuple[int, str, tuple[int, ...], int]]:
    """`(arrival step, id, prompt, max_new_tokens)`: shared system prompts under pool pressure,
    or, for speculation, a few long decodes that fill the pool."""
    if SCENARIOS[plant].speculative_num_draft_tokens:
        rng = random.Random(seed)
        prompts = [tuple(rng.randrange(VOCAB) for _ in range(16)) for _ in range(3)]
        return [(0, f"s{i}", p, 40) for i, p in enumerate(prompts)]
    spec = WorkloadSpec(num_requests=24, seed=seed, vocab_size=VOCAB, system_prompt_len=24,
                        user_len=(4, 40), max_new_tokens=(4, 20), abort_fraction=0.0)  # fmt: skip
    return [
        (r.arrival_step, r.request_id, r.prompt, r.max_new_tokens) for r in build_workload(spec)
    ]


def serve(stack: Stack, plant: str, seed: int, *, stop_after_fire: bool) -> int:
    """Serve the scenario's workload; with `stop_after_fire`, stop `AFTER` steps after the
    plant's latest journal record (a retracted request resumes, and reads its stale row, some
    steps after the firing). Returns the steps run."""
    engine = stack.engine
    pending = arrivals(plant, seed)
    for step in range(300):
        while pending and pending[0][0] <= step:
            _, rid, prompt, new = pending.pop(0)
            engine.add_request(rid, prompt, new, stack.sampling(rid))
        if not (pending or engine.has_work()):
            if stop_after_fire:
                assert engine.plant_journal(), f"{plant} never fired"
            return step
        engine.step()
        journal = engine.plant_journal()
        follow_up_due = engine.scheduler.plants.awaiting_follow_up()
        if stop_after_fire and journal and not follow_up_due and step >= journal[-1].step + AFTER:
            return step + 1
    raise AssertionError(f"{plant}: run did not finish in 300 steps")


def caught(records: list[PlantRecord], violations: tuple[Violation, ...] | list[Violation]) -> bool:
    """Whether a violation names a journaled slot within `WINDOW` steps after its record."""
    return any(
        v.slot_idx in r.slots and r.step <= v.step_when_pumped <= r.step + WINDOW
        for r in records
        for v in violations
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("plant", PLANT_NAMES)
def test_plant_fires_and_the_canary_names_its_slot(plant: str, seed: int) -> None:
    stack = make_stack(plant, seed, planted=True)
    serve(stack, plant, seed, stop_after_fire=True)
    journal = stack.engine.plant_journal()
    assert journal and all(r.plant == plant for r in journal)
    first = journal[0]
    assert first.counted and first.step >= WARMUP
    violations = stack.hooks.violations
    assert violations, f"{plant} seed {seed}: fired ({first.description}) but nothing reported"
    assert min(v.step_when_pumped for v in violations) >= first.step, "violation before the plant"
    reasons = sorted(
        {label for v in violations for label in fail_reason_labels(v.fail_reason_bits)}
    )
    assert caught(journal, violations), (
        f"{plant} seed {seed}: no violation names a journaled slot within {WINDOW} steps; "
        f"journal={journal} first violations={[(v.step_when_pumped, v.slot_idx) for v in violations[:5]]} "
        f"reasons={reasons}"
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("plant", PLANT_NAMES)
def test_same_seed_without_the_plant_is_clean(plant: str, seed: int) -> None:
    stack = make_stack(plant, seed, planted=False)
    steps = serve(stack, plant, seed, stop_after_fire=False)
    assert steps > WARMUP + AFTER
    assert stack.engine.plant_journal() == []
    assert stack.hooks.violations == []
    assert stack.canary is not None and stack.canary.total_violations == 0
