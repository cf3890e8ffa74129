"""Test doubles for the integer side of the engine: a model-free oracle runner that also acts as
a miniature canary (it remembers which (token, position) each slot holds and checks every
request's history through the `req_to_token` table before each forward)."""

from __future__ import annotations

from collections.abc import Iterator

from kvcanary.contract import TokenOracle, request_key
from kvcanary.engine.config import EngineConfig
from kvcanary.engine.plan import ChunkOutput, ScheduledChunk, StepOutput, StepPlan
from kvcanary.engine.scheduler import Scheduler
from kvcanary.engine.table import ListReqToTokenTable, ReqToTokenTable


def sampling_key(chunk: ScheduledChunk) -> int:
    """The oracle key the fake sampler uses: the spec's key for oracle requests, else the id's."""
    if chunk.sampling.oracle:
        return chunk.sampling.oracle_key
    return request_key(chunk.request_id)


class OracleRunner:
    """`Runner` that samples `TokenOracle.next_token` and checks KV provenance per slot."""

    def __init__(self, vocab_size: int, table: ReqToTokenTable) -> None:
        self.oracle = TokenOracle(vocab_size)
        self.table = table
        self.records: dict[int, tuple[int, int]] = {}  # slot -> (token, position) last written
        self.plans: list[StepPlan] = []
        self.fail_next = False

    def run(self, plan: StepPlan) -> StepOutput:
        """Check the plan against the table and the slot records, write records, sample."""
        self.plans.append(plan)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected runner failure")
        written: set[int] = set()
        for chunk in plan.chunks:
            self._check_history(chunk)
            assert not written & set(chunk.out_slots), "two chunks write the same slot"
            written |= set(chunk.out_slots)
        outs = []
        for chunk in plan.chunks:
            for j, (tok, slot) in enumerate(zip(chunk.input_ids, chunk.out_slots, strict=True)):
                self.records[slot] = (tok, chunk.prefix_len + j)
            key = sampling_key(chunk)
            n = len(chunk.input_ids)
            positions = range(chunk.prefix_len + n - chunk.num_samples, chunk.prefix_len + n)
            sampled = tuple(self.oracle.next_token(key, p) for p in positions)
            outs.append(ChunkOutput(chunk.request_id, sampled))
        return StepOutput(tuple(outs))

    def _check_history(self, chunk: ScheduledChunk) -> None:
        n = len(chunk.input_ids)
        assert len(chunk.out_slots) == n and n >= 1
        assert chunk.num_samples in (0, 1, n)
        row = self.table.read(chunk.row, chunk.prefix_len + n)
        assert row[chunk.prefix_len :] == list(chunk.out_slots), "table does not hold out_slots"
        assert 0 not in chunk.out_slots
        truth = chunk.truth_tokens
        assert chunk.input_ids[0] == truth[chunk.prefix_len], "first input is not the next token"
        for pos, slot in enumerate(row[: chunk.prefix_len]):
            assert slot != 0, f"{chunk.request_id}: position {pos} has no slot"
            assert self.records.get(slot) == (truth[pos], pos), (
                f"{chunk.request_id}: slot {slot} at position {pos} holds {self.records.get(slot)}, "
                f"expected {(truth[pos], pos)}"
            )


def make_scheduler(**overrides: object) -> tuple[Scheduler, OracleRunner, ListReqToTokenTable]:
    """A scheduler over a list table plus an oracle runner reading the same table."""
    params: dict[str, object] = {"num_slots": 64, "max_context_len": 48, "vocab_size": 97}
    params.update(overrides)
    cfg = EngineConfig(**params)  # type: ignore[arg-type]
    table = ListReqToTokenTable(cfg.max_running_requests + 1, cfg.max_context_len)
    return Scheduler(cfg, table), OracleRunner(cfg.vocab_size, table), table


def step(sched: Scheduler, runner: OracleRunner) -> StepPlan | None:
    """One schedule -> run -> postprocess round."""
    plan = sched.schedule()
    if plan is not None:
        sched.postprocess(plan, runner.run(plan))
    return plan


def run_all(sched: Scheduler, runner: OracleRunner, max_steps: int = 10_000) -> Iterator[StepPlan]:
    """Step until idle, checking integrity after each step; yields the plans."""
    for _ in range(max_steps):
        if not sched.has_work():
            return
        plan = step(sched, runner)
        check_scheduler(sched)
        if plan is not None:
            yield plan
    raise AssertionError("scheduler did not go idle")


def expected_output(request_id: str, prompt_len: int, n: int, vocab_size: int) -> list[int]:
    """What the oracle runner makes a non-oracle request generate."""
    oracle = TokenOracle(vocab_size)
    key = request_key(request_id)
    return [oracle.token(key, prompt_len + i) for i in range(n)]


def check_scheduler(sched: Scheduler) -> None:
    """The scheduler's own integrity check plus an independent recount of slot references."""
    sched.check_integrity()
    kv = sched.kv
    holders: dict[int, int] = {}
    for slot, _, _ in sched.prefix_cache.walk():
        holders[slot] = holders.get(slot, 0) + 1
    for req in sched.running:
        for slot in req.slots:
            holders[slot] = holders.get(slot, 0) + 1
    assert kv.allocator.num_held == len(holders), "a slot leaked"
    assert all(kv.allocator.refcount(s) == n for s, n in holders.items())
    table = kv.table
    assert isinstance(table, ListReqToTokenTable)
    assert set(table.nonzero_rows()) <= {r.row for r in sched.running}, "a released row is dirty"
