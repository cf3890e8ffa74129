"""ModelRunner: the ForwardView it builds, the hook order, and that the model uses the view."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvcanary.contract import ForwardView, PrefixCacheWalker, TokenOracle, Violation
from kvcanary.contract.incident import Incident
from kvcanary.engine.kv_pool import KvPool
from kvcanary.engine.model import ModelConfig, TinyLlama
from kvcanary.engine.oracle_model import OracleModel, synthetic_kv
from kvcanary.engine.paged_attention import PagedKv
from kvcanary.engine.plan import ForwardKind, SamplingSpec, ScheduledChunk, StepPlan
from kvcanary.engine.req_to_token import TorchReqToTokenTable
from kvcanary.engine.runner import Model, ModelRunner

CONFIG = ModelConfig(
    vocab_size=128, hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=1
)
ORACLE = TokenOracle(CONFIG.vocab_size)
KEY_A, KEY_B = 1234, -77


class RecordingHooks:
    """CanaryHooks that log each call (and may edit the view in `pre_forward`)."""

    def __init__(
        self, log: list[tuple[str, Any]], on_pre: Callable[[ForwardView], None] | None = None
    ):
        self.log = log
        self.on_pre = on_pre

    def mark_init_finished(self) -> None:
        self.log.append(("mark_init_finished", None))

    def attach_prefix_cache(self, *, walker: PrefixCacheWalker) -> None:
        self.log.append(("attach_prefix_cache", walker))

    def pre_forward(self, *, view: ForwardView) -> None:
        self.log.append(("pre_forward", view))
        if self.on_pre is not None:
            self.on_pre(view)

    def post_forward(self, *, view: ForwardView) -> None:
        self.log.append(("post_forward", view))

    def maybe_swap_next_tokens(self, *, tokens: list[int]) -> list[int]:
        return tokens

    def end_step(self) -> None:
        self.log.append(("end_step", None))

    def drain_violations(self) -> list[Violation]:
        return []

    def take_incidents(self) -> list[Incident]:
        return []


class RecordingModel:
    """Wraps a model and logs what `forward` received."""

    def __init__(self, inner: Model, log: list[tuple[str, Any]]):
        self.inner = inner
        self.log = log

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: PagedKv,
        logit_index: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        self.log.append(("forward", (input_ids, positions, kv, logit_index)))
        return self.inner.forward(input_ids, positions, kv, logit_index)


def make_pool() -> KvPool:
    return KvPool(num_slots=64, num_layers=2, num_kv_heads=2, head_dim=16)


def chunk(
    rid: str,
    row: int,
    prefix: int,
    ids: tuple[int, ...],
    slots: tuple[int, ...],
    samples: int,
    sampling: SamplingSpec,
    prompt_len: int,
) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=rid,
        row=row,
        prefix_len=prefix,
        input_ids=ids,
        out_slots=slots,
        num_samples=samples,
        sampling=sampling,
        prompt_len=prompt_len,
        truth_tokens=tuple(range(100, 100 + prefix + len(ids))),
    )


MIXED = StepPlan(
    kind=ForwardKind.EXTEND,
    chunks=(
        chunk(
            "a", 2, 0, (5, 6, 7), (10, 11, 12), 0, SamplingSpec(oracle=True, oracle_key=KEY_A), 2
        ),
        chunk("b", 1, 4, (9,), (20,), 1, SamplingSpec(oracle=True, oracle_key=KEY_B), 3),
        chunk("c", 3, 2, (8,), (30,), 1, SamplingSpec(), 1),
    ),
)


def fill_table(table: TorchReqToTokenTable, plan: StepPlan) -> None:
    """Map every chunk's positions: earlier positions to arbitrary cached slots, new ones to
    out_slots (what the scheduler guarantees before the runner runs)."""
    for c in plan.chunks:
        table.write(c.row, 0, [40 + c.row * 4 + p for p in range(c.prefix_len)])
        table.write(c.row, c.prefix_len, c.out_slots)


def test_view_fields_for_a_mixed_extend() -> None:
    log: list[tuple[str, Any]] = []
    table = TorchReqToTokenTable(max_rows=3, max_context_len=16)
    fill_table(table, MIXED)
    runner = ModelRunner(TinyLlama(CONFIG), make_pool(), table, RecordingHooks(log), oracle=ORACLE)
    out = runner.run(MIXED)
    view = log[0][1]
    assert isinstance(view, ForwardView)
    for name in ("rows", "prefix_lens", "extend_lens", "input_ids", "positions", "out_slots"):
        arr = getattr(view, name)  # NumPy: the canary copies them without a tensor round trip
        assert isinstance(arr, np.ndarray) and arr.dtype == np.int64, name
    assert view.rows.tolist() == [2, 1, 3]
    assert view.prefix_lens.tolist() == [0, 4, 2]
    assert view.extend_lens.tolist() == [3, 1, 1]
    assert view.input_ids.tolist() == [5, 6, 7, 9, 8]
    assert view.positions.tolist() == [0, 1, 2, 4, 2]
    assert view.out_slots.tolist() == [10, 11, 12, 20, 30]
    assert view.req_to_token is table.tensor
    assert view.truth_tokens == tuple(c.truth_tokens for c in MIXED.chunks)
    assert view.expected_inputs is not None
    # a: positions 0, 1 are prompt, 2 is the oracle's; b: position 4 >= prompt_len 3 is the
    # oracle's; c samples greedily, so its own input is expected.
    assert view.expected_inputs.tokens.tolist() == [
        5,
        6,
        ORACLE.token(KEY_A, 2),
        ORACLE.token(KEY_B, 4),
        8,
    ]
    assert view.expected_inputs.positions.tolist() == [0, 1, 2, 4, 2]
    assert view.expected_inputs.positions is not view.positions
    assert view.skip_write_input_assert is False
    assert view.linear_chain is True and view.mutable is True
    # Sampled tokens: none for the non-final chunk, the oracle's for b, an argmax for c.
    assert [c.request_id for c in out.chunks] == ["a", "b", "c"]
    assert out.chunks[0].sampled == ()
    assert out.chunks[1].sampled == (ORACLE.next_token(KEY_B, 4),)
    assert len(out.chunks[2].sampled) == 1 and 0 <= out.chunks[2].sampled[0] < 128


def test_view_without_oracle_or_truth() -> None:
    log: list[tuple[str, Any]] = []
    table = TorchReqToTokenTable(max_rows=3, max_context_len=16)
    runner = ModelRunner(
        TinyLlama(CONFIG), make_pool(), table, RecordingHooks(log), provide_truth=False
    )
    out = runner.run(MIXED)
    view = log[0][1]
    assert view.expected_inputs is None and view.truth_tokens is None
    # Oracle sampling still works, from TokenOracle(model.vocab_size).
    assert out.chunks[1].sampled == (ORACLE.next_token(KEY_B, 4),)


@pytest.mark.parametrize(("drafter_is_oracle", "skip"), [(True, False), (False, True)])
def test_verify_forward(drafter_is_oracle: bool, skip: bool) -> None:
    log: list[tuple[str, Any]] = []
    spec = SamplingSpec(oracle=drafter_is_oracle, oracle_key=KEY_A)
    plan = StepPlan(
        kind=ForwardKind.VERIFY, chunks=(chunk("v", 1, 5, (3, 4, 5, 6), (1, 2, 3, 4), 4, spec, 2),)
    )
    table = TorchReqToTokenTable(max_rows=1, max_context_len=16)
    fill_table(table, plan)
    runner = ModelRunner(TinyLlama(CONFIG), make_pool(), table, RecordingHooks(log), oracle=ORACLE)
    out = runner.run(plan)
    view = log[0][1]
    assert view.skip_write_input_assert is skip
    sampled = out.chunks[0].sampled
    assert len(sampled) == 4
    if drafter_is_oracle:
        assert sampled == tuple(ORACLE.next_token(KEY_A, p) for p in range(5, 9))
        assert view.expected_inputs.tokens.tolist() == [ORACLE.token(KEY_A, p) for p in range(5, 9)]
    else:
        assert view.expected_inputs.tokens.tolist() == [3, 4, 5, 6]


def test_hooks_bracket_the_forward_and_see_kv_written_only_after() -> None:
    log: list[tuple[str, Any]] = []
    pool = make_pool()
    seen: list[bool] = []

    class KvProbe(RecordingHooks):
        def pre_forward(self, *, view: ForwardView) -> None:
            seen.append(bool(pool.k(0)[view.out_slots].any()))
            super().pre_forward(view=view)

        def post_forward(self, *, view: ForwardView) -> None:
            seen.append(bool(pool.k(0)[view.out_slots].flatten(1).any(dim=1).all()))
            super().post_forward(view=view)

    table = TorchReqToTokenTable(max_rows=3, max_context_len=16)
    fill_table(table, MIXED)
    model = RecordingModel(TinyLlama(CONFIG), log)
    ModelRunner(model, pool, table, KvProbe(log), oracle=ORACLE).run(MIXED)
    assert [name for name, _ in log] == ["pre_forward", "forward", "post_forward"]
    assert log[0][1] is log[2][1]
    assert seen == [False, True]
    # The model ran on the view's own arrays (tensors over their memory, not copies).
    view = log[0][1]
    input_ids, positions, kv, logit_index = log[1][1]
    assert np.shares_memory(input_ids.numpy(), view.input_ids)
    assert np.shares_memory(positions.numpy(), view.positions)
    assert np.shares_memory(kv.out_slots.numpy(), view.out_slots)
    assert kv.req_to_token is view.req_to_token
    assert kv.pool is pool
    assert list(kv.rows) == [2, 1, 3] and list(kv.prefix_lens) == [0, 4, 2]
    assert list(kv.extend_lens) == [3, 1, 1]
    assert logit_index.tolist() == [3, 4]


def test_model_uses_view_tensors_as_edited_by_pre_forward() -> None:
    pool = make_pool()
    table = TorchReqToTokenTable(max_rows=3, max_context_len=16)

    def inject(view: ForwardView) -> None:
        view.out_slots[0] = 50  # double-alloc-like redirect
        view.positions[1] += 1  # position off by one

    spec = SamplingSpec(oracle=True, oracle_key=KEY_A)
    plan = StepPlan(
        kind=ForwardKind.EXTEND, chunks=(chunk("a", 1, 0, (5, 6), (10, 11), 1, spec, 2),)
    )
    fill_table(table, plan)
    runner = ModelRunner(OracleModel(CONFIG), pool, table, RecordingHooks([], inject))
    out = runner.run(plan)
    k, _ = synthetic_kv(
        torch.tensor([5, 6]), torch.tensor([0, 2]), num_kv_heads=2, head_dim=16, dtype=torch.float32
    )
    assert not pool.k(0)[10].any()
    assert torch.equal(pool.k(0)[50], k[0]) and torch.equal(pool.k(1)[11], k[1])
    # The sampler follows the plan's positions, not the injected ones.
    assert out.chunks[0].sampled == (ORACLE.next_token(KEY_A, 1),)


def test_empty_plan_calls_no_hooks() -> None:
    log: list[tuple[str, Any]] = []
    table = TorchReqToTokenTable(max_rows=1, max_context_len=4)
    runner = ModelRunner(OracleModel(CONFIG), make_pool(), table, RecordingHooks(log))
    assert runner.run(StepPlan(kind=ForwardKind.DECODE, chunks=())).chunks == ()
    assert log == []


def test_a_raising_post_forward_publishes_nothing() -> None:
    class Raising(RecordingHooks):
        def post_forward(self, *, view: ForwardView) -> None:
            raise RuntimeError("kv-canary: violation")

    table = TorchReqToTokenTable(max_rows=3, max_context_len=16)
    runner = ModelRunner(TinyLlama(CONFIG), make_pool(), table, Raising([]), oracle=ORACLE)
    with pytest.raises(RuntimeError, match="violation"):
        runner.run(MIXED)


def test_default_hooks_and_group_spec_passthrough() -> None:
    pool = make_pool()
    table = TorchReqToTokenTable(max_rows=3, max_context_len=16)
    runner = ModelRunner(TinyLlama(CONFIG), pool, table)
    assert len(runner.run(MIXED).chunks) == 3
    group = runner.group_spec("all")
    assert group.k_sources[0].tensor.data_ptr() == pool.k(0).data_ptr()
    assert group.k_sources[0].read_bytes == pool.num_bytes_per_token
    assert runner.group_spec("none").k_sources == ()


def test_bad_plans_are_rejected() -> None:
    table = TorchReqToTokenTable(max_rows=3, max_context_len=16)
    spec = SamplingSpec()
    oracle_runner = ModelRunner(OracleModel(CONFIG), make_pool(), table)
    greedy = StepPlan(kind=ForwardKind.DECODE, chunks=(chunk("g", 1, 0, (1,), (2,), 1, spec, 1),))
    with pytest.raises(ValueError, match="needs logits"):
        oracle_runner.run(greedy)
    ragged = StepPlan(kind=ForwardKind.DECODE, chunks=(chunk("r", 1, 0, (1,), (2, 3), 1, spec, 1),))
    with pytest.raises(ValueError, match="out_slots"):
        oracle_runner.run(ragged)
    too_many = StepPlan(kind=ForwardKind.DECODE, chunks=(chunk("t", 1, 0, (1,), (2,), 2, spec, 1),))
    with pytest.raises(ValueError, match="samples"):
        oracle_runner.run(too_many)
