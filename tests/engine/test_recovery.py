"""Mode `recover` in the reference engine (SPEC §14.3): what the scheduler does with incidents."""

from __future__ import annotations

import dataclasses
import re

import pytest
from engine_fakes import OracleRunner, check_scheduler, expected_output, make_scheduler
from hypothesis import given
from hypothesis import strategies as st

from kvcanary.contract import FailReason, Incident, IncidentRow
from kvcanary.engine.plan import StepOutput, StepPlan
from kvcanary.engine.recovery import damage_by_chunk, recovery_point
from kvcanary.engine.request import RequestStatus
from kvcanary.engine.scheduler import Scheduler

CHAIN = int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
TOKEN = int(FailReason.WRITE_TOKEN_MISMATCH)


def _incident(
    chunk_index: int, position: int, slots: tuple[int, ...], bits: int = CHAIN
) -> Incident:
    row = IncidentRow(view_row=chunk_index, req_row=0, first_position=position, slots=slots,
                      fail_reason_bits=bits)  # fmt: skip
    return Incident(stage="head", tag=0, step=0, violations=1, fail_reason_bits=bits,
                    slots=slots, rows=(row,))  # fmt: skip


def _run(sched: Scheduler, runner: OracleRunner, hit: dict[int, tuple[str, int]] | None = None,
         always: str | None = None) -> dict[str, list[int]]:  # fmt: skip
    """Serve to idle; at plan number `n` in `hit`, report an incident for (request, position);
    `always` reports one for that request in every forward it is in."""
    outputs: dict[str, list[int]] = {}
    for n in range(2000):
        if not sched.has_work():
            return outputs
        plan = sched.schedule()
        if plan is None:
            continue
        out = runner.run(plan)
        incidents = []
        for i, chunk in enumerate(plan.chunks):
            target = (hit or {}).get(n)
            if (target and target[0] == chunk.request_id) or chunk.request_id == always:
                pos = target[1] if target and target[0] == chunk.request_id else chunk.prefix_len
                slot = sched.get(chunk.request_id).slots[
                    min(pos, len(sched.get(chunk.request_id).slots) - 1)
                ]
                incidents.append(_incident(i, pos, (slot,)))
        for req in sched.postprocess(plan, dataclasses.replace(out, incidents=tuple(incidents))):
            if req.status is RequestStatus.FINISHED:
                outputs[req.request_id] = list(req.output)
        check_scheduler(sched)
    raise AssertionError("did not go idle")


def _load(sched: Scheduler) -> None:
    sched.add_request("a", [1, 2, 3, 4, 5, 6], 10)
    sched.add_request("b", [1, 2, 3, 9, 9], 12)
    sched.add_request("c", [7, 8], 9)


def test_incident_in_one_row_leaves_every_output_identical() -> None:
    clean_sched, clean_runner, _ = make_scheduler(chunked_prefill_size=4)
    _load(clean_sched)
    clean = _run(clean_sched, clean_runner)
    sched, runner, _ = make_scheduler(chunked_prefill_size=4)
    _load(sched)
    got = _run(sched, runner, hit={4: ("b", 2), 9: ("a", 7)})
    assert got == clean and set(got) == {"a", "b", "c"}
    assert got["b"] == expected_output("b", 5, 12, 97)
    stats = sched.stats()
    assert stats.incidents == 2 and stats.recoveries == 2 and stats.requests_failed == 0
    assert stats.requests_recovered == 2 and stats.recompute_tokens > 0
    assert stats.recoveries_completed == 2


def test_recompute_uses_fresh_slots_never_the_failing_ones() -> None:
    sched, runner, _ = make_scheduler()
    sched.add_request("a", [1, 2, 3, 4], 6)
    plan = sched.schedule()
    assert plan is not None
    sched.postprocess(plan, runner.run(plan))
    req = sched.get("a")
    failing = req.slots[2]
    plan = sched.schedule()
    assert plan is not None
    out = dataclasses.replace(runner.run(plan), incidents=(_incident(0, 2, (failing,)),))
    sched.postprocess(plan, out)
    # the output token at position 4 was sampled from KV that includes position 2: dropped too
    assert req.num_computed == 2 and req.output == []
    plan = sched.schedule()
    assert plan is not None and plan.chunks[0].prefix_len == 2
    assert failing not in plan.chunks[0].out_slots


