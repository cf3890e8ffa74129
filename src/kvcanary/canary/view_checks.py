"""Checks on what an engine hands the canary (SPEC §2.2, §14.2): integer arrays of the right
dtype and rank, batch rows that fit `req_to_token`, and slot values inside their group.

Everything here is vectorised NumPy over arrays of batch rows or token entries (never one
Python step per entry), so it costs little next to the kernels it protects. The per-entry
checks of slots read through `req_to_token` live in the plan kernels, which touch those
entries anyway.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvcanary.contract.errors import CanaryContractError

__all__ = [
    "as_int_array",
    "check_rows_fit",
    "check_slot_range",
    "needed_tokens",
    "runs_entries",
    "slot_error",
    "walker_entries",
    "walker_runs",
]

I64 = npt.NDArray[np.int64]
_INT64_MAX = (1 << 63) - 1
_INT_TENSOR_DTYPES = (torch.int32, torch.int64)


def as_int_array(name: str, value: Any, ndim: int | None = None) -> npt.NDArray[np.integer[Any]]:
    """A NumPy view of an int32/int64 tensor or array (shares memory).

    TypeError `kv-canary: forward_view.{name} must have an int32 or int64 dtype, got {}` for any
    other dtype, and for a value without one (a list, a tuple) with its type name in place of the
    dtype; CanaryContractError when `ndim` is given and the rank differs.
    """
    if type(value) is torch.Tensor and value.is_cpu and value.dtype in _INT_TENSOR_DTYPES:
        # the common case in one test: plain attributes, and `detach` only when grad is on
        arr_fast: npt.NDArray[np.integer[Any]] = (
            value.detach() if value.requires_grad else value
        ).numpy()
        if ndim is None or arr_fast.ndim == ndim:
            return arr_fast
    if isinstance(value, torch.Tensor):
        if value.dtype not in (torch.int32, torch.int64):
            raise TypeError(
                f"kv-canary: forward_view.{name} must have an int32 or int64 dtype, "
                f"got {value.dtype}"
            )
        if value.device.type != "cpu":
            raise TypeError(
                f"kv-canary: forward_view.{name} must be a CPU tensor, got device {value.device}"
            )
        arr: npt.NDArray[np.integer[Any]] = value.detach().numpy()
    elif hasattr(value, "dtype"):  # NumPy arrays (memmaps, subclasses) and scalars
        arr = np.asarray(value)
        if arr.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise TypeError(
                f"kv-canary: forward_view.{name} must have an int32 or int64 dtype, got {arr.dtype}"
            )
    else:
        raise TypeError(
            f"kv-canary: forward_view.{name} must have an int32 or int64 dtype, "
            f"got {type(value).__name__}"
        )
    if ndim is not None and arr.ndim != ndim:
        raise CanaryContractError(
            f"kv-canary: forward_view.{name} must be {ndim}-D, got shape {tuple(arr.shape)}"
        )
    return arr


def slot_error(value: int, group_name: str, num_slots: int) -> CanaryContractError:
    """SPEC §2.3 / §14.2's error for a slot outside its group."""
    return CanaryContractError(
        f"kv-canary: slot {value} is outside the {group_name} group's {num_slots} slots"
    )


def check_slot_range(slots: I64, *, group_name: str, num_slots: int, allow_none: bool) -> None:
    """Every value in `[0, num_slots)`, or -1 when `allow_none`; else the first bad one (in
    array order) raises `slot_error`. Negative values never wrap."""
    if slots.size == 0:
        return
    low = -1 if allow_none else 0
    if int(slots.min()) >= low and int(slots.max()) < num_slots:
        return
    bad = np.flatnonzero((slots < low) | (slots >= num_slots))
    raise slot_error(int(slots[bad[0]]), group_name, num_slots)


def needed_tokens(active: npt.NDArray[np.bool_], extend_lens: I64, num_tokens: int) -> int:
    """Sum of the active rows' write lengths (negative extend_lens count as 0), exact even when
    huge values would overflow int64: each term is capped at `num_tokens + 1` for the cheap
    vectorised sum, and the exact (Python int) sum is taken only when that exceeds the tokens."""
    wl = np.where(active, np.maximum(extend_lens, 0), 0)
    capped = int(np.minimum(wl, num_tokens + 1).sum())
    if capped <= num_tokens:
        return capped
    return sum(int(x) for x in wl[wl > 0])


def check_rows_fit(
    rows: I64, prefix_lens: I64, extend_lens: I64, table_shape: tuple[int, ...]
) -> None:
    """Each active row names a `req_to_token` row, has `prefix_len >= 0`, and its positions
    `[0, prefix_len + extend_len)` fit the table's width (SPEC §14.2)."""
    active = rows != 0
    if not active.any():
        return
    num_rows, width = table_shape
    wl = np.maximum(extend_lens, 0)
    # `prefix > width - wl`, not `prefix + wl > width`: no int64 overflow for huge values.
    bad_row = active & ((rows < 0) | (rows >= num_rows))
    bad_prefix = active & (prefix_lens < 0)
    too_long = active & (prefix_lens > width - wl)
    first = np.flatnonzero(bad_row | bad_prefix | too_long)
    if first.size == 0:
        return
    i = int(first[0])
    row, prefix = int(rows[i]), int(prefix_lens[i])
    if bad_row[i]:
        raise CanaryContractError(
            f"kv-canary: forward_view row at index {i} names req_to_token row {row}, but "
            f"req_to_token has {num_rows} rows"
        )
    if bad_prefix[i]:
        raise CanaryContractError(
            f"kv-canary: forward_view row at index {i} (req_to_token row {row}) has a negative "
            f"prefix_len {prefix}"
        )
    raise CanaryContractError(
        f"kv-canary: forward_view row at index {i} (req_to_token row {row}) needs "
        f"prefix_len + extend_len = {prefix + int(wl[i])} positions but req_to_token is only "
        f"{width} wide"
    )


