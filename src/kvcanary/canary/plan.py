"""Per-forward planning (SPEC §5.1): snapshot and validate a ForwardView, then build each
group's verify and write plan with the selected kernels."""

from __future__ import annotations

from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from kvcanary.canary.capacities import CanaryLaunchCapacities
from kvcanary.canary.view_checks import (
    as_int_array,
    check_rows_fit,
    needed_tokens,
    slot_error,
)
from kvcanary.contract.errors import CanaryContractError
from kvcanary.contract.view import ForwardView, TruthTable

__all__ = [
    "GroupPlan",
    "ViewSnapshot",
    "as_int_array",
    "build_group_plan",
    "int64_copy",
    "new_write_marks",
    "snapshot_view",
]

I64 = npt.NDArray[np.int64]
_NO_WINDOW = 1 << 62
_INT64 = np.dtype(np.int64)
_SMALL_BATCH = 32  # rows up to which the per-forward row checks run on Python lists


class ViewSnapshot(NamedTuple):
    """What `pre_forward` freezes: copies of the flat arrays, the live table, derived inputs.

    A NamedTuple, not a frozen dataclass: built on every forward, and a frozen dataclass sets
    each of its fields through `object.__setattr__` (1.6 vs 0.5 us here); immutable either way.
    """

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
    truth: npt.NDArray[np.integer[Any]]  # int32 or int64; read by the plan builder only
    truth_lens: I64
    linear_chain: bool


def _same_length(names: tuple[str, ...], arrays: tuple[npt.NDArray[Any], ...]) -> None:
    for name, arr in zip(names[1:], arrays[1:], strict=True):
        if len(arr) != len(arrays[0]):
            raise CanaryContractError(
                f"kv-canary: forward_view {names[0]} and {name} lengths differ: "
                f"{len(arrays[0])} vs {len(arr)}"
            )


def int64_copy(name: str, value: Any) -> I64:
    """A 1-D int64 copy of an int32/int64 tensor or array (`as_int_array`'s checks and errors);
    a CPU int64 tensor, the common case, takes the short path."""
    # `ndim` and `is_cpu` are plain attributes (no call, no device object), and `detach` is
    # needed only for a tensor that requires grad: a few hundred ns per array, six per forward.
    if type(value) is np.ndarray and value.dtype == _INT64 and value.ndim == 1:
        return value.copy()
    if (
        type(value) is torch.Tensor
        and value.dtype is torch.int64
        and value.ndim == 1
        and value.is_cpu
    ):
        out: I64 = (value.detach() if value.requires_grad else value).numpy().copy()
        return out
    return as_int_array(name, value, 1).astype(np.int64)


def _check_active_rows(rows: I64, extend_lens: I64, num_tokens: int) -> None:
    """Padding rows (0) only after the active rows, and the active rows' write lengths fit the
    `num_tokens` flat entries (SPEC §2.2)."""
    if len(rows) <= _SMALL_BATCH:
        _check_active_rows_small(rows.tolist(), extend_lens.tolist(), num_tokens)
        return
    active_idx = np.flatnonzero(rows)
    n_active = len(active_idx)
    if n_active and int(active_idx[-1]) != n_active - 1:
        first_pad = int(np.flatnonzero(rows == 0)[0])
        raise CanaryContractError(
            f"kv-canary: forward_view padding row at index {first_pad} precedes an active row"
        )
    # Active rows are the first n_active: a capped sum is exact whenever it fits num_tokens.
    capped = int(np.minimum(np.maximum(extend_lens[:n_active], 0), num_tokens + 1).sum())
    if capped <= num_tokens:
        return
    needed = needed_tokens(rows != 0, extend_lens, num_tokens)
    raise CanaryContractError(
        f"kv-canary: forward_view active rows need {needed} tokens but only {num_tokens} were given"
    )


def _check_active_rows_small(rows: list[int], extend_lens: list[int], num_tokens: int) -> None:
    """`_check_active_rows` for a few rows, on Python lists (no NumPy call: each costs about a
    microsecond, more than these checks on a small batch); the same checks and messages."""
    n_active = rows.index(0) if 0 in rows else len(rows)
    if any(rows[n_active:]):
        raise CanaryContractError(
            f"kv-canary: forward_view padding row at index {n_active} precedes an active row"
        )
    needed = sum(e for e in extend_lens[:n_active] if e > 0)  # Python ints: exact, no overflow
    if needed > num_tokens:
        raise CanaryContractError(
            f"kv-canary: forward_view active rows need {needed} tokens but only {num_tokens} "
            "were given"
        )


