"""ModelRunner: the only place a `StepPlan` becomes tensors, and sampled ids come back.

One `run` is one forward: build the `ForwardView` (SPEC §2.2) from the plan and the live
`req_to_token` tensor, call `pre_forward`, run the model on *the view's own arrays* (tensors
sharing their memory, so a fault injected by `pre_forward` is what the model really uses), call
`post_forward`, then sample. The flat arrays are NumPy: the canary copies each on every forward,
and a tensor's `.numpy()` costs it twice the copy (snapshot of a decode view 13 -> 6.4 us).
Sampled tokens leave the runner only after `post_forward`, so raise mode fails closed (§2.7).
"""

from __future__ import annotations

from typing import Protocol, final

import numpy as np
import numpy.typing as npt
import torch

from kvcanary.contract import (
    BufferGroupSpec,
    CanaryHooks,
    ExpectedInputs,
    ForwardView,
    NullHooks,
    TokenOracle,
)
from kvcanary.engine.kv_pool import KvPool
from kvcanary.engine.paged_attention import PagedKv
from kvcanary.engine.plan import ChunkOutput, ForwardKind, StepOutput, StepPlan
from kvcanary.engine.sampler import Sampler

__all__ = ["LiveTable", "Model", "ModelRunner"]


class LiveTable(Protocol):
    """What the runner needs of the `req_to_token` table: the live tensor attention reads."""

    @property
    def tensor(self) -> torch.Tensor:
        """The live `[rows, max_context_len]` table, not a copy."""
        ...


class Model(Protocol):
    """A model the runner can drive: `TinyLlama` or the weightless `OracleModel`."""

    @property
    def vocab_size(self) -> int:
        """Logits per token (and the oracle's vocabulary)."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: PagedKv,
        logit_index: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Store K/V through `kv` and return logits at `logit_index`, or None if weightless."""
        ...


def _int64(values: list[int]) -> npt.NDArray[np.int64]:
    return np.array(values, dtype=np.int64)


