"""Planted engine bugs (engine/plants.py): validation, each plant fires after its warm-up with a
right journal record, firing is deterministic and bounded, and an unplanted engine is unchanged."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from engine_fakes import OracleRunner, check_scheduler, expected_output, sampling_key

from kvcanary.engine.config import EngineConfig
from kvcanary.engine.engine import Engine
from kvcanary.engine.plan import ChunkOutput, SamplingSpec, StepOutput, StepPlan
from kvcanary.engine.plants import PLANT_NAMES, PlantRecord
from kvcanary.engine.table import ListReqToTokenTable

VOCAB = 97
WARMUP = 4


class LenientRunner(OracleRunner):
    """The oracle runner's sampling without its asserts: a planted engine corrupts history (and
    a freed-while-used slot can even be handed to two chunks of one forward)."""

    def run(self, plan: StepPlan) -> StepOutput:
        """Sample the oracle's tokens for every chunk; check nothing."""
        self.plans.append(plan)
        outs = []
        for chunk in plan.chunks:
            end = chunk.prefix_len + len(chunk.input_ids)
            key = sampling_key(chunk)
            sampled = tuple(
                self.oracle.next_token(key, p) for p in range(end - chunk.num_samples, end)
            )
            outs.append(ChunkOutput(chunk.request_id, sampled))
        return StepOutput(tuple(outs))


def make_engine(
    plants: tuple[str, ...] = (), *, oracle_runner: bool = False, **overrides: object
) -> tuple[Engine, ListReqToTokenTable]:
    params: dict[str, object] = dict(
        num_slots=120, max_context_len=96, vocab_size=VOCAB, max_running_requests=5,
        max_batch_size=5, chunked_prefill_size=12, max_prefill_tokens=32,
        plants=plants, plant_warmup_steps=WARMUP,
    )  # fmt: skip
    params.update(overrides)
    cfg = EngineConfig(**params)  # type: ignore[arg-type]
    table = ListReqToTokenTable(cfg.max_running_requests + 1, cfg.max_context_len)
    runner_cls = OracleRunner if oracle_runner else LenientRunner
    return Engine(cfg, runner_cls(VOCAB, table), table=table), table