def snapshot_view(
    view: ForwardView,
    *,
    capacities: CanaryLaunchCapacities,
    write_assert: bool,
    token_check: bool,
) -> ViewSnapshot:
    """Validate `view` against the contract and capacities (SPEC §2.2, §6, §14.2), and snapshot
    it: the flat arrays are copied, `req_to_token` stays the live table.

    Rows that do not fit `req_to_token` (row index, negative prefix, too long) are checked once,
    by the plan builder (`build_group_plan`), which reads those rows anyway.
    """
    rows = int64_copy("rows", view.rows)
    prefix_lens = int64_copy("prefix_lens", view.prefix_lens)
    extend_lens = int64_copy("extend_lens", view.extend_lens)
    if not len(rows) == len(prefix_lens) == len(extend_lens):
        _same_length(("rows", "prefix_lens", "extend_lens"), (rows, prefix_lens, extend_lens))
    input_ids = int64_copy("input_ids", view.input_ids)
    positions = int64_copy("positions", view.positions)
    out_slots = int64_copy("out_slots", view.out_slots)
    num_tokens = len(input_ids)
    if not num_tokens == len(positions) == len(out_slots):
        _same_length(("input_ids", "positions", "out_slots"), (input_ids, positions, out_slots))
    req_to_token = as_int_array("req_to_token", view.req_to_token, 2)
    _check_active_rows(rows, extend_lens, num_tokens)
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
    write_assert = write_assert and not bool(view.skip_write_input_assert)
    if write_assert and view.expected_inputs is not None:
        expected = {
            name: as_int_array(f"expected_inputs.{name}", getattr(view.expected_inputs, name))
            for name in ("tokens", "positions")
        }
        for name, value in expected.items():
            if tuple(value.shape) != (num_tokens,):
                raise ValueError(
                    f"kv-canary: expected_inputs.{name} shape {tuple(value.shape)} != num_tokens "
                    f"{num_tokens}; caller must slice before invoking"
                )
        exp_tok = expected["tokens"].astype(np.int64)
        exp_pos = expected["positions"].astype(np.int64)
    else:
        write_assert = False
    truth, truth_lens = _truth_table(view, len(rows), req_to_token.shape[1], token_check)
    return ViewSnapshot(
        rows=rows,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        input_ids=input_ids,
        positions=positions,
        out_slots=out_slots,
        req_to_token=req_to_token,
        expected_tokens=exp_tok,
        expected_positions=exp_pos,
        write_assert=write_assert,
        truth=truth,
        truth_lens=truth_lens,
        linear_chain=bool(view.linear_chain),
    )


def _truth_table(
    view: ForwardView, nrows: int, ncols: int, token_check: bool
) -> tuple[npt.NDArray[np.integer[Any]], I64]:
    lens = np.zeros(nrows, dtype=np.int64)
    if not token_check or view.truth_tokens is None:
        return np.zeros((nrows, 0), dtype=np.int64), lens
    if isinstance(view.truth_tokens, TruthTable):
        return _truth_from_table(view.truth_tokens, nrows, ncols)
    try:
        seqs = [_truth_row(seq) for seq in list(view.truth_tokens)[:nrows]]
    except (TypeError, ValueError, OverflowError) as err:
        raise TypeError(
            "kv-canary: forward_view.truth_tokens must be one sequence of int64 token ids per "
            f"active row ({err})"
        ) from None
    width = min(max((len(s) for s in seqs), default=0), ncols)
    table = np.zeros((nrows, width), dtype=np.int64)
    for r, seq in enumerate(seqs):
        n = min(len(seq), width)
        table[r, :n] = seq[:n]
        lens[r] = len(seq)
    return table, lens


def _truth_from_table(
    tt: TruthTable, nrows: int, ncols: int
) -> tuple[npt.NDArray[np.integer[Any]], I64]:
    """`_truth_table` for a `TruthTable`: its live token table as it is (any int dtype, no copy)
    and a copy of the lengths. The plan builder, which runs right after this in the same
    `pre_forward`, reads only `truth[r, : min(lens[r], ncols, width)]` and copies each entry's
    token into the plan: that copy is the snapshot (SPEC §2.2), taken at the same moment a
    table copy here would have been."""
    tokens = as_int_array("truth_tokens.tokens", tt.tokens, 2)
    given = as_int_array("truth_tokens.lens", tt.lens, 1)
    n = min(len(given), nrows)
    if n > tokens.shape[0]:
        raise TypeError(
            f"kv-canary: forward_view.truth_tokens has {len(given)} lengths but its table only "
            f"{tokens.shape[0]} rows"
        )
    lens = np.zeros(nrows, dtype=np.int64)
    lens[:n] = given[:n]
    # a NumPy reduction costs ~1.5 us whatever its size; a few rows are faster as a list
    if n and (min(lens[:n].tolist()) if n <= _SMALL_BATCH else int(lens[:n].min())) < 0:
        raise TypeError("kv-canary: forward_view.truth_tokens has a negative row length")
    return tokens, lens