@final
class ModelRunner:
    """Runs `StepPlan`s: view -> `pre_forward` -> model -> `post_forward` -> sample.

    `oracle`, when given, fills `ForwardView.expected_inputs` (SPEC §10) and serves oracle
    sampling; without it, oracle sampling uses `TokenOracle(model.vocab_size)` and no expected
    inputs are published. `provide_truth` publishes each chunk's `truth_tokens`.
    """

    __slots__ = ("_hooks", "_model", "_oracle", "_pool", "_provide_truth", "_sampler", "_table")

    def __init__(
        self,
        model: Model,
        pool: KvPool,
        table: LiveTable,
        hooks: CanaryHooks | None = None,
        *,
        oracle: TokenOracle | None = None,
        provide_truth: bool = True,
    ) -> None:
        """Wire the runner; `hooks` defaults to `NullHooks()`."""
        self._model = model
        self._pool = pool
        self._table = table
        self._hooks: CanaryHooks = NullHooks() if hooks is None else hooks
        self._oracle = oracle
        self._provide_truth = provide_truth
        self._sampler = Sampler(oracle if oracle is not None else TokenOracle(model.vocab_size))

    @property
    def model(self) -> Model:
        """The model this runner drives (read-only; e.g. for a no-cache reference run)."""
        return self._model

    def group_spec(self, real_data_mode: str) -> BufferGroupSpec:
        """The pool's FULL buffer group for `real_data_mode` (`none`, `partial` or `all`)."""
        return self._pool.buffer_group(real_data_mode)

    def run(self, plan: StepPlan) -> StepOutput:
        """Run one forward for `plan` and return each chunk's sampled tokens.

        An empty plan runs nothing and calls no hooks.
        """
        if not plan.chunks:
            return StepOutput(chunks=())
        view = self.build_view(plan)
        self._hooks.pre_forward(view=view)
        logits = self._forward(view, _logit_index(plan))
        self._hooks.post_forward(view=view)
        incidents = tuple(self._hooks.take_incidents())  # HEAD and TAIL of this forward
        out = self._sample(plan, logits)
        return StepOutput(chunks=out.chunks, incidents=incidents) if incidents else out

    def build_view(self, plan: StepPlan) -> ForwardView:
        """The `ForwardView` of `plan`: fresh int64 NumPy arrays plus the live `req_to_token`."""
        input_ids: list[int] = []
        positions: list[int] = []
        out_slots: list[int] = []
        for chunk in plan.chunks:
            n = len(chunk.input_ids)
            if len(chunk.out_slots) != n or not 0 <= chunk.num_samples <= n:
                raise ValueError(
                    f"chunk of {chunk.request_id!r} has {n} inputs, {len(chunk.out_slots)} "
                    f"out_slots and {chunk.num_samples} samples"
                )
            input_ids.extend(chunk.input_ids)
            positions.extend(range(chunk.prefix_len, chunk.prefix_len + n))
            out_slots.extend(chunk.out_slots)
        return ForwardView(
            rows=_int64([c.row for c in plan.chunks]),
            prefix_lens=_int64([c.prefix_len for c in plan.chunks]),
            extend_lens=_int64([len(c.input_ids) for c in plan.chunks]),
            input_ids=_int64(input_ids),
            positions=_int64(positions),
            out_slots=_int64(out_slots),
            req_to_token=self._table.tensor,
            truth_tokens=tuple(c.truth_tokens for c in plan.chunks)
            if self._provide_truth
            else None,
            expected_inputs=self._expected_inputs(plan, input_ids, positions),
            skip_write_input_assert=plan.kind is ForwardKind.VERIFY
            and any(not c.sampling.oracle for c in plan.chunks),
        )

    def _expected_inputs(
        self, plan: StepPlan, input_ids: list[int], positions: list[int]
    ) -> ExpectedInputs | None:
        """SPEC §10 expectations: the prompt as given, the oracle's tokens after it.

        Chunks that do not sample from the oracle expect their own inputs (nothing to check).
        """
        if self._oracle is None:
            return None
        tokens: list[int] = []
        i = 0
        for chunk in plan.chunks:
            key = chunk.sampling.oracle_key
            for _ in chunk.input_ids:
                t = positions[i]  # kv_token_id_vs_position_offset is 0 for this engine's pool
                oracle_driven = chunk.sampling.oracle and t >= chunk.prompt_len
                tokens.append(self._oracle.token(key, t) if oracle_driven else input_ids[i])
                i += 1
        return ExpectedInputs(tokens=_int64(tokens), positions=_int64(positions))

    def _forward(self, view: ForwardView, logit_index: torch.Tensor) -> torch.Tensor | None:
        """Run the model on the view's arrays, as possibly edited by `pre_forward` (tensors over
        the same memory: `torch.as_tensor` of an int64 array copies nothing)."""
        kv = PagedKv(
            pool=self._pool,
            req_to_token=view.req_to_token,
            out_slots=torch.as_tensor(view.out_slots),
            rows=view.rows.tolist(),
            prefix_lens=view.prefix_lens.tolist(),
            extend_lens=view.extend_lens.tolist(),
        )
        input_ids, positions = torch.as_tensor(view.input_ids), torch.as_tensor(view.positions)
        return self._model.forward(input_ids, positions, kv, logit_index)

    def _sample(self, plan: StepPlan, logits: torch.Tensor | None) -> StepOutput:
        """Sample each chunk from its rows of `logits` (in `_logit_index` order)."""
        outputs: list[ChunkOutput] = []
        cursor = 0
        for chunk in plan.chunks:
            k = chunk.num_samples
            last = chunk.prefix_len + len(chunk.input_ids)
            chunk_logits = None if logits is None else logits[cursor : cursor + k].float()
            sampled = self._sampler.sample(chunk_logits, chunk.sampling, range(last - k, last))
            outputs.append(ChunkOutput(request_id=chunk.request_id, sampled=sampled))
            cursor += k
        if plan.kind is not ForwardKind.VERIFY:
            outputs = self._sampler_exit(outputs)
        return StepOutput(chunks=tuple(outputs))

    def _sampler_exit(self, outputs: list[ChunkOutput]) -> list[ChunkOutput]:
        """Offer the one-token rows to `hooks.maybe_swap_next_tokens` (fault injection)."""
        rows = [i for i, out in enumerate(outputs) if len(out.sampled) == 1]
        tokens = [outputs[i].sampled[0] for i in rows]
        swapped = self._hooks.maybe_swap_next_tokens(tokens=tokens)
        for i, token in zip(rows, swapped, strict=True):
            outputs[i] = ChunkOutput(request_id=outputs[i].request_id, sampled=(token,))
        return outputs


def _logit_index(plan: StepPlan) -> torch.Tensor:
    """Flat indices of the tokens sampled after: the last `num_samples` inputs of each chunk."""
    index: list[int] = []
    end = 0
    for chunk in plan.chunks:
        end += len(chunk.input_ids)
        index.extend(range(end - chunk.num_samples, end))
    return torch.tensor(index, dtype=torch.int64)