def workload(seed: int, n: int = 20) -> list[tuple[str, list[int], int]]:
    """Requests sharing two system prompts, long enough to chunk and to press on the pool."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(20)] for _ in range(2)]
    return [
        (f"r{i}", rng.choice(systems) + [rng.randrange(VOCAB) for _ in range(rng.randint(4, 30))],
         rng.randint(4, 16))
        for i in range(n)
    ]  # fmt: skip


def serve_until(
    engine: Engine,
    requests: list[tuple[str, list[int], int]],
    stop: Callable[[Engine, int], bool],
    *,
    per_step: int = 3,
    spec: Callable[[str], SamplingSpec] = lambda rid: SamplingSpec(),
    max_steps: int = 400,
) -> int:
    """Feed `per_step` requests per step and step until `stop(engine, step)` or idle; returns
    the number of steps run."""
    pending = list(requests)
    for step in range(max_steps):
        for rid, prompt, new in pending[:per_step]:
            engine.add_request(rid, prompt, new, spec(rid))
        del pending[:per_step]
        if not (pending or engine.has_work()):
            return step
        engine.step()
        if stop(engine, step):
            return step + 1
    raise AssertionError("the plant never fired")


def fired(engine: Engine, step: int) -> bool:
    return bool(engine.plant_journal())


def only_record(engine: Engine, name: str) -> PlantRecord:
    counted = [r for r in engine.plant_journal() if r.counted]
    assert len(counted) == 1, counted
    rec = counted[0]
    assert rec.plant == name and rec.step >= WARMUP
    assert len(rec.slots) == len(rec.positions) >= 1 and rec.description
    return rec


def holders(engine: Engine, slot: int) -> int:
    return sum(r.slots.count(slot) for r in engine.scheduler.running)


# ---- configuration ------------------------------------------------------------------------


def test_unknown_plant_is_a_one_line_error_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError) as err:
        EngineConfig(num_slots=8, max_context_len=8, vocab_size=8, plants=("radix_evict",))
    assert str(err.value) == (
        "EngineConfig.plants has unknown plant 'radix_evict'; valid names: radix_evict_locked, "
        "chunk_boundary_off_by_one, retract_stale_row, spec_rollback_stale, prefix_reused_slots"
    )
    with pytest.raises(ValueError, match=r"plants must be a tuple of plant names"):
        EngineConfig(num_slots=8, max_context_len=8, vocab_size=8, plants="retract_stale_row")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"plant_max_fires must be >= 1, got 0"):
        EngineConfig(num_slots=8, max_context_len=8, vocab_size=8, plant_max_fires=0)
    assert len(set(PLANT_NAMES)) == len(PLANT_NAMES) == 5


def test_unplanted_and_unarmed_engines_are_unchanged() -> None:
    """Plants that never arm (warm-up past the run) change nothing: same plans, outputs and
    stats as the plain engine, and history stays right (the asserting oracle runner)."""
    results = []
    for plants, warmup in (((), 10), (PLANT_NAMES, 10_000)):
        engine, _ = make_engine(plants, oracle_runner=True, plant_warmup_steps=warmup,
                                speculative_num_draft_tokens=2)  # fmt: skip
        outputs: dict[str, tuple[int, ...]] = {}
        pending = workload(0)
        plans = []
        while pending or engine.has_work():
            for rid, prompt, new in pending[:3]:
                engine.add_request(rid, prompt, new)
            del pending[:3]
            result = engine.step()
            plans.append(result.plan)
            check_scheduler(engine.scheduler)
            outputs.update({f.request_id: f.output for f in result.finished})
        assert engine.plant_journal() == []
        assert not engine.scheduler.kv.allocator.tolerate_unheld
        results.append((plans, outputs, engine.stats()))
    assert results[0] == results[1]
    stats = results[0][2]
    assert stats.retractions > 0 and stats.evictions > 0 and stats.spec_draft_tokens > 0
    for rid, prompt, new in workload(0):
        assert list(results[0][1][rid]) == expected_output(rid, len(prompt), new, VOCAB)


# ---- each plant ---------------------------------------------------------------------------


def test_radix_evict_locked_frees_a_matched_prefix_still_mapped() -> None:
    engine, table = make_engine(("radix_evict_locked",))
    serve_until(engine, workload(1), fired)
    rec = only_record(engine, "radix_evict_locked")
    assert rec.positions == tuple(range(rec.positions[0], rec.positions[0] + len(rec.slots)))
    cached = {slot for slot, _, _ in engine.scheduler.prefix_cache.walk()}
    assert not cached & set(rec.slots), "the node is evicted"
    assert rec.row != 0, "a running row mapped the node when it was evicted"
    alloc = engine.scheduler.kv.allocator
    assert alloc.tolerate_unheld
    if any(r.row == rec.row for r in engine.scheduler.running):  # not retracted meanwhile
        row = table.read(rec.row, rec.positions[-1] + 1)
        assert [row[p] for p in rec.positions] == list(rec.slots), "the row still maps them"
        assert all(alloc.refcount(s) < holders(engine, s) for s in rec.slots), "locks ignored"


def test_chunk_boundary_off_by_one_shifts_the_window() -> None:
    engine, table = make_engine(("chunk_boundary_off_by_one",))
    serve_until(engine, workload(2), fired)
    rec = only_record(engine, "chunk_boundary_off_by_one")
    req = engine.request(rec.request_id)
    assert req.row == rec.row
    row = table.read(rec.row, rec.positions[-1] + 1)
    assert [row[p] for p in rec.positions] == list(rec.slots)
    start = req.slots.index(rec.slots[0])  # where the chunk really starts
    assert abs(rec.positions[0] - start) == 1, "one position early or late"
    assert req.slots[start : start + len(rec.slots)] == list(rec.slots), "out_slots stay right"


def test_retract_stale_row_frees_and_resumes_through_the_stale_row() -> None:
    engine, table = make_engine(("retract_stale_row",))
    serve_until(engine, workload(3), fired)
    rec = only_record(engine, "retract_stale_row")
    req = engine.request(rec.request_id)
    assert req.status.value == "waiting" and req.row == 0 and rec.row != 0
    assert rec.positions == tuple(range(len(rec.slots)))
    alloc = engine.scheduler.kv.allocator
    assert any(alloc.refcount(s) < 1 + holders(engine, s) for s in rec.slots)

    def resumed(e: Engine, step: int) -> bool:
        return any("resumed" in r.description for r in e.plant_journal())

    serve_until(engine, [], resumed)
    # slot-reuse records ("handed out again") may come first
    follow = next(r for r in engine.plant_journal() if "resumed" in r.description)
    assert follow.request_id == rec.request_id and follow.slots == rec.slots
    assert follow.step > rec.step and follow.positions == rec.positions
    if req.row:
        assert table.read(req.row, len(rec.slots)) == list(rec.slots)


def test_spec_rollback_stale_leaves_rejected_drafts_mapped_and_free() -> None:
    engine, table = make_engine(("spec_rollback_stale",), speculative_num_draft_tokens=3)
    serve_until(engine, workload(4, n=4), fired)  # greedy specs: n-gram drafts get rejected
    rec = only_record(engine, "spec_rollback_stale")
    req = engine.request(rec.request_id)
    assert req.row == rec.row and len(req.slots) == req.num_computed == rec.positions[0]
    row = table.read(rec.row, rec.positions[-1] + 1)
    assert [row[p] for p in rec.positions] == list(rec.slots), "table not rolled back"
    alloc = engine.scheduler.kv.allocator
    assert all(alloc.refcount(s) == 0 for s in rec.slots), "freed while mapped"

    def writes_again(e: Engine, step: int) -> bool:
        return any("writes its freed draft" in r.description for r in e.plant_journal())

    serve_until(engine, [], writes_again)
    reuse = next(r for r in engine.plant_journal() if "writes its freed draft" in r.description)
    assert not reuse.counted and reuse.positions[0] == rec.positions[0]
    assert reuse.slots == rec.slots[: len(reuse.slots)]


def test_prefix_reused_slots_keeps_a_freed_leaf_matchable() -> None:
    engine, _ = make_engine(("prefix_reused_slots",))
    serve_until(engine, workload(5), fired)
    rec = only_record(engine, "prefix_reused_slots")
    assert rec.row == 0
    walked = {(slot, pos) for slot, pos, _ in engine.scheduler.prefix_cache.walk()}
    assert set(zip(rec.slots, rec.positions, strict=True)) <= walked, "still linked"
    alloc = engine.scheduler.kv.allocator
    assert all(alloc.refcount(s) == holders(engine, s) for s in rec.slots), "tree ref dropped"


def test_prefix_reused_slots_match_is_journaled() -> None:
    """Identical prompts (and retracted requests' own cached prefixes): a later admission
    matches the freed leaf, and the match is journaled with its row."""
    engine, _ = make_engine(("prefix_reused_slots",))
    rng = random.Random(6)
    prompt = [rng.randrange(VOCAB) for _ in range(30)]
    fillers = [(f"f{i}", [rng.randrange(VOCAB) for _ in range(40)], 8) for i in range(8)]
    reqs = [("a", prompt, 4), *fillers, ("b", prompt, 4), ("c", prompt, 4)]
    serve_until(engine, reqs, lambda e, s: any("prefix match" in r.description for r in e.plant_journal()),
                per_step=1)  # fmt: skip
    journal = engine.plant_journal()
    fire = journal[0]
    # reuse records ("handed out again") may come between the firing and the match
    match = next(r for r in journal[1:] if "prefix match" in r.description)
    assert fire.counted and not match.counted and match.step >= fire.step
    assert set(zip(match.slots, match.positions, strict=True)) <= set(
        zip(fire.slots, fire.positions, strict=True)
    )
    assert match.row != 0 and match.request_id


@pytest.mark.parametrize("name", PLANT_NAMES)
def test_firing_is_deterministic_and_bounded(name: str) -> None:
    journals = []
    for _ in range(2):
        engine, _ = make_engine((name,), speculative_num_draft_tokens=3, plant_max_fires=2)
        reqs = workload(4, n=4) if name == "spec_rollback_stale" else workload(7)
        serve_until(engine, reqs, lambda e, s: s >= 120 or not e.has_work())
        journals.append(engine.plant_journal())
    assert journals[0] == journals[1]
    counted = [r for r in journals[0] if r.counted]
    assert 1 <= len(counted) <= 2 and all(r.step >= WARMUP for r in counted)
