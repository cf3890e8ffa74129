"""Engine loop (schedule -> run -> postprocess -> end_step) and EngineConfig validation."""

from __future__ import annotations

import pytest
from engine_fakes import OracleRunner, check_scheduler, expected_output

from kvcanary.contract import PrefixCacheWalker, Violation
from kvcanary.contract.incident import Incident
from kvcanary.engine.config import EngineConfig
from kvcanary.engine.engine import Engine
from kvcanary.engine.plan import ForwardKind, SamplingSpec, StepPlan
from kvcanary.engine.table import ListReqToTokenTable


class RecordingHooks:
    """CanaryHooks that only count calls."""

    def __init__(self) -> None:
        self.end_steps = 0
        self.walkers: list[PrefixCacheWalker] = []

    def mark_init_finished(self) -> None:
        pass

    def attach_prefix_cache(self, *, walker: PrefixCacheWalker) -> None:
        self.walkers.append(walker)

    def pre_forward(self, *, view: object) -> None:
        pass

    def post_forward(self, *, view: object) -> None:
        pass

    def maybe_swap_next_tokens(self, *, tokens: list[int]) -> list[int]:
        return tokens

    def end_step(self) -> None:
        self.end_steps += 1

    def drain_violations(self) -> list[Violation]:
        return []

    def take_incidents(self) -> list[Incident]:
        return []


def make_engine(**overrides: object) -> tuple[Engine, OracleRunner, RecordingHooks]:
    params: dict[str, object] = {"num_slots": 64, "max_context_len": 32, "vocab_size": 101}
    params.update(overrides)
    cfg = EngineConfig(**params)  # type: ignore[arg-type]
    table = ListReqToTokenTable(cfg.max_running_requests + 1, cfg.max_context_len)
    runner = OracleRunner(cfg.vocab_size, table)
    hooks = RecordingHooks()
    return Engine(cfg, runner, hooks, table=table), runner, hooks


def test_end_step_once_per_step_even_when_idle() -> None:
    engine, _, hooks = make_engine()
    assert engine.step().plan is None and hooks.end_steps == 1
    engine.add_request("a", [1, 2, 3], 4)
    steps = 0
    finished = []
    while engine.has_work():
        finished.extend(engine.step().finished)
        steps += 1
        assert hooks.end_steps == steps + 1
    assert [f.request_id for f in finished] == ["a"]
    assert list(finished[0].output) == expected_output("a", 3, 4, 101)
    assert engine.stats().tokens_generated == 4 and engine.stats().requests_finished == 1


def test_prefix_cache_is_attached_as_walker() -> None:
    engine, _, hooks = make_engine()
    assert hooks.walkers == [engine.scheduler.prefix_cache]
    engine2, _, hooks2 = make_engine(enable_prefix_cache=False)
    assert hooks2.walkers == [] and engine2.step().plan is None


def test_runner_failure_propagates_and_applies_nothing() -> None:
    engine, runner, hooks = make_engine(speculative_num_draft_tokens=2)
    engine.add_request("a", [4, 5, 6], 6, SamplingSpec(oracle=True, oracle_key=3))
    engine.step()
    req = engine.request("a")
    out, computed, held = list(req.output), req.num_computed, engine.scheduler.kv.allocator.num_held
    runner.fail_next = True
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert hooks.end_steps == 1  # the failed step did not end
    assert runner.plans[-1].kind is ForwardKind.VERIFY
    assert req.output == out and req.num_computed == computed
    assert engine.scheduler.kv.allocator.num_held == held
    check_scheduler(engine.scheduler)
    engine.run_until_idle()
    assert len(req.output) == 6


def test_default_hooks_and_table() -> None:
    cfg = EngineConfig(num_slots=32, max_context_len=16, vocab_size=7)

    class Echo:
        def run(self, plan: StepPlan) -> object:
            from kvcanary.engine.plan import ChunkOutput, StepOutput

            return StepOutput(
                tuple(ChunkOutput(c.request_id, (1,) * c.num_samples) for c in plan.chunks)
            )

    engine = Engine(cfg, Echo())  # type: ignore[arg-type]
    engine.add_request("a", [2, 3], 3)
    done = engine.run_until_idle()
    assert [f.output for f in done] == [(1, 1, 1)]
    assert engine.abort("a") is False
    with pytest.raises(KeyError):
        engine.request("zzz")


def test_abort_through_engine_and_busy_limit() -> None:
    engine, _, _ = make_engine()
    engine.add_request("a", [1, 2, 3], 20)
    engine.step()
    assert engine.abort("a") and not engine.has_work()
    assert engine.stats().requests_aborted == 1
    engine.add_request("b", [1, 2, 3], 20)
    with pytest.raises(RuntimeError, match="max_steps"):
        engine.run_until_idle(max_steps=2)


@pytest.mark.parametrize(
    ("overrides", "knob"),
    [
        ({"num_slots": 1}, "num_slots"),
        ({"max_context_len": 0}, "max_context_len"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"max_running_requests": 0}, "max_running_requests"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
        ({"speculative_num_draft_tokens": -1}, "speculative_num_draft_tokens"),
        ({"speculative_num_draft_tokens": 4, "max_prefill_tokens": 4}, "max_prefill_tokens"),
    ],
)
def test_config_validation_names_the_knob(overrides: dict[str, object], knob: str) -> None:
    params: dict[str, object] = {"num_slots": 8, "max_context_len": 8, "vocab_size": 5} | overrides
    with pytest.raises(ValueError, match=f"EngineConfig.{knob} must be") as info:
        EngineConfig(**params)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_config_derived_values() -> None:
    cfg = EngineConfig(num_slots=10, max_context_len=32, vocab_size=5, chunked_prefill_size=-1)
    assert cfg.chunk_limit is None and cfg.max_request_tokens == 10
    cfg = EngineConfig(num_slots=100, max_context_len=32, vocab_size=5, chunked_prefill_size=8)
    assert cfg.chunk_limit == 8 and cfg.max_request_tokens == 33


def test_runs_on_the_torch_req_to_token_table() -> None:
    """The scheduler's Protocol writes land in the runner side's tensor table unchanged."""
    from kvcanary.engine.req_to_token import TorchReqToTokenTable

    cfg = EngineConfig(num_slots=24, max_context_len=16, vocab_size=101, max_running_requests=2)
    table = TorchReqToTokenTable(max_rows=cfg.max_running_requests, max_context_len=16)
    runner = OracleRunner(cfg.vocab_size, table)
    engine = Engine(cfg, runner, table=table)
    for i in range(3):
        engine.add_request(f"t{i}", [i + 1, 2, 3, 4], 9)
    while engine.has_work():
        engine.step()
        engine.scheduler.check_integrity()
    assert engine.stats().retractions >= 1
    assert not table.tensor.any()
    for i in range(3):
        assert engine.request(f"t{i}").output == expected_output(f"t{i}", 4, 9, 101)
