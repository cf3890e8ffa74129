"""Scheduler: chunked prefill, prefix sharing, retraction, abort, discard."""

from __future__ import annotations

import pytest
from engine_fakes import check_scheduler, expected_output, make_scheduler, run_all, step

from kvcanary.engine.plan import ForwardKind
from kvcanary.engine.request import RequestStatus


@pytest.mark.parametrize(("prompt_len", "chunk"), [(1, 4), (4, 4), (5, 4), (8, 4), (9, 4), (7, 1)])
def test_chunked_prefill_boundaries(prompt_len: int, chunk: int) -> None:
    sched, runner, _ = make_scheduler(chunked_prefill_size=chunk)
    sched.add_request("r", list(range(1, prompt_len + 1)), 3)
    plans = list(run_all(sched, runner))
    prefill = plans[: -(3 - 1)]
    spans = [(c.prefix_len, len(c.input_ids), c.num_samples) for p in prefill for c in p.chunks]
    starts = list(range(0, prompt_len, chunk))
    assert spans == [(s, min(chunk, prompt_len - s), int(s + chunk >= prompt_len)) for s in starts]
    assert all(p.kind is ForwardKind.EXTEND for p in prefill)
    assert all(p.kind is ForwardKind.DECODE for p in plans[len(prefill) :])
    assert sched.get("r").output == expected_output("r", prompt_len, 3, 97)


def test_token_budget_splits_across_requests() -> None:
    sched, runner, _ = make_scheduler(max_prefill_tokens=10, max_batch_size=4)
    for i in range(3):
        sched.add_request(f"r{i}", [i + 1] * 6, 2)
    plan = step(sched, runner)
    assert plan is not None
    assert [(c.request_id, len(c.input_ids), c.num_samples) for c in plan.chunks] == [
        ("r0", 6, 1),
        ("r1", 4, 0),
    ]
    plan = step(sched, runner)
    assert plan is not None and plan.num_tokens <= 10
    assert [(c.request_id, c.prefix_len, len(c.input_ids)) for c in plan.chunks] == [
        ("r0", 6, 1),
        ("r1", 4, 2),
        ("r2", 0, 6),
    ]
    list(run_all(sched, runner))
    for i in range(3):
        assert sched.get(f"r{i}").output == expected_output(f"r{i}", 6, 2, 97)


def test_batch_rows_and_running_limit() -> None:
    sched, runner, _ = make_scheduler(
        max_running_requests=2, max_batch_size=2, max_prefill_tokens=64
    )
    for i in range(4):
        sched.add_request(f"r{i}", [i + 1, 2, 3], 3)
    plan = step(sched, runner)
    assert plan is not None and [c.request_id for c in plan.chunks] == ["r0", "r1"]
    assert len(sched.running) == 2 and len(sched.waiting) == 2
    for plan in run_all(sched, runner):
        assert len(plan.chunks) <= 2 and len(sched.running) <= 2
    assert sched.stats().requests_finished == 4


def test_prefix_hit_and_leaves_one_token_to_compute() -> None:
    sched, runner, _ = make_scheduler()
    sched.add_request("a", [4, 5, 6, 7, 8], 2)
    list(run_all(sched, runner))
    # "b" repeats a's prompt + first output: everything but its last token is cached
    b_prompt = [4, 5, 6, 7, 8, sched.get("a").output[0]]
    sched.add_request("b", b_prompt, 2)
    plan = step(sched, runner)
    assert plan is not None
    (chunk,) = plan.chunks
    assert (chunk.prefix_len, chunk.input_ids, chunk.num_samples) == (5, (b_prompt[-1],), 1)
    assert sched.stats().radix_hit_tokens == 5
    list(run_all(sched, runner))
    # a request with the identical prompt must still compute its last prompt token
    sched.add_request("c", [4, 5, 6, 7, 8], 2)
    plan = step(sched, runner)
    assert plan is not None
    (chunk,) = plan.chunks
    assert (chunk.prefix_len, chunk.input_ids, chunk.num_samples) == (4, (8,), 1)
    assert plan.kind is ForwardKind.EXTEND
    list(run_all(sched, runner))
    assert sched.get("c").output == expected_output("c", 5, 2, 97)


def test_retraction_under_pressure_and_reprefill() -> None:
    # two requests that cannot both fit: the newer one is retracted, resumes later, same output
    sched, runner, _ = make_scheduler(num_slots=24, max_context_len=24)
    sched.add_request("old", list(range(1, 9)), 12)
    sched.add_request("new", list(range(11, 19)), 12)
    plans = list(run_all(sched, runner))
    stats = sched.stats()
    assert stats.retractions >= 1
    assert stats.requests_finished == 2
    for rid in ("old", "new"):
        req = sched.get(rid)
        assert req.status is RequestStatus.FINISHED
        assert req.output == expected_output(rid, 8, 12, 97)
    # the retracted request re-prefilled prompt + outputs so far, with its own prefix cached
    reprefill = [
        c for p in plans for c in p.chunks if c.request_id == "new" and len(c.input_ids) > 1
    ]
    assert len(reprefill) >= 2
    assert reprefill[-1].truth_tokens[:8] == tuple(range(11, 19))
    assert len(reprefill[-1].truth_tokens) > 8


