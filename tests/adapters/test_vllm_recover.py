"""Mode `recover` inside vLLM, without an engine: incidents -> vLLM requests and blocks
(`damage_of`), and what `SchedulerRecovery` does to a scheduler (a fake with vLLM's attribute
names; test_vllm_hooks.py pins those names against the installed vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvcanary.adapters.vllm.recover import Damage, SchedulerRecovery, WorkerDamage, damage_of
from kvcanary.adapters.vllm.sweep import FIRST, LedgerEntry, ParentLedger
from kvcanary.contract import FailReason, Incident, IncidentRow

pytestmark = pytest.mark.vllm

B = 32
CHAIN = int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)


def _row(req_row: int, pos: int) -> IncidentRow:
    return IncidentRow(view_row=req_row - 1, req_row=req_row, first_position=pos, slots=(),
                       fail_reason_bits=CHAIN)  # fmt: skip


def _incident(*rows: IncidentRow, slots: tuple[int, ...] = (), stage: str = "head") -> Incident:
    return Incident(stage=stage, tag=0, step=3, violations=max(1, len(rows)),
                    fail_reason_bits=CHAIN, slots=slots, rows=rows)  # fmt: skip


def test_damage_names_each_request_its_own_block_at_the_first_failing_position() -> None:
    tables = {"a": [5, 6, 7], "b": [5, 9], "c": [11]}
    found = damage_of(
        [_incident(_row(1, 70), _row(2, 40)), _incident(_row(1, 33)),
         _incident(_row(9, 0)), _incident(slots=(4 * B + 3, 12 * B), stage="sweep")],
        req_ids=["a", "b", "c"], block_ids_of=tables.get, block_size=B,
    )  # fmt: skip
    assert found.damage == [Damage("a", 33, 1), Damage("b", 40, 1)]  # earliest position wins
    assert found.report_blocks == {7, 9}  # each request's own last block, not the slots' blocks
    assert found.sweep_blocks == {4, 12}  # SWEEP: blocks, no request; row 9 is outside


def test_a_position_past_the_table_damages_the_last_block() -> None:
    found = damage_of([_incident(_row(1, 500))], req_ids=["a"], block_ids_of={"a": [3, 4]}.get,
                      block_size=B)  # fmt: skip
    assert found.damage == [Damage("a", 500, 1)] and found.report_blocks == {4}
    first = damage_of([_incident(_row(1, 0))], req_ids=["a"], block_ids_of={"a": [3, 4]}.get,
                      block_size=B)  # fmt: skip
    assert first.damage == [Damage("a", 0, 0)] and first.report_blocks == {4}


# ---------------------------------------------------------------------- a fake vLLM scheduler
@dataclass
class _Block:
    block_id: int
    block_hash: Any = None


@dataclass(eq=False)
class _Req:
    request_id: str
    num_computed_tokens: int
    status: Any = None
    finished: bool = False

    def is_finished(self) -> bool:
        return self.finished


@dataclass
class _Pool:
    blocks: list[_Block]


@dataclass
class _Manager:
    tables: dict[str, list[int]]
    block_pool: _Pool
    evicted: set[int] = field(default_factory=set)

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self.tables[req_id],)

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.evicted |= block_ids
        for b in block_ids:
            self.block_pool.blocks[b].block_hash = None


class _Scheduler:
    def __init__(self, tables: dict[str, list[int]], *, recompute: bool = True) -> None:
        from vllm.v1.request import RequestStatus

        pool = _Pool([_Block(i, f"h{i}" if i else None) for i in range(16)])
        self.kv_cache_manager = _Manager(tables, pool)
        self.requests = {r: _Req(r, len(t) * B, RequestStatus.RUNNING) for r, t in tables.items()}
        self.running = list(self.requests.values())
        self.block_size = B
        self.recompute_kv_load_failures = recompute
        self.encoder_cache_mismatch_reqs: set[str] = set()
        self.preempted: list[str] = []
        self.vllm_truncated: list[str] = []

    def _preempt_request(self, request: _Req, timestamp: float,
                         drop_stale_output: bool = False) -> None:  # fmt: skip
        from vllm.v1.request import RequestStatus

        assert request not in self.running and drop_stale_output
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.preempted.append(request.request_id)

    def _handle_invalid_blocks(self, invalid_block_ids: set[int],
                               num_scheduled_tokens: dict[str, int]) -> set[str]:  # fmt: skip
        # vLLM's rule, reduced: every holder of a reported block is skipped
        hit = {r for r, t in self.kv_cache_manager.tables.items() if invalid_block_ids & set(t)}
        self.vllm_truncated.extend(sorted(hit))
        return hit

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> set[str]:
        out = model_runner_output.kv_connector_output
        scheduled = scheduler_output or {}
        return self._handle_invalid_blocks(out.invalid_block_ids, scheduled) \
            if out.invalid_block_ids else set()  # fmt: skip


@dataclass
class _Meta:
    damage: tuple[tuple[str, int, int], ...] = ()
    sweep_blocks: tuple[int, ...] = ()


@dataclass
class _KvOut:
    invalid_block_ids: set[int]
    kv_connector_worker_meta: Any


@dataclass
class _RunnerOut:
    kv_connector_output: _KvOut


def _step(sched: _Scheduler, blocks: set[int], meta: _Meta,
          scheduled: dict[str, int] | None = None) -> set[str]:  # fmt: skip
    out = sched.update_from_output(scheduled, _RunnerOut(_KvOut(blocks, meta)))
    return out  # type: ignore[no-any-return]


def _ledger(parents: dict[int, int]) -> ParentLedger:
    ledger = ParentLedger()
    for i, (b, parent) in enumerate(parents.items()):
        ledger.entries[b] = LedgerEntry(block_hash=f"h{b}", index=i, parent_id=parent,
                                        parent_hash=None)  # fmt: skip
    return ledger


def test_a_damaged_request_resumes_into_fresh_blocks_and_its_sharer_is_untouched() -> None:
    # stale-prefix class: "a" was handed block 7, which "b" owns; "a" reads the wrong KV
    sched = _Scheduler({"a": [3, 7, 8], "b": [7, 9]})
    rec = SchedulerRecovery(ledger=_ledger({3: FIRST, 7: 3, 8: 7, 9: 7, 10: 8}))
    rec.bind(sched)
    skip = _step(sched, {7}, _Meta(damage=(("a", 40, 1),)))
    assert skip == {"a", "b"}  # vLLM drops both holders' tokens of this step
    assert sched.preempted == ["a"]  # only the damaged request gives up its blocks
    assert sched.requests["a"] not in sched.running and sched.requests["b"] in sched.running
    # a's blocks from the bad one on and every ledger descendant leave the prefix cache, so its
    # resume cannot hit them again; b keeps its table and its KV
    assert sched.kv_cache_manager.evicted == {7, 8, 9, 10}
    assert sched.kv_cache_manager.tables["b"] == [7, 9] and 3 not in sched.kv_cache_manager.evicted
    assert rec.figures.recoveries == 1 and rec.figures.recompute_tokens == 3 * B - B
    assert rec.figures.failed == 0 and not sched.encoder_cache_mismatch_reqs


def test_requests_holding_blocks_written_on_bad_kv_are_damaged_too() -> None:
    # "a" read a bad block 3 and wrote blocks 7 and 8 in this forward (64 tokens): their upper
    # layers were computed from bad KV although layer 0 is right. "c" hit block 7 in the same
    # schedule; "d" shares only block 3, which "a" did not write.
    sched = _Scheduler({"a": [3, 7, 8], "c": [7, 12], "d": [3, 13]})
    rec = SchedulerRecovery()
    rec.bind(sched)
    skip = _step(sched, {8}, _Meta(damage=(("a", 10, 0),)), scheduled={"a": 64})
    assert skip == {"a", "c"} and sched.preempted == ["a", "c"]
    assert sched.requests["d"] in sched.running
    assert {7, 12} <= sched.kv_cache_manager.evicted and 13 not in sched.kv_cache_manager.evicted


def test_damage_vllms_prefix_rule_misses_is_still_skipped() -> None:
    # TAIL on a block written this step: vLLM finds no reported block in the computed prefix
    sched = _Scheduler({"a": [3, 4]})
    sched._handle_invalid_blocks = lambda blocks, n: set()  # type: ignore[method-assign]
    rec = SchedulerRecovery()
    rec.bind(sched)
    assert _step(sched, {4}, _Meta(damage=(("a", 40, 1),))) == {"a"}
    assert sched.preempted == ["a"]


def _resume_and_damage_a(sched: _Scheduler) -> None:
    """One more step in which request `a` (resumed first if it was preempted) reads bad block 4."""
    from vllm.v1.request import RequestStatus

    req = sched.requests["a"]
    if req not in sched.running:  # vLLM resumes the preempted request
        req.status = RequestStatus.RUNNING
        sched.running.append(req)
    _step(sched, {4}, _Meta(damage=(("a", 40, 1),)))


def test_the_retry_budget_ends_in_a_per_request_error() -> None:
    sched = _Scheduler({"a": [3, 4], "c": [5]})
    rec = SchedulerRecovery(retries=2)
    rec.bind(sched)
    for attempt in range(3):
        _resume_and_damage_a(sched)
        assert (sched.encoder_cache_mismatch_reqs == {"a"}) == (attempt == 2)
    assert sched.preempted == ["a", "a"] and rec.figures.failed == 1
    assert rec.figures.failed_requests == {"a"} and "a" not in rec.figures.recovered_requests
    assert sched.requests["c"] in sched.running  # everyone else keeps running


def test_a_finished_request_tells_its_recomputes_once() -> None:
    sched = _Scheduler({"a": [3, 4], "c": [5]})
    rec = SchedulerRecovery(retries=2)
    rec.bind(sched)
    for _ in range(2):
        _resume_and_damage_a(sched)
    assert rec.finished("c") is None  # never recomputed: no kv_transfer_params of ours
    assert rec.finished("a") == {"kvcanary_recomputes": 2}
    assert rec.finished("a") is None and "a" not in rec.attempts  # forgotten once finished


def test_policy_fail_fails_at_the_first_incident_through_vllm() -> None:
    sched = _Scheduler({"a": [3, 4]}, recompute=False)
    rec = SchedulerRecovery()
    rec.bind(sched)
    assert _step(sched, {4}, _Meta(damage=(("a", 40, 1),))) == {"a"}
    # vLLM fails the returned ids itself under `fail`; nothing is preempted or queued twice
    assert not sched.preempted and not sched.encoder_cache_mismatch_reqs
    assert rec.figures.failed == 1


def test_a_sweep_evicts_the_block_and_its_descendants_only() -> None:
    sched = _Scheduler({"a": [2, 3]})
    rec = SchedulerRecovery(ledger=_ledger({5: FIRST, 6: 5, 11: 6, 12: FIRST}))
    rec.bind(sched)
    assert _step(sched, set(), _Meta(sweep_blocks=(6,))) == set()
    assert sched.kv_cache_manager.evicted == {6, 11}
    assert not sched.preempted and sched.requests["a"] in sched.running


def test_finished_or_unknown_requests_are_left_alone() -> None:
    sched = _Scheduler({"a": [3]})
    sched.requests["a"].finished = True
    rec = SchedulerRecovery()
    rec.bind(sched)
    _step(sched, {3}, _Meta(damage=(("a", 0, 0), ("gone", 0, 0))))
    assert not sched.preempted and rec.figures.incidents == 0


def test_worker_damage_round_trips_through_the_meta() -> None:
    from kvcanary.adapters.vllm.connector import CanaryWorkerMeta
    from kvcanary.adapters.vllm.recover import _worker_damage

    one = CanaryWorkerMeta(damage=(("a", 3, 0),), sweep_blocks=(4,))
    two = CanaryWorkerMeta(damage=(("b", 40, 1),), sweep_blocks=(4, 9))
    merged = one.aggregate(two)
    got = _worker_damage(merged)
    assert got == WorkerDamage(damage=[Damage("a", 3, 0), Damage("b", 40, 1)],
                               sweep_blocks={4, 9})  # fmt: skip
    assert _worker_damage(CanaryWorkerMeta()) is None and _worker_damage(None) is None


def test_recover_counters_reach_vllms_connector_stats() -> None:
    from kvcanary.adapters.vllm.connector import RECOVER_COUNTERS, KVCanaryStats

    sched = _Scheduler({"a": [3, 4]})
    rec = SchedulerRecovery()
    rec.bind(sched)
    assert not any(rec.take_counters().values())
    _step(sched, {4}, _Meta(damage=(("a", 40, 1),)))
    first = rec.take_counters()
    assert first == {"incidents": 1, "recoveries": 1, "recompute_tokens": B, "requests_failed": 0}
    assert not any(rec.take_counters().values())  # deltas, not totals
    worker = KVCanaryStats(data={"forwards": 2, "checks": 10, "sweeps": 0, "violations": {}})
    merged = worker.aggregate(KVCanaryStats(data=first))
    assert {k: merged.data[k] for k in RECOVER_COUNTERS} == first
    assert merged.data["forwards"] == 2 and not KVCanaryStats(data=first).is_empty()