def _truth_row(seq: Any) -> I64:
    """One row's truth tokens as int64; TypeError for anything but a 1-D integer sequence."""
    if isinstance(seq, (str, bytes)):
        raise TypeError(f"got {type(seq).__name__}")
    row = np.asarray(seq)
    if row.ndim != 1 or not (row.size == 0 or np.issubdtype(row.dtype, np.integer)):
        raise TypeError(f"got shape {row.shape} dtype {row.dtype}")
    return row.astype(np.int64)


class GroupPlan(NamedTuple):
    """One group's plan: write chains per request and verify entries (empty on overflow).

    Every slot in it is inside the group (SPEC §14.2): `seeds` and `w_slots` in
    `[-1, num_slots)`, `v_slot` in `[0, num_slots)`, `v_prev` in `[-1, num_slots)`. `shadowed`
    is True when two write entries name one slot, so writes must run in flat order (§14.1).
    Built per group on every forward: a NamedTuple, as `ViewSnapshot`.
    """

    req_offsets: I64
    seeds: I64
    w_slots: I64
    v_slot: I64
    v_prev: I64
    v_pos: I64
    v_tok: I64
    verify_total: int
    overflow: bool
    shadowed: bool = False
    #: write entries that store a record (slot >= 0); counted once, when the plan is built
    num_writes: int = 0


def new_write_marks(num_slots: int) -> I64:
    """The scratch array `build_group_plan` needs per group (one entry per slot, never reset)."""
    return np.full(num_slots, -1, dtype=np.int64)


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
    marks: I64,
    stride: int = 1,
    phase: int = 0,
) -> GroupPlan:
    """Run the kernel plan builder for one group and turn its error codes into exceptions.
    `stride` / `phase`: the verify stride and this forward's phase of it (`reference.verified`).

    The plan builder checks that the active rows fit `req_to_token` (the only place this is
    checked) and range-checks every slot it emits (seeds, write slots, verify slots and
    predecessors, SWA table values), so no verify or write kernel ever indexes out of the
    group, whatever the view holds. `marks` is the group's `new_write_marks` scratch.
    """
    if marks.shape != (num_slots,) or marks.dtype != np.int64:
        raise ValueError(f"kv-canary: marks must be int64[{num_slots}], got {marks.shape}")
    use_lut = lut is not None
    lut_arr = lut if lut is not None else np.zeros(0, dtype=np.int64)
    packed, nr, nw, nv, total_v, overflow, err_kind, err_value, shadowed, writes = (
        kernels.build_plan_packed(
            snap.rows, snap.prefix_lens, snap.extend_lens, snap.req_to_token, snap.out_slots,
            lut_arr, use_lut, _NO_WINDOW if window is None else window, num_slots,
            snap.truth, snap.truth_lens, offset, verify_capacity, marks, stride, phase,
        )
    )  # fmt: skip
    if err_kind == 1:
        raise ValueError(
            f"kv-canary: SWA slot {err_value} is outside full_to_swa_index_mapping length "
            f"{len(lut_arr)}"
        )
    if err_kind == 2:
        raise slot_error(int(err_value), group_name, num_slots)
    if err_kind == 3:  # the one rows check (SPEC §14.2): name the first bad row
        check_rows_fit(snap.rows, snap.prefix_lens, snap.extend_lens, snap.req_to_token.shape)
        raise CanaryContractError("kv-canary: forward_view rows reach past req_to_token")
    # the packed layout of `build_plan_packed`: req_offsets | seeds | w_slots | v_* (four)
    w0 = 2 * nr + 1
    v0 = w0 + nw
    return GroupPlan(
        packed[: nr + 1],
        packed[nr + 1 : w0],
        packed[w0:v0],
        packed[v0 : v0 + nv],
        packed[v0 + nv : v0 + 2 * nv],
        packed[v0 + 2 * nv : v0 + 3 * nv],
        packed[v0 + 3 * nv : v0 + 4 * nv],
        int(total_v),
        bool(overflow),
        bool(shadowed),
        int(writes),
    )
