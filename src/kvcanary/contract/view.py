"""ForwardView: what the engine tells the canary about one model forward (SPEC §2.2)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

__all__ = ["ExpectedInputs", "ForwardView", "TruthTable"]


class TruthTable(Sequence[Sequence[int]]):
    """`ForwardView.truth_tokens` as one 2-D table read in place: active row `r`'s truth is
    `tokens[r, : lens[r]]` (an engine's persistent token table, e.g. vLLM's `token_ids_cpu`, and
    its lengths; int32/int64 arrays or CPU tensors). The canary copies the part it reads when
    the view is snapshotted, with no Python step per row; indexing gives one row."""

    __slots__ = ("lens", "tokens")

    def __init__(self, tokens: Any, lens: Any) -> None:
        self.tokens = tokens
        self.lens = lens

    def __len__(self) -> int:
        return len(self.lens)

    @overload
    def __getitem__(self, i: int) -> Sequence[int]: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Sequence[int]]: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.tokens[i, : int(self.lens[i])]


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpectedInputs:
    """Token-oracle expectations for each flat token entry: what should be written and where."""

    tokens: torch.Tensor
    positions: torch.Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardView:
    """One model forward, described with the engine's own (live) metadata.

    Integer tensors are CPU int32 or int64 (NumPy arrays are accepted too). B is the number of
    batch rows, padding included; T the number of flat token entries.

    Attributes:
        rows: int[B], `req_to_token` row of each batch row; 0 marks padding and must be trailing.
        prefix_lens: int[B], tokens of each request already in the KV cache (end of the verify
            range).
        extend_lens: int[B], tokens written by this forward; negative counts as 0.
        input_ids, positions, out_slots: int[T], flat in request order. `out_slots` are full-pool
            slots, -1 means "no write"; entries past the sum of write lengths are ignored.
        req_to_token: int[R, C], the live table attention reads through; row 0 is reserved.
        truth_tokens: prompt + outputs of each *active* row (in row order), snapshotted when the
            view was built; feeds the verify-token check.
        expected_inputs: token-oracle expectations; feeds the write-input assert.
        skip_write_input_assert: True for draft-decode forwards and target-verify forwards whose
            drafter is not oracle-driven.
        linear_chain: False for tree speculation (no chain-position assert for this forward).
        mutable: True when the tensors are the engine's own, so fault injection may edit them.

    Guarantees from the engine: the tensors are not modified between `pre_forward` and
    `post_forward` except by the model writing KV; `req_to_token` is the table attention uses.
    """

    rows: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    req_to_token: torch.Tensor
    truth_tokens: Sequence[Sequence[int]] | None = None
    expected_inputs: ExpectedInputs | None = None
    skip_write_input_assert: bool = False
    linear_chain: bool = True
    mutable: bool = True
