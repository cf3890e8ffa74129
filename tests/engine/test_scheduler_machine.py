"""Stateful property test of the scheduler: random admissions, steps, aborts, retractions and
memory pressure, with every cross-structure invariant checked after each rule and every finished
request's output checked against the token oracle."""

from __future__ import annotations

from engine_fakes import OracleRunner, check_scheduler, step
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcanary.contract import TokenOracle, request_key
from kvcanary.engine.config import EngineConfig
from kvcanary.engine.plan import SamplingSpec
from kvcanary.engine.request import RequestStatus
from kvcanary.engine.scheduler import Scheduler
from kvcanary.engine.table import ListReqToTokenTable

VOCAB = 11
BASES = ((1, 2, 3, 4, 5, 6), (1, 2, 3, 7), (8, 8, 8, 8, 8))

configs = st.builds(
    dict,
    num_slots=st.integers(10, 32),
    max_context_len=st.integers(10, 24),
    max_running_requests=st.integers(1, 4),
    max_batch_size=st.integers(1, 4),
    chunked_prefill_size=st.sampled_from([None, -1, 1, 3, 5]),
    max_prefill_tokens=st.integers(4, 24),
    speculative_num_draft_tokens=st.sampled_from([0, 1, 3]),
    enable_prefix_cache=st.booleans(),
    seed=st.integers(0, 2),
)


class SchedulerMachine(RuleBasedStateMachine):
    """Drives one scheduler with the oracle runner."""

    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler | None = None
        self.runner: OracleRunner | None = None
        self.ids: list[str] = []

    @initialize(params=configs)
    def setup(self, params: dict[str, object]) -> None:
        cfg = EngineConfig(vocab_size=VOCAB, **params)  # type: ignore[arg-type]
        table = ListReqToTokenTable(cfg.max_running_requests + 1, cfg.max_context_len)
        self.sched = Scheduler(cfg, table)
        self.runner = OracleRunner(VOCAB, table)

    def _engine(self) -> tuple[Scheduler, OracleRunner]:
        assert self.sched is not None and self.runner is not None
        return self.sched, self.runner

    @rule(
        base=st.sampled_from(BASES),
        cut=st.integers(1, 6),
        tail=st.lists(st.integers(0, VOCAB - 1), max_size=6),
        max_new=st.integers(1, 10),
        oracle=st.booleans(),
    )
    def add(
        self, base: tuple[int, ...], cut: int, tail: list[int], max_new: int, oracle: bool
    ) -> None:
        sched, _ = self._engine()
        prompt = [*base[:cut], *tail]
        cap = min(sched.config.max_request_tokens - 1, len(prompt))
        prompt = prompt[: max(cap, 1)]
        max_new = max(1, min(max_new, sched.config.max_request_tokens - len(prompt)))
        rid = f"r{len(self.ids)}"
        sampling = SamplingSpec(oracle=True, oracle_key=len(self.ids) * 7919) if oracle else None
        sched.add_request(rid, prompt, max_new, sampling)
        self.ids.append(rid)

    @rule(
        prompts=st.lists(
            st.tuples(st.sampled_from(BASES), st.integers(2, 6)), min_size=1, max_size=3
        )
    )
    def add_shared(self, prompts: list[tuple[tuple[int, ...], int]]) -> None:
        """Requests that share prefixes with earlier ones (radix hits, evictions)."""
        for base, cut in prompts:
            self.add(base, cut, [], 6, False)

    @rule(n=st.integers(1, 4))
    def run_steps(self, n: int) -> None:
        sched, runner = self._engine()
        for _ in range(n):
            step(sched, runner)
            check_scheduler(sched)

    @precondition(lambda self: bool(self.ids))
    @rule(pick=st.integers(0, 100))
    def abort(self, pick: int) -> None:
        sched, _ = self._engine()
        rid = self.ids[pick % len(self.ids)]
        status = sched.get(rid).status
        assert sched.abort(rid) == (status in (RequestStatus.WAITING, RequestStatus.RUNNING))
        assert sched.get(rid).status in (RequestStatus.ABORTED, RequestStatus.FINISHED)

    @precondition(lambda self: self.sched is not None and bool(self.sched.running))
    @rule(pick=st.integers(0, 100))
    def preempt(self, pick: int) -> None:
        sched, _ = self._engine()
        req = sched.running[pick % len(sched.running)]
        assert sched.retract(req.request_id)
        assert sched.waiting[0] is req

    @rule()
    def drain(self) -> None:
        """Resume everything: step until idle (progress is guaranteed)."""
        sched, runner = self._engine()
        for _ in range(400):
            if not sched.has_work():
                break
            step(sched, runner)
        assert not sched.has_work(), "scheduler made no progress"
        assert not sched.running and sched.kv.rows.num_used == 0
        assert sched.kv.allocator.num_held == sched.prefix_cache.cached_tokens
        assert sched.prefix_cache.protected_tokens == 0

    def teardown(self) -> None:
        if self.sched is not None:
            stats = self.sched.stats()
            for name in ("retractions", "evictions", "radix_hit_tokens", "spec_draft_tokens"):
                event(f"{name} > 0: {getattr(stats, name) > 0}")
            event(f"spec rejections: {stats.spec_draft_tokens > stats.spec_accepted_tokens}")

    @invariant()
    def consistent(self) -> None:
        if self.sched is None:
            return
        check_scheduler(self.sched)
        oracle = TokenOracle(VOCAB)
        for rid in self.ids:
            req = self.sched.get(rid)
            key = req.sampling.oracle_key if req.sampling.oracle else request_key(rid)
            assert req.output == [
                oracle.token(key, len(req.prompt) + i) for i in range(len(req.output))
            ]
            if req.status is RequestStatus.FINISHED:
                assert len(req.output) == req.max_new_tokens


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None
)
TestSchedulerMachine = SchedulerMachine.TestCase
