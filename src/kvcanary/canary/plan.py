"""Per-forward planning (SPEC §5.1): snapshot and validate a ForwardView, then build each
group's verify and write plan with the selected kernels."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvcanary.canary.capacities import CanaryLaunchCapacities
from kvcanary.contract.errors import CanaryContractError
from kvcanary.contract.view import ForwardView

__all__ = ["GroupPlan", "ViewSnapshot", "as_int_array", "build_group_plan", "snapshot_view"]

I64 = npt.NDArray[np.int64]
_NO_WINDOW = 1 << 62


def as_int_array(name: str, value: Any) -> npt.NDArray[np.integer[Any]]:
    """A NumPy view of an int32/int64 tensor or array (shares memory); TypeError otherwise."""
    dtype = value.dtype
    if isinstance(value, torch.Tensor):
        if dtype not in (torch.int32, torch.int64):
            raise TypeError(
                f"kv-canary: forward_view.{name} must have an int32 or int64 dtype, got {dtype}"
            )
        return value.detach().numpy()
    arr = np.asarray(value)
    if arr.dtype not in (np.int32, np.int64):
        raise TypeError(
            f"kv-canary: forward_view.{name} must have an int32 or int64 dtype, got {dtype}"
        )
    return arr


@dataclass(frozen=True, slots=True)
class ViewSnapshot:
    """What `pre_forward` freezes: copies of the flat arrays, the live table, derived inputs."""

    rows: I64
    prefix_lens: I64
    extend_lens: I64
    input_ids: I64
    positions: I64
    out_slots: I64
    req_to_token: npt.NDArray[np.integer[Any]]
    expected_tokens: I64
    expected_positions: I64
    write_assert: bool
    truth: I64
    truth_lens: I64
    linear_chain: bool


def _same_length(names: tuple[str, ...], arrays: tuple[npt.NDArray[Any], ...]) -> None:
    for name, arr in zip(names[1:], arrays[1:], strict=True):
        if len(arr) != len(arrays[0]):
            raise CanaryContractError(
                f"kv-canary: forward_view {names[0]} and {name} lengths differ: "
                f"{len(arrays[0])} vs {len(arr)}"
            )


def snapshot_view(
    view: ForwardView,
    *,
    capacities: CanaryLaunchCapacities,
    write_assert: bool,
    token_check: bool,
) -> ViewSnapshot:
    """Validate `view` against the contract and capacities, and snapshot it."""
    rows, prefix_lens, extend_lens = (
        as_int_array(n, getattr(view, n)).astype(np.int64)
        for n in ("rows", "prefix_lens", "extend_lens")
    )
    _same_length(("rows", "prefix_lens", "extend_lens"), (rows, prefix_lens, extend_lens))
    flat = tuple(
        as_int_array(n, getattr(view, n)).astype(np.int64)
        for n in ("input_ids", "positions", "out_slots")
    )
    _same_length(("input_ids", "positions", "out_slots"), flat)
    req_to_token = as_int_array("req_to_token", view.req_to_token)
    active = rows != 0
    if active.any() and not active[: int(np.flatnonzero(active)[-1]) + 1].all():
        first_pad = int(np.flatnonzero(~active)[0])
        raise CanaryContractError(
            f"kv-canary: forward_view padding row at index {first_pad} precedes an active row"
        )
    num_tokens = len(flat[0])
    needed = int(np.where(active, np.maximum(extend_lens, 0), 0).sum())
    if needed > num_tokens:
        raise CanaryContractError(
            f"kv-canary: forward_view active rows need {needed} tokens but only {num_tokens} "
            "were given"
        )
    if len(rows) > capacities.write_req_capacity:
        raise CanaryContractError(
            f"kv-canary: forward_view.batch_size={len(rows)} exceeds pre-allocated "
            f"write_req_capacity={capacities.write_req_capacity}; raise --cuda-graph-max-bs or "
            "check CanaryLaunchCapacities.from_args"
        )
    if num_tokens > capacities.write_entry_capacity:
        raise CanaryContractError(
            f"kv-canary: forward_view token count={num_tokens} exceeds pre-allocated "
            f"write_entry_capacity={capacities.write_entry_capacity}; raise "
            "--chunked-prefill-size / --max-prefill-tokens or check "
            "CanaryLaunchCapacities.from_args"
        )
    empty = np.zeros(0, dtype=np.int64)
    exp_tok, exp_pos = empty, empty
    write_assert = write_assert and not view.skip_write_input_assert
    if write_assert and view.expected_inputs is not None:
        for name in ("tokens", "positions"):
            value = getattr(view.expected_inputs, name)
            if tuple(value.shape) != (num_tokens,):
                raise ValueError(
                    f"kv-canary: expected_inputs.{name} shape {tuple(value.shape)} != num_tokens "
                    f"{num_tokens}; caller must slice before invoking"
                )
        exp_tok = as_int_array("expected_inputs.tokens", view.expected_inputs.tokens).astype(
            np.int64
        )
        exp_pos = as_int_array("expected_inputs.positions", view.expected_inputs.positions).astype(
            np.int64
        )
    else:
        write_assert = False
    truth, truth_lens = _truth_table(view, len(rows), req_to_token.shape[1], token_check)
    return ViewSnapshot(
        rows=rows,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        input_ids=flat[0],
        positions=flat[1],
        out_slots=flat[2],
        req_to_token=req_to_token,
        expected_tokens=exp_tok,
        expected_positions=exp_pos,
        write_assert=write_assert,
        truth=truth,
        truth_lens=truth_lens,
        linear_chain=view.linear_chain,
    )


def _truth_table(view: ForwardView, nrows: int, ncols: int, token_check: bool) -> tuple[I64, I64]:
    lens = np.zeros(nrows, dtype=np.int64)
    if not token_check or view.truth_tokens is None:
        return np.zeros((nrows, 0), dtype=np.int64), lens
    seqs = list(view.truth_tokens)[:nrows]
    width = min(max((len(s) for s in seqs), default=0), ncols)
    table = np.zeros((nrows, width), dtype=np.int64)
    for r, seq in enumerate(seqs):
        n = min(len(seq), width)
        table[r, :n] = np.asarray(seq[:n], dtype=np.int64)
        lens[r] = len(seq)
    return table, lens


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One group's plan: write chains per request and verify entries (empty on overflow)."""

    req_offsets: I64
    seeds: I64
    w_slots: I64
    v_slot: I64
    v_prev: I64
    v_pos: I64
    v_tok: I64
    verify_total: int
    overflow: bool

    @property
    def num_writes(self) -> int:
        """Write entries that store a record (slot >= 0)."""
        return int(np.count_nonzero(self.w_slots >= 0))


