"""Numba `build_plan`: translate an endpoint's slots, range-check every one of them and lay out
its write and verify plans (SPEC §5.1, §14.2); byte-equal to `kernels.reference.build_plan`.

Every slot the verify and write kernels will touch comes out of this function, so it is where
SPEC §14.2's range checks live: those kernels index record buffers with plan values unchecked.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvcanary.canary.config import VERIFY_STRIDE_SPAN
from kvcanary.canary.kernels._intrinsics import internal

# Error kinds of the returned `err = (kind, value)`; see `kernels.reference.build_plan`.
_OK, _LUT_INDEX, _SLOT_RANGE, _ROW_RANGE = 0, 1, 2, 3


@internal
def _translate(x, lut, use_lut, num_slots, allow_none):  # type: ignore[no-untyped-def]
    """(T(x), error kind): SWA translation T, then the group's range check.

    -1 maps to -1, an error unless `allow_none` (the "no slot" sentinel of out_slots, seeds and
    predecessors). A LUT index outside the LUT is kind 1, any other value outside
    `[0, num_slots)` (a full-pool slot, or a LUT value) kind 2.
    """
    if x == -1:
        return x, _OK if allow_none else _SLOT_RANGE
    v = x
    if use_lut:
        if x < 0 or x >= lut.shape[0]:
            return x, _LUT_INDEX
        v = lut[x]
    if v < 0 or v >= num_slots:
        return v, _SLOT_RANGE
    return v, _OK


@internal
def _rows_fit(rows, prefix_lens, req_offsets, nrows_table, ncols):  # type: ignore[no-untyped-def]
    """Index of the first active row outside `req_to_token` (row index, a negative prefix, or
    positions past its width, overflow-safe), or -1. The one check of SPEC §14.2's row rule:
    `plan.build_group_plan` turns a hit into the message naming the row."""
    for r in range(rows.shape[0]):
        if rows[r] == 0:
            continue
        wl = req_offsets[r + 1] - req_offsets[r]
        p = prefix_lens[r]
        if rows[r] < 0 or rows[r] >= nrows_table or p < 0 or p > ncols - wl:
            return r
    return -1


@internal
def _row_in_range(r2t, row, lo, hi, num_slots):  # type: ignore[no-untyped-def]
    """True when `r2t[row, lo:hi]` are all in `[0, num_slots)` and the predecessor of `lo`
    (when `lo > 0`) in `[-1, num_slots)`: one branch-free pass LLVM can vectorise."""
    ok = True
    for pos in range(lo, hi):
        s = r2t[row, pos]
        ok &= (s >= 0) & (s < num_slots)
    if lo > 0 and lo < hi:
        p = r2t[row, lo - 1]
        ok &= (p >= -1) & (p < num_slots)
    return ok


@internal
def stride_verifies(pos, stride, phase):  # type: ignore[no-untyped-def]
    """Whether phase `phase` of the verify stride verifies position `pos`: always with stride
    1, else when its unit `pos // VERIFY_STRIDE_SPAN` modulo `stride` equals `phase`. The
    compiled `reference.verified`; the vLLM adapter's TAIL block list reads it too."""
    return stride == 1 or (pos // VERIFY_STRIDE_SPAN) % stride == phase


@internal
def _unit_end(pos, hi, stride):  # type: ignore[no-untyped-def]
    """The end of the stride unit holding `pos`, capped at `hi` (`hi` itself without a stride:
    one segment per row)."""
    if stride == 1:
        return hi
    return min(hi, (pos // VERIFY_STRIDE_SPAN + 1) * VERIFY_STRIDE_SPAN)


@internal
def _verified_count(lo, hi, stride, phase):  # type: ignore[no-untyped-def]
    """How many positions of `[lo, hi)` this phase verifies (one step a unit, not a
    position)."""
    n = 0
    a = lo
    while a < hi:
        b = _unit_end(a, hi, stride)
        if stride_verifies(a, stride, phase):
            n += b - a
        a = b
    return n


@internal
def _shadowed_writes(w_slots, marks):  # type: ignore[no-untyped-def]
    """True when two write entries name one slot (slot 0 included).

    `marks` is a per-group scratch array of `num_slots` entry indices that is never reset: entry
    `i` stores `marks[s] = i`, and an earlier entry `j` wrote `s` in this plan exactly when
    `j = marks[s] < i` and `w_slots[j] == s`, whatever stale values earlier plans left (the
    sparse-set trick), so the check is one pass with no clearing.
    """
    dup = False
    for i in range(w_slots.shape[0]):
        s = w_slots[i]
        if s < 0:
            continue
        j = marks[s]
        if j >= 0 and j < i and w_slots[j] == s:
            dup = True
        marks[s] = i
    return dup


@internal
def plan_sizes(  # type: ignore[no-untyped-def]
    rows, prefix_lens, extend_lens, r2t, out_slots, lut, use_lut, window, num_slots, stride,
    phase, req_offsets, seeds, err,
):  # fmt: skip
    """`build_plan`'s first pass, into the caller's arrays: `req_offsets` (`nrows + 1`; entry 0
    must be 0), `seeds` (`nrows`, all -1 on entry) and the row checks. Returns the verify total
    (`total_v`); on an error `err` holds `(kind, value)` and the return is 0."""
    nrows = rows.shape[0]
    for r in range(nrows):
        wl = max(extend_lens[r], 0) if rows[r] != 0 else 0
        req_offsets[r + 1] = req_offsets[r] + wl
    total_w = req_offsets[nrows]
    bad_row = _rows_fit(rows, prefix_lens, req_offsets, r2t.shape[0], r2t.shape[1])
    if bad_row >= 0 or total_w > out_slots.shape[0]:
        err[0] = _ROW_RANGE
        err[1] = bad_row
        return 0
    total_v = 0
    for r in range(nrows):
        if rows[r] == 0:
            continue
        wl = req_offsets[r + 1] - req_offsets[r]
        if prefix_lens[r] > 0 and wl > 0:
            s, kind = _translate(r2t[rows[r], prefix_lens[r] - 1], lut, use_lut, num_slots, True)
            if kind != _OK:
                err[0] = kind
                err[1] = s
                return 0
            seeds[r] = -1 if s == 0 else s
        if prefix_lens[r] > 0:
            p = prefix_lens[r]
            total_v += _verified_count(max(0, p - window), p, stride, phase)
    return total_v


@internal
def plan_writes(out_slots, lut, use_lut, num_slots, marks, w_slots, err):  # type: ignore[no-untyped-def]
    """`build_plan`'s write plan into `w_slots` (its length is the write total): each slot
    translated and range-checked. Returns whether two entries write one slot; on an error
    `err` holds `(kind, value)` and `marks` is untouched."""
    for i in range(w_slots.shape[0]):
        s, kind = _translate(out_slots[i], lut, use_lut, num_slots, True)
        if kind != _OK:
            err[0] = kind
            err[1] = s
            return False
        w_slots[i] = s
    return _shadowed_writes(w_slots, marks)


@internal
def plan_verifies(  # type: ignore[no-untyped-def]
    rows, prefix_lens, r2t, lut, use_lut, window, num_slots, stride, phase, truth, truth_lens,
    offset, v_slot, v_prev, v_pos, v_tok, err,
):  # fmt: skip
    """`build_plan`'s verify plan into `v_slot .. v_tok` (their length is the verify total):
    the attended slots this phase of the stride verifies, with their predecessors. Every
    attended slot and predecessor is range-checked, verified this phase or not, so a stride
    changes no error. On an error `err` holds `(kind, value)`."""
    ncols = r2t.shape[1]
    k = 0
    for r in range(rows.shape[0]):
        if rows[r] == 0:
            continue
        row = rows[r]
        limit = min(truth_lens[r], ncols, truth.shape[1]) if r < truth.shape[0] else 0
        lo = max(0, prefix_lens[r] - window)
        if not use_lut and _row_in_range(r2t, row, lo, prefix_lens[r], num_slots):
            # FULL group, whole row in range (the common case): copy without per-entry checks,
            # a unit of the stride at a time (the whole row in one piece without a stride)
            a = lo
            while a < prefix_lens[r]:
                b = _unit_end(a, prefix_lens[r], stride)
                if stride_verifies(a, stride, phase):
                    for pos in range(a, b):
                        t = pos + offset
                        v_slot[k] = r2t[row, pos]
                        v_prev[k] = r2t[row, pos - 1] if pos > 0 else -1
                        v_pos[k] = pos
                        v_tok[k] = truth[r, t] if 0 <= t < limit else -1
                        k += 1
                a = b
            continue
        for pos in range(lo, prefix_lens[r]):
            s, kind = _translate(r2t[row, pos], lut, use_lut, num_slots, False)
            p = -1
            kind2 = _OK
            if kind == _OK and pos > 0:
                p, kind2 = _translate(r2t[row, pos - 1], lut, use_lut, num_slots, True)
            if kind != _OK or kind2 != _OK:
                err[0] = kind if kind != _OK else kind2
                err[1] = s if kind != _OK else p
                return
            if not stride_verifies(pos, stride, phase):
                continue
            t = pos + offset
            v_slot[k] = s
            v_prev[k] = p
            v_pos[k] = pos
            v_tok[k] = truth[r, t] if 0 <= t < limit else -1
            k += 1


@njit(cache=True)
def build_plan(  # type: ignore[no-untyped-def]
    rows, prefix_lens, extend_lens, r2t, out_slots, lut, use_lut, window, num_slots,
    truth, truth_lens, offset, verify_capacity, marks, stride, phase,
):  # fmt: skip
    """See `kernels.reference.build_plan`: `plan_sizes`, `plan_writes` and `plan_verifies` into
    arrays of their own."""
    nrows = rows.shape[0]
    err = np.zeros(2, dtype=np.int64)
    req_offsets = np.zeros(nrows + 1, dtype=np.int64)
    seeds = np.full(nrows, -1, dtype=np.int64)
    empty = np.empty(0, dtype=np.int64)
    total_v = plan_sizes(rows, prefix_lens, extend_lens, r2t, out_slots, lut, use_lut, window,
                         num_slots, stride, phase, req_offsets, seeds, err)  # fmt: skip
    if err[0] != 0:
        return req_offsets, seeds, empty, empty, empty, empty, empty, 0, False, err, False
    w_slots = np.empty(req_offsets[nrows], dtype=np.int64)
    shadowed = plan_writes(out_slots, lut, use_lut, num_slots, marks, w_slots, err)
    if err[0] != 0:
        return req_offsets, seeds, empty, empty, empty, empty, empty, 0, False, err, False
    overflow = total_v > verify_capacity
    n = 0 if overflow else total_v
    v_slot = np.empty(n, dtype=np.int64)
    v_prev = np.empty(n, dtype=np.int64)
    v_pos = np.empty(n, dtype=np.int64)
    v_tok = np.empty(n, dtype=np.int64)
    if overflow:
        return (req_offsets, seeds, w_slots, v_slot, v_prev, v_pos, v_tok, total_v, True, err,
                shadowed)  # fmt: skip
    plan_verifies(rows, prefix_lens, r2t, lut, use_lut, window, num_slots, stride, phase, truth,
                  truth_lens, offset, v_slot, v_prev, v_pos, v_tok, err)  # fmt: skip
    if err[0] != 0:
        return req_offsets, seeds, w_slots, empty, empty, empty, empty, 0, False, err, False
    return req_offsets, seeds, w_slots, v_slot, v_prev, v_pos, v_tok, total_v, False, err, shadowed


@njit(cache=True)
def build_plan_packed(  # type: ignore[no-untyped-def]
    rows, prefix_lens, extend_lens, r2t, out_slots, lut, use_lut, window, num_slots,
    truth, truth_lens, offset, verify_capacity, marks, stride, phase,
):  # fmt: skip
    """`build_plan` with its seven arrays in one buffer, `req_offsets | seeds | w_slots | v_slot
    | v_prev | v_pos | v_tok`, and scalars: `(buffer, rows, writes, verify entries, total_v,
    overflow, err kind, err value, shadowed, records written)`. Each array handed back to Python
    costs a boxing (about 0.3 us apiece, measured); one buffer and its slices cost a third of
    eight arrays."""
    nr = rows.shape[0]
    err = np.zeros(2, dtype=np.int64)
    head = np.zeros(2 * nr + 1, dtype=np.int64)  # req_offsets | seeds, before the totals are known
    head[nr + 1 :] = -1
    total_v = plan_sizes(rows, prefix_lens, extend_lens, r2t, out_slots, lut, use_lut, window,
                         num_slots, stride, phase, head[: nr + 1], head[nr + 1 :], err)  # fmt: skip
    if err[0] != 0:
        return head, nr, 0, 0, 0, False, err[0], err[1], False, 0
    h = 2 * nr + 1
    nw = head[nr]
    overflow = total_v > verify_capacity
    nv = 0 if overflow else total_v
    buf = np.empty(h + nw + 4 * nv, dtype=np.int64)  # the plan is written here, not copied
    buf[:h] = head
    w_slots = buf[h : h + nw]
    shadowed = plan_writes(out_slots, lut, use_lut, num_slots, marks, w_slots, err)
    if err[0] != 0:
        return buf[:h], nr, 0, 0, 0, False, err[0], err[1], False, 0
    writes = 0
    for i in range(nw):
        writes += w_slots[i] >= 0
    if overflow:
        return buf, nr, nw, 0, total_v, True, 0, 0, shadowed, writes
    v = h + nw
    plan_verifies(rows, prefix_lens, r2t, lut, use_lut, window, num_slots, stride, phase, truth,
                  truth_lens, offset, buf[v : v + nv], buf[v + nv : v + 2 * nv],
                  buf[v + 2 * nv : v + 3 * nv], buf[v + 3 * nv :], err)  # fmt: skip
    if err[0] != 0:
        return buf[:v], nr, nw, 0, 0, False, err[0], err[1], False, writes
    return buf, nr, nw, nv, total_v, False, 0, 0, shadowed, writes