def test_manual_retract_keeps_outputs_and_hits_own_prefix() -> None:
    sched, runner, _ = make_scheduler()
    sched.add_request("r", [9, 8, 7, 6], 6)
    for _ in range(3):
        step(sched, runner)
    req = sched.get("r")
    out_before = list(req.output)
    assert sched.retract("r") and not sched.retract("r")
    check_scheduler(sched)
    assert req.status is RequestStatus.WAITING and req.output == out_before
    assert sched.waiting[0] is req and req.row == 0
    plan = step(sched, runner)
    assert plan is not None
    (chunk,) = plan.chunks
    assert chunk.prefix_len == req.seq_len - 2  # everything computed before was a radix hit
    list(run_all(sched, runner))
    assert req.output == expected_output("r", 4, 6, 97)


def test_retraction_drops_newest_even_when_already_scheduled() -> None:
    # "old" is mid-prefill and needs slots; "young" already decoded this step and is newest
    sched, runner, _ = make_scheduler(
        num_slots=20,
        max_context_len=20,
        chunked_prefill_size=4,
        max_prefill_tokens=8,
        enable_prefix_cache=False,
    )
    sched.add_request("old", list(range(1, 16)), 2)
    sched.add_request("young", [50, 51], 4)
    list(run_all(sched, runner))
    assert sched.stats().retractions >= 1
    assert sched.get("old").output == expected_output("old", 15, 2, 97)
    assert sched.get("young").output == expected_output("young", 2, 4, 97)


@pytest.mark.parametrize("state", ["waiting", "mid_prefill", "decoding", "finished"])
def test_abort_in_each_state(state: str) -> None:
    sched, runner, table = make_scheduler(chunked_prefill_size=3)
    sched.add_request("keep", [1, 2, 3], 4)
    sched.add_request("x", list(range(10, 20)), 4)
    steps = {"waiting": 0, "mid_prefill": 1, "decoding": 5, "finished": 30}[state]
    for _ in range(steps):
        step(sched, runner)
        check_scheduler(sched)
    req = sched.get("x")
    row = req.row
    aborted = sched.abort("x")
    assert aborted == (state != "finished")
    assert not sched.abort("x") and not sched.abort("nope")
    check_scheduler(sched)
    if aborted:
        assert req.status is RequestStatus.ABORTED and not req.slots and req.handle is None
        assert sched.stats().requests_aborted == 1
        if row:
            assert not any(table.read(row, 10))
    list(run_all(sched, runner))
    assert sched.get("keep").output == expected_output("keep", 3, 4, 97)
    assert sched.kv.allocator.num_held == sched.prefix_cache.cached_tokens


def test_discard_releases_a_failed_plan() -> None:
    sched, runner, _ = make_scheduler()
    sched.add_request("r", [1, 2, 3, 4], 3)
    step(sched, runner)
    held = sched.kv.allocator.num_held
    plan = sched.schedule()
    assert plan is not None
    sched.discard(plan)
    check_scheduler(sched)
    assert sched.kv.allocator.num_held == held
    list(run_all(sched, runner))
    assert sched.get("r").output == expected_output("r", 4, 3, 97)


def test_postprocess_rejects_mismatched_output() -> None:
    sched, runner, _ = make_scheduler()
    sched.add_request("r", [1, 2], 2)
    plan = sched.schedule()
    assert plan is not None
    good = runner.run(plan)
    with pytest.raises(ValueError, match="chunks"):
        sched.postprocess(plan, type(good)(()))
    bad = type(good)((type(good.chunks[0])("r", ()),))
    with pytest.raises(ValueError, match="num_samples"):
        sched.postprocess(plan, bad)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt": []}, "empty prompt"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": list(range(40)), "max_new_tokens": 10}, "shorten"),
    ],
)
def test_add_request_validation(kwargs: dict[str, object], match: str) -> None:
    sched, _, _ = make_scheduler()
    args: dict[str, object] = {"request_id": "r", "prompt": [1], "max_new_tokens": 1} | kwargs
    with pytest.raises(ValueError, match=match):
        sched.add_request(**args)  # type: ignore[arg-type]


def test_duplicate_request_id_rejected() -> None:
    sched, _, _ = make_scheduler()
    sched.add_request("r", [1], 1)
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request("r", [1], 1)
