"""Stateful property test of the engine with the canary installed: random admissions (often
sharing a prefix), steps, aborts, preemptions and drains over a small pool, with the oracle model
and the canary in log mode (real-data partial, sweep every 3 steps). After every rule the
allocator, the scheduler and the canary must agree, and the canary must have seen nothing."""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcanary.app.session import Stack, build_stack
from kvcanary.canary import RealDataMode
from kvcanary.engine.request import RequestStatus
from tests.integration.stacks import (
    VOCAB,
    assert_clean,
    assert_no_violations,
    canary_config,
    oracle_output,
    run_settings,
)

BASES = (
    tuple(range(3, 19)),
    (3, 4, 5, 6, 7, 8, 90, 91, 92, 93),
    (60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71),
)

engines = st.fixed_dictionaries(
    {
        "num_slots": st.sampled_from([48, 72, 120]),
        "max_running_requests": st.integers(1, 4),
        "max_batch_size": st.integers(1, 4),
        "chunked_prefill_size": st.sampled_from([None, 4, 7]),
        "max_prefill_tokens": st.sampled_from([8, 16, 40]),
        "speculative_num_draft_tokens": st.sampled_from([0, 2]),
        "seed": st.integers(0, 3),
    }
)


class EngineCanaryMachine(RuleBasedStateMachine):
    """One stack per example; rules drive its engine between steps."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: Stack | None = None
        self.ids: list[str] = []
        self.steps = 0

    @initialize(params=engines)
    def setup(self, params: dict[str, int | None]) -> None:
        cfg = run_settings(
            canary_config(real_data=RealDataMode.PARTIAL, sweep=3, oracle=True),
            model_kind="oracle",
            max_context_len=40,
            **params,  # type: ignore[arg-type]
        )
        self.stack = build_stack(cfg)

    def _stack(self) -> Stack:
        assert self.stack is not None
        return self.stack

    def _step(self) -> None:
        stack = self._stack()
        result = stack.engine.step()
        self.steps += 1
        for f in result.finished:
            req = stack.engine.request(f.request_id)
            assert list(f.output) == oracle_output(f.request_id, len(f.prompt), req.max_new_tokens)

    @rule(
        base=st.sampled_from(BASES),
        cut=st.integers(0, 16),
        tail=st.lists(st.integers(0, VOCAB - 1), max_size=10),
        max_new=st.integers(1, 12),
    )
    def admit(self, base: tuple[int, ...], cut: int, tail: list[int], max_new: int) -> None:
        engine = self._stack().engine
        limit = engine.config.max_request_tokens
        prompt = [*base[:cut], *tail][: limit - 1] or [1]
        max_new = min(max_new, limit - len(prompt))
        rid = f"r{len(self.ids)}"
        engine.add_request(rid, prompt, max_new, self._stack().sampling(rid))
        self.ids.append(rid)

    @rule(n=st.integers(1, 5))
    def step(self, n: int) -> None:
        for _ in range(n):
            self._step()

    @precondition(lambda self: bool(self.ids))
    @rule(pick=st.integers(0, 1000))
    def abort(self, pick: int) -> None:
        engine = self._stack().engine
        rid = self.ids[pick % len(self.ids)]
        req = engine.request(rid)
        live = req.status in (RequestStatus.WAITING, RequestStatus.RUNNING)
        assert engine.abort(rid) == live
        assert req.status in (RequestStatus.ABORTED, RequestStatus.FINISHED)
        assert req.row == 0 and not req.slots

    @precondition(lambda self: self.stack is not None and bool(self.stack.engine.scheduler.running))
    @rule(pick=st.integers(0, 1000))
    def preempt(self, pick: int) -> None:
        scheduler = self._stack().engine.scheduler
        req = scheduler.running[pick % len(scheduler.running)]
        assert scheduler.retract(req.request_id)
        assert scheduler.waiting[0] is req and req.row == 0 and not req.slots

    @rule()
    def drain(self) -> None:
        engine = self._stack().engine
        for _ in range(500):
            if not engine.has_work():
                break
            self._step()
        assert not engine.has_work(), "the engine made no progress"
        kv = engine.scheduler.kv
        assert kv.rows.num_used == 0
        assert kv.allocator.num_held == engine.scheduler.prefix_cache.cached_tokens

    @invariant()
    def consistent(self) -> None:
        if self.stack is None:
            return
        engine = self.stack.engine
        scheduler = engine.scheduler
        allocator = scheduler.kv.allocator
        assert allocator.num_free + allocator.num_held == allocator.num_slots - 1
        scheduler.check_integrity()
        table = self.stack.table.tensor
        for req in scheduler.running:
            assert all(allocator.refcount(s) >= 1 for s in req.slots), req.request_id
            assert table[req.row, : len(req.slots)].tolist() == req.slots
        assert_no_violations(self.stack)

    def teardown(self) -> None:
        if self.stack is not None:
            stats = self.stack.engine.stats()
            for name in ("retractions", "evictions", "radix_hit_tokens", "spec_accepted_tokens"):
                event(f"{name} > 0: {getattr(stats, name) > 0}")
        if self.stack is not None and self.steps:
            canary = self.stack.canary
            assert canary is not None and canary.sweep_passes >= self.steps // 3
            if self.stack.engine.stats().tokens_generated:
                assert_clean(self.stack)


EngineCanaryMachine.TestCase.settings = settings(
    max_examples=15, stateful_step_count=30, deadline=None, derandomize=True
)
TestEngineCanaryMachine = EngineCanaryMachine.TestCase