def build_group_plan(
    kernels: ModuleType,
    snap: ViewSnapshot,
    *,
    group_name: str,
    num_slots: int,
    lut: npt.NDArray[np.integer[Any]] | None,
    window: int | None,
    offset: int,
    verify_capacity: int,
) -> GroupPlan:
    """Run the kernel plan builder for one group and turn its error codes into exceptions."""
    use_lut = lut is not None
    lut_arr = lut if lut is not None else np.zeros(0, dtype=np.int64)
    out = kernels.build_plan(
        snap.rows, snap.prefix_lens, snap.extend_lens, snap.req_to_token, snap.out_slots,
        lut_arr, use_lut, _NO_WINDOW if window is None else window, num_slots,
        snap.truth, snap.truth_lens, offset, verify_capacity,
    )  # fmt: skip
    err_kind, err_value = int(out[9][0]), int(out[9][1])
    if err_kind == 1:
        raise ValueError(
            f"kv-canary: SWA slot {err_value} is outside full_to_swa_index_mapping length "
            f"{len(lut_arr)}"
        )
    if err_kind == 2:
        raise ValueError(
            f"kv-canary: slot {err_value} is outside the {group_name} group's {num_slots} slots"
        )
    if err_kind == 3:
        raise CanaryContractError(
            f"kv-canary: forward_view row at index {err_value} (req_to_token row "
            f"{int(snap.rows[err_value])}) reaches past req_to_token's shape "
            f"{tuple(snap.req_to_token.shape)}"
        )
    req_offsets, seeds, w_slots, v_slot, v_prev, v_pos, v_tok = out[:7]
    return GroupPlan(
        req_offsets, seeds, w_slots, v_slot, v_prev, v_pos, v_tok, int(out[7]), bool(out[8])
    )
