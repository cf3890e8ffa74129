"""NumPy views of vLLM's persistent CPU buffers, made once per buffer instead of once per step.

The view builder reads three int64 prefixes a forward (input ids, positions, the layer's slot
mapping), each a slice of a buffer the model runner allocates once. A torch slice and `.numpy()`
cost about 2 µs each here; a cached NumPy view sliced in NumPy costs a tenth of that.
`RunnerArrays` keeps every per-batch array the view builder reads, found once per input batch:
after a model forward each attribute lookup through the runner's objects is a cache miss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

_MAX_BUFFERS = 8  # distinct buffers cached at once; more means the runner reallocates: start over
_DENSE_1D = (1,)  # the strides of a dense 1-D tensor


class HostViews:
    """`prefix(t, n)` equals `t[:n].numpy()` for a 1-D CPU tensor `t`.

    The NumPy view of a dense 1-D buffer is kept by its data pointer and dtype and reused while
    the tensor a step hands in starts at the same address and fits it. Holding the view holds
    the buffer's storage, so no other tensor can be given that address while it is cached.
    Anything else (a tensor on another device, 2-D, non-unit stride) takes the plain path.
    """

    def __init__(self) -> None:
        self._views: dict[tuple[int, torch.dtype], npt.NDArray[np.generic]] = {}

    def prefix(self, t: torch.Tensor, n: int) -> npt.NDArray[np.generic]:
        """`t[:n]` as a NumPy array sharing `t`'s memory."""
        # `stride() == (1,)`: 1-D and dense in one call (each torch accessor costs 0.1-0.4 us
        # warm, several times that right after a forward; `stride(0)` parses its argument)
        if not t.is_cpu or t.stride() != _DENSE_1D:
            return t[:n].numpy()
        n = min(n, t.shape[0])  # what `t[:n]` holds, whatever the cached view's length
        key = (t.data_ptr(), t.dtype)
        view = self._views.get(key)
        if view is None or len(view) < n:
            if len(self._views) >= _MAX_BUFFERS:
                self._views.clear()
            view = self._views[key] = t.numpy()
        return view[:n]


@dataclass(frozen=True, slots=True)
class RunnerArrays:
    """The arrays of a vLLM model runner and its input batch that the worker reads every step,
    looked up once (`of`). Each is a NumPy view of a buffer allocated once with its owner (the
    runner, the input batch, block table 0), so the arrays stay right while `batch` is the
    runner's input batch; `of` is called again when it is not."""

    batch: Any  # the InputBatch these came from
    block_table: Any  # its block table 0 (`slot_mapping.cpu` is the fallback slot mapping)
    query_start_loc: npt.NDArray[np.int32]
    table: npt.NDArray[np.int32]  # block ids, [max_num_reqs, max_blocks]
    num_computed: npt.NDArray[np.int32]
    num_prompt: npt.NDArray[np.int32]
    input_ids: npt.NDArray[np.int32]  # the whole buffer (the step's prefix is cut later)
    positions: npt.NDArray[np.int64]
    token_ids: npt.NDArray[np.int32]  # [max_num_reqs, max_model_len]
    num_tokens: npt.NDArray[np.int32]  # each row's tokens, speculative ones excluded

    @classmethod
    def of(cls, runner: Any) -> RunnerArrays:
        """Look the arrays up through `runner` (vLLM 0.32's GPUModelRunner on CPU)."""
        ib = runner.input_batch
        bt = ib.block_table[0]
        return cls(
            batch=ib, block_table=bt, query_start_loc=runner.query_start_loc.np,
            table=bt.block_table.np, num_computed=ib.num_computed_tokens_cpu,
            num_prompt=ib.num_prompt_tokens, input_ids=runner.input_ids.cpu.numpy(),
            positions=runner.positions.numpy(), token_ids=ib.token_ids_cpu,
            num_tokens=ib.num_tokens_no_spec,
        )  # fmt: skip