def walker_entries(walker: Any) -> I64:
    """A prefix-cache walk (SPEC §2.5) as an `[n, 3]` int64 array of (slot, position, prev_slot).

    CanaryContractError when the walker yields anything but integer triples that fit int64;
    the slot values are range-checked per group by `GroupBuffers.translate`. A walker with a
    `walk_array()` method (the same walk as one int64 `[n, 3]` array, see `PrefixCacheWalker`)
    is read through it, without a Python step per entry.
    """
    walk_array = getattr(walker, "walk_array", None)
    if walk_array is not None:
        got = walk_array()
        if not (isinstance(got, np.ndarray) and got.ndim == 2 and got.shape[1] == 3
                and got.dtype == np.int64):  # fmt: skip
            raise CanaryContractError(
                "kv-canary: the prefix-cache walker's walk_array() must return an int64 [n, 3] "
                f"array of (slot, position, prev_slot), got {type(got).__name__} "
                f"{getattr(got, 'dtype', '')} {getattr(got, 'shape', '')}"
            )
        out: I64 = got
        return out
    entries = list(walker.walk())
    if not entries:
        return np.zeros((0, 3), dtype=np.int64)
    try:
        arr = np.array(entries)
    except (TypeError, ValueError, OverflowError):
        arr = np.zeros(0)
    fits = arr.ndim == 2 and arr.shape[1] == 3 and arr.dtype.kind in "iu"
    if fits and arr.dtype.kind == "u":
        fits = int(arr.max()) < 1 << 63
    if not fits:
        raise CanaryContractError(
            "kv-canary: the prefix-cache walker must yield (slot, position, prev_slot) int64 "
            f"triples, got {_first_bad_entry(entries)!r}"
        )
    return arr.astype(np.int64)


def walker_runs(walker: Any) -> I64 | None:
    """A walker's `walk_runs()` (`PrefixCacheWalker`): the walk as an int64 `[m, 4]` array of
    runs `(first_slot, first_position, prev_slot, length)`, or None when the walker has no such
    method (then `walker_entries` reads the walk). CanaryContractError for anything but a
    C-contiguous int64 `[m, 4]` array; the runs' values are checked where they are expanded
    (`runs_entries`, or the fused sweep)."""
    walk_runs = getattr(walker, "walk_runs", None)
    if walk_runs is None:
        return None
    got = walk_runs()
    if not (type(got) is np.ndarray and got.ndim == 2 and got.shape[1] == 4
            and got.dtype == np.int64 and got.flags.c_contiguous):  # fmt: skip
        raise CanaryContractError(
            "kv-canary: the prefix-cache walker's walk_runs() must return a C-contiguous int64 "
            "[m, 4] array of (first_slot, first_position, prev_slot, length), got "
            f"{type(got).__name__} {getattr(got, 'dtype', '')} {getattr(got, 'shape', '')}"
        )
    out: I64 = got
    return out


def runs_entries(runs: I64) -> I64:
    """`runs` (from `walker_runs`) as the walk's `[n, 3]` entries: entry `j` of a run is
    `(first_slot + j, first_position + j, prev_slot if j == 0 else first_slot + j - 1)`.

    CanaryContractError for a negative length, or a run whose slots or positions pass int64;
    slot values are range-checked per group afterwards, as for any walk."""
    first, position, prev, length = (runs[:, c] for c in range(4))
    bad = (length < 0) | (first > _INT64_MAX - length) | (position > _INT64_MAX - length)
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        raise CanaryContractError(
            "kv-canary: the prefix-cache walker's walk_runs() gave run "
            f"{tuple(int(x) for x in runs[r])}: its length must be >= 0 and its slots and "
            "positions must fit int64"
        )
    n = int(length.sum())
    which = np.repeat(np.arange(len(runs)), length)
    j = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(length) - length, length)
    out = np.empty((n, 3), dtype=np.int64)
    out[:, 0] = first[which] + j
    out[:, 1] = position[which] + j
    out[:, 2] = np.where(j == 0, prev[which], out[:, 0] - 1)
    return out


def _first_bad_entry(entries: list[Any]) -> Any:
    for entry in entries:
        try:
            values = [int(x) for x in entry]
            ok = len(values) == 3 and all(
                -(1 << 63) <= v < 1 << 63 and not isinstance(x, float)
                for v, x in zip(values, entry, strict=True)
            )
        except (TypeError, ValueError):
            ok = False
        if not ok:
            return entry
    return entries[0]
