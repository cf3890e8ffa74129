"""Speculative verify: drafting, acceptance, release of rejected drafts' slots."""

from __future__ import annotations

from engine_fakes import (
    OracleRunner,
    check_scheduler,
    expected_output,
    make_scheduler,
    run_all,
    step,
)

from kvcanary.contract import TokenOracle
from kvcanary.engine.drafter import Drafter, propose_ngram
from kvcanary.engine.plan import ChunkOutput, ForwardKind, SamplingSpec, StepOutput, StepPlan

ORACLE = SamplingSpec(oracle=True, oracle_key=1234)


def test_oracle_drafts_are_all_accepted() -> None:
    sched, runner, _ = make_scheduler(speculative_num_draft_tokens=3)
    sched.add_request("r", [5, 6, 7], 10, ORACLE)
    plans = list(run_all(sched, runner))
    verify = [p for p in plans if p.kind is ForwardKind.VERIFY]
    assert [len(p.chunks[0].input_ids) for p in verify] == [4, 4, 1]  # 1 (prefill) + 4 + 4 + 1 = 10
    for p in verify:
        (chunk,) = p.chunks
        assert chunk.num_samples == len(chunk.input_ids)
        assert chunk.prefix_len == len(chunk.truth_tokens) - 1
    stats = sched.stats()
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens == 6
    oracle = TokenOracle(97)
    assert sched.get("r").output == [oracle.token(1234, 3 + i) for i in range(10)]


def test_rejected_drafts_release_slots_and_never_become_history() -> None:
    sched, runner, _ = make_scheduler(speculative_num_draft_tokens=4)
    sched.add_request("r", [1, 2, 1, 2, 1, 2], 12)  # n-gram drafts, oracle target: rejections
    # run_all checks after every step that exactly the computed positions hold slots
    plans = list(run_all(sched, runner))
    assert any(p.kind is ForwardKind.VERIFY for p in plans)
    stats = sched.stats()
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens
    assert sched.get("r").output == expected_output("r", 6, 12, 97)
    assert sched.kv.allocator.num_held == sched.prefix_cache.cached_tokens


class PartialRunner(OracleRunner):
    """Accepts exactly the first draft of every verify chunk, then disagrees."""

    def run(self, plan: StepPlan) -> StepOutput:
        out = super().run(plan)
        if plan.kind is not ForwardKind.VERIFY:
            return out
        chunks = []
        for chunk, res in zip(plan.chunks, out.chunks, strict=True):
            drafts = chunk.input_ids[1:]
            wrong = (drafts[1] + 1) % 97
            chunks.append(ChunkOutput(res.request_id, (drafts[0], *[wrong] * len(drafts))))
        return StepOutput(tuple(chunks))


def test_partial_accept_keeps_one_draft_and_the_bonus() -> None:
    sched, _, table = make_scheduler(speculative_num_draft_tokens=3)
    runner = PartialRunner(97, table)
    sched.add_request("r", [3, 1, 4, 1, 5], 20)
    step(sched, runner)  # prefill
    req = sched.get("r")
    before = sched.kv.allocator.num_free
    plan = step(sched, runner)
    assert plan is not None and plan.kind is ForwardKind.VERIFY
    (chunk,) = plan.chunks
    drafts = chunk.input_ids[1:]
    assert req.output[1:] == [drafts[0], (drafts[1] + 1) % 97]
    assert req.num_computed == 7 == len(req.slots)  # last token + one accepted draft
    assert list(req.slots[5:]) == list(chunk.out_slots[:2])
    assert sched.kv.allocator.num_free == before - 2
    for slot in chunk.out_slots[2:]:
        assert sched.kv.allocator.refcount(slot) == 0
    assert table.read(req.row, 10)[7:] == [0, 0, 0]
    check_scheduler(sched)
    assert sched.stats().spec_accepted_tokens == 1 and sched.stats().spec_draft_tokens == 3


def test_no_verify_while_a_prefill_is_pending() -> None:
    sched, runner, _ = make_scheduler(speculative_num_draft_tokens=2, chunked_prefill_size=2)
    sched.add_request("a", [1, 2], 6, ORACLE)
    step(sched, runner)
    sched.add_request("b", [7, 8, 9, 10, 11], 2, ORACLE)
    plan = step(sched, runner)
    assert plan is not None and plan.kind is ForwardKind.EXTEND
    assert [(c.request_id, len(c.input_ids), c.num_samples) for c in plan.chunks] == [
        ("a", 1, 1),
        ("b", 2, 0),
    ]
    kinds = [p.kind for p in run_all(sched, runner)]
    assert ForwardKind.VERIFY in kinds
    assert sched.get("b").output == [TokenOracle(97).token(1234, 5 + i) for i in range(2)]


def test_drafts_capped_by_context_and_max_new_tokens() -> None:
    sched, runner, _ = make_scheduler(speculative_num_draft_tokens=5, max_context_len=9)
    sched.add_request("r", [1, 2, 3], 7, ORACLE)  # needs positions 0..8: exactly the context
    list(run_all(sched, runner))
    for plan in runner.plans:
        for chunk in plan.chunks:
            assert chunk.prefix_len + len(chunk.input_ids) <= 9
    assert len(sched.get("r").output) == 7


def test_ngram_drafter() -> None:
    assert propose_ngram([1, 2, 3, 1, 2], 3) == [3, 1, 2]
    assert propose_ngram([1, 2, 3, 9, 2], 2) == [3, 9]  # falls back to a 1-gram match
    assert propose_ngram([4, 5, 6], 2) == [6, 6]  # no match: repeat the last token
    assert propose_ngram([7, 7], 3) == [7, 7, 7]
    assert propose_ngram([], 2) == [] and propose_ngram([1], 0) == []
    drafter = Drafter(97)
    assert drafter.propose([1, 2], 3, ORACLE) == [TokenOracle(97).token(1234, p) for p in (2, 3, 4)]
    assert drafter.propose([1, 2, 1], 2, SamplingSpec()) == [2, 1]


def test_verify_step_never_mixes_in_an_admission() -> None:
    # the budget fits one verify (3 tokens) but not three: the leftover must not admit "w"
    sched, runner, _ = make_scheduler(
        speculative_num_draft_tokens=2,
        max_batch_size=3,
        max_running_requests=4,
        max_prefill_tokens=4,
    )
    for i in range(3):
        sched.add_request(f"d{i}", [i + 1, 2], 12, ORACLE)
    for _ in range(3):
        step(sched, runner)
    sched.add_request("w", [9, 9, 9], 2, ORACLE)
    plans = list(run_all(sched, runner))
    for plan in plans:
        if plan.kind is ForwardKind.VERIFY:
            assert all(c.num_samples == len(c.input_ids) for c in plan.chunks)
            assert all(c.request_id != "w" or c.prefix_len == 3 for c in plan.chunks)
    for i in range(3):
        assert len(sched.get(f"d{i}").output) == 12
    assert len(sched.get("w").output) == 2