def test_retry_budget_ends_in_a_per_request_error() -> None:
    sched, runner, _ = make_scheduler(recovery_retries=2)
    _load(sched)
    got = _run(sched, runner, always="b")
    b = sched.get("b")
    assert b.status is RequestStatus.FAILED and b.finish_reason == "kv_corruption"
    assert b.error is not None and "persisted after 2 recomputes (retry budget 2)" in b.error
    assert set(got) == {"a", "c"}  # everyone else kept running
    assert got["a"] == expected_output("a", 6, 10, 97)
    assert sched.stats().requests_failed == 1 and b.recoveries == 2


def test_zero_retries_fails_at_the_first_incident() -> None:
    sched, runner, _ = make_scheduler(recovery_retries=0)
    _load(sched)
    _run(sched, runner, hit={3: ("c", 0)})
    assert sched.get("c").status is RequestStatus.FAILED and sched.get("c").recoveries == 0


def test_failing_slots_and_descendants_leave_the_radix_cache() -> None:
    sched, runner, _ = make_scheduler()
    sched.add_request("a", [1, 2, 3, 4, 5, 6, 7, 8], 1)
    _run(sched, runner)
    cached = [s for s, _, _ in sched.prefix_cache.walk()]
    assert len(cached) == 8
    sched.add_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], 3)  # locks the whole cached prefix
    plan = sched.schedule()
    assert plan is not None and sched.get("b").num_computed == 8
    sched.postprocess(plan, runner.run(plan))
    sweep = Incident(stage="sweep", tag=4, step=0, violations=1, fail_reason_bits=4,
                     slots=(cached[5],))  # fmt: skip
    failed = sched.on_incidents([sweep])
    assert failed == []
    remaining = [s for s, _, _ in sched.prefix_cache.walk()]
    assert cached[5] not in remaining and all(s not in remaining for s in cached[5:])
    b = sched.get("b")
    assert b.num_computed == 5  # the holder recomputes from the first failing position
    check_scheduler(sched)
    got = _run(sched, runner)
    assert got["b"] == expected_output("b", 9, 3, 97)
    assert sched.stats().incident_evicted_slots >= 3


def test_damage_merges_to_the_earliest_position() -> None:
    a = _incident(0, 7, (3,))
    b = _incident(0, 4, (5,), bits=TOKEN)
    c = _incident(9, 1, (6,))  # outside the plan: ignored
    damage = damage_by_chunk([a, b, c], 2)
    assert list(damage) == [0]
    assert damage[0].first_position == 4 and damage[0].bad_input_token
    assert damage[0].reasons_bits == CHAIN | TOKEN


@given(
    prompt=st.integers(1, 20), extra=st.integers(0, 20), pos=st.integers(0, 45),
    computed_gap=st.integers(1, 5), bad=st.booleans(),
)  # fmt: skip
def test_recovery_point_keeps_only_trusted_state(
    prompt: int, extra: int, pos: int, computed_gap: int, bad: bool
) -> None:
    seq = prompt + extra
    computed = max(0, seq - computed_gap)
    pos = min(pos, seq)
    point = recovery_point(prompt_len=prompt, seq_len=seq, num_computed=computed, position=pos,
                           bad_input_token=bad)  # fmt: skip
    assert prompt <= point.keep_tokens <= seq or point.keep_tokens == seq
    assert 0 <= point.keep_computed < point.keep_tokens  # something is left to compute
    assert point.keep_computed <= min(pos, computed)
    if bad and pos >= prompt:
        assert point.keep_tokens <= pos  # the wrong token at pos is sampled again
    else:
        assert point.keep_tokens <= max(prompt, pos + 1)


def test_engine_config_rejects_negative_retries() -> None:
    with pytest.raises(
        ValueError, match=re.escape("EngineConfig.recovery_retries must be >= 0, got -1")
    ):
        make_scheduler(recovery_retries=-1)


def test_plan_output_default_has_no_incidents() -> None:
    assert StepOutput(()).incidents == () and StepPlan  # the field is optional for runners


def test_write_final_token_writes_the_last_token_before_finishing() -> None:
    sched, runner, _ = make_scheduler(write_final_token=True)
    sched.add_request("a", [1, 2, 3], 4)
    got = _run(sched, runner)
    assert got["a"] == expected_output("a", 3, 4, 97)
    last = runner.plans[-1].chunks[0]
    assert last.prefix_len == 3 + 4 - 1 and last.input_ids == (got["a"][-1],)
    plain, plain_runner, _ = make_scheduler()
    plain.add_request("a", [1, 2, 3], 4)
    assert _run(plain, plain_runner) == got and len(plain_runner.plans) == len(runner.plans) - 1


def test_an_incident_on_the_final_write_resamples_the_last_token() -> None:
    sched, runner, _ = make_scheduler(write_final_token=True)
    sched.add_request("a", [1, 2, 3], 2)
    # plan 0 prefills and samples position 3, plan 1 decodes it and samples 4, plan 2 writes 4
    got = _run_with_bad_token(sched, runner, plan_index=2, position=4)
    assert got["a"] == expected_output("a", 3, 2, 97)
    assert sched.stats().recoveries == 1 and sched.stats().requests_failed == 0


def _run_with_bad_token(sched: Scheduler, runner: OracleRunner, *, plan_index: int,
                        position: int) -> dict[str, list[int]]:  # fmt: skip
    outputs: dict[str, list[int]] = {}
    for n in range(100):
        if not sched.has_work():
            return outputs
        plan = sched.schedule()
        assert plan is not None
        out = runner.run(plan)
        if n == plan_index:
            slot = plan.chunks[0].out_slots[0]
            out = dataclasses.replace(out, incidents=(_incident(0, position, (slot,), TOKEN),))
        for req in sched.postprocess(plan, out):
            outputs[req.request_id] = list(req.output)
        check_scheduler(sched)
    raise AssertionError("did not go idle")


def test_recovery_never_frees_a_slot_another_request_owns() -> None:
    """A bookkeeping bug left `a` listing `b`'s slot without a reference of its own (what
    `radix_evict_locked` does): recovering `a` must not give that reference back."""
    sched, runner, table = make_scheduler()
    sched.add_request("a", [1, 2, 3, 4], 5)
    sched.add_request("b", [5, 6, 7, 8], 5)
    plan = sched.schedule()
    assert plan is not None
    sched.postprocess(plan, runner.run(plan))
    a, b = sched.get("a"), sched.get("b")
    stolen = b.slots[1]
    a.slots[2] = stolen  # the bug: a lists b's slot (its own reference to slot 2 is lost)
    table.write(a.row, 2, [stolen])
    assert sched.kv.allocator.refcount(stolen) == 1  # b's reference only
    runner._check_history = lambda chunk: None  # type: ignore[method-assign]  # the fake would object
    plan = sched.schedule()
    assert plan is not None
    index = [c.request_id for c in plan.chunks].index("a")
    out = dataclasses.replace(runner.run(plan), incidents=(_incident(index, 2, (stolen,)),))
    sched.postprocess(plan, out)
    assert a.num_computed == 2 and stolen not in a.slots
    assert sched.kv.allocator.refcount(stolen) == 1  # still b's
    assert stolen in b.slots


def test_restart_moves_back_to_a_table_entry_the_canary_cannot_check() -> None:
    """A shifted window left position 1 mapped to slot 0 (never verified); the incident names
    position 3, but the request must restart at 1, with its row repaired."""
    sched, runner, table = make_scheduler()
    sched.add_request("a", [1, 2, 3, 4, 5], 3)
    plan = sched.schedule()
    assert plan is not None
    sched.postprocess(plan, runner.run(plan))
    a = sched.get("a")
    table.write(a.row, 1, [0])  # the bug
    runner._check_history = lambda chunk: None  # type: ignore[method-assign]  # the fake would object
    plan = sched.schedule()
    assert plan is not None
    out = dataclasses.replace(runner.run(plan), incidents=(_incident(0, 3, (a.slots[3],)),))
    sched.postprocess(plan, out)
    assert a.num_computed == 1 and a.output == []
    assert table.read(a.row, 1) == a.slots[:1]
    check_scheduler(sched)
