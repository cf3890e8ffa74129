"""Numba `forward_head` / `forward_tail`: a small forward's whole canary work in one call each.

`forward_head` does what `Canary.pre_forward` does for the common view (one launch per stage,
no fault injector, not `recover`), on the calling thread: the snapshot's contract checks
(SPEC §2.2, §6), the copies, the plan with its range checks (§5.1, §14.2) and the HEAD stage.
`forward_tail` runs the TAIL stage over the same packed plan, `sweep_serial` a small sweep
(`sweep_runs_serial` one given as runs of consecutive slots, expanded in the call). In vLLM
the Python around a forward's six small calls (snapshot, plan, two stages, their scratch
passes) cost about three times the work, most of it cold-cache interpreter time right after
the model's forward.

Nothing here raises or formats an error: any view the checks do not pass returns `FALLBACK`
before anything is written, and the runtime runs the general path, which names the problem in
the SPEC's words (or, where these checks were only conservative, does the work). The packed
buffer is `rows | prefix_lens | extend_lens | truth_lens | input_ids | positions | out_slots |
req_offsets | seeds | w_slots | v_slot | v_prev | v_pos | v_tok` (`fused.PackedForward` reads it).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvcanary.canary.kernels.fast_plan import plan_sizes, plan_verifies, plan_writes
from kvcanary.canary.kernels.fast_stage import stage_serial
from kvcanary.canary.kernels.fast_verify import verify_serial

__all__ = [
    "DONE", "FALLBACK", "FALLBACK_SWEEP", "GROW_PACKED", "GROW_SCRATCH", "PLAN_ONLY", "forward_head",
    "forward_tail", "sweep_runs_serial", "sweep_serial",
]  # fmt: skip

#: `forward_head` statuses: the HEAD stage ran; the plan is built but the stage is too large
#: for one thread (the runtime launches it); the scratch ring needs `value` rows (call again);
#: the view is not the common case (the runtime takes the general path); the packed buffer
#: needs `value` entries (call again).
DONE, PLAN_ONLY, GROW_SCRATCH, FALLBACK, GROW_PACKED = 0, 1, 2, 3, 4
#: `sweep_serial`'s answer for a walk with a slot outside the group (the general path raises)
FALLBACK_SWEEP = -(1 << 62)


@njit(cache=True)
def _no_assert(n):  # type: ignore[no-untyped-def]
    """False, typed `bool`: a literal False would compile `stage_serial` (and its verify and
    write) once more for a `Literal[bool]` argument instead of reusing the runtime's."""
    return n < 0


@njit(cache=True)
def _view_fits(rows, prefix, extend, input_ids, positions, out_slots, req_cap, entry_cap):  # type: ignore[no-untyped-def]
    """`snapshot_view`'s checks: lengths agree, padding rows (0) only after the active rows,
    whose write lengths fit the flat entries, and both capacities hold."""
    nr = rows.shape[0]
    nt = input_ids.shape[0]
    if prefix.shape[0] != nr or extend.shape[0] != nr:
        return False
    if positions.shape[0] != nt or out_slots.shape[0] != nt:
        return False
    if nr > req_cap or nt > entry_cap:
        return False
    padding = False
    need = np.int64(0)
    for r in range(nr):
        if rows[r] == 0:
            padding = True
        elif padding:
            return False
        elif extend[r] > 0:
            need += min(extend[r], nt + 1)  # capped: exact whenever the sum fits
            if need > nt:
                return False
    return True


@njit(cache=True)
def forward_head(  # type: ignore[no-untyped-def]
    packed, rows, prefix, extend, input_ids, positions, out_slots, r2t, truth, truth_lens,
    has_truth, req_cap, entry_cap, lut, use_lut, window, num_slots, offset, verify_capacity,
    marks, serial_limit, chain_position, stride, phase, buf, s0, s1, s2, s3, params, count, tag,
    ring, state,
):  # fmt: skip
    """Check, snapshot and plan one view into `packed` (its first entries; the caller's buffer,
    kept across calls: a returned array would be boxed on every call), then run its HEAD stage
    (`stage_serial`, rows into `ring`/`state`, reset first) when it is small. Returns
    `(status, value, rows, tokens, writes, verify entries, total_v, overflow, shadowed,
    records written, recorded)`: `value` is the scratch rows (`GROW_SCRATCH`) or packed entries
    (`GROW_PACKED`) needed, `recorded` the ring rows the stage recorded (`DONE`; else 0)."""
    nr = rows.shape[0]
    nt = input_ids.shape[0]
    none = np.empty(0, dtype=np.int64)
    if not _view_fits(rows, prefix, extend, input_ids, positions, out_slots, req_cap,
                      entry_cap):  # fmt: skip
        return FALLBACK, 0, 0, 0, 0, 0, 0, False, False, 0, 0
    lens = np.zeros(nr, dtype=np.int64)
    if has_truth:  # `_truth_from_table`: its rows, the given lengths, none negative
        n = min(truth_lens.shape[0], nr)
        if n > truth.shape[0]:
            return FALLBACK, 0, 0, 0, 0, 0, 0, False, False, 0, 0
        for r in range(n):
            if truth_lens[r] < 0:
                return FALLBACK, 0, 0, 0, 0, 0, 0, False, False, 0, 0
            lens[r] = truth_lens[r]
    # the plan goes straight into `packed` (no arrays of its own, no copy): the view's parts
    # first, then `req_offsets | seeds`, and once their totals are known the write and verify
    # plans; on a fallback `packed` holds garbage, which nothing reads
    k = 0
    head = 4 * nr + 3 * nt + 2 * nr + 1
    if head > packed.shape[0]:
        return GROW_PACKED, head, 0, 0, 0, 0, 0, False, False, 0, 0
    for arr in (rows, prefix, extend, lens):
        packed[k : k + nr] = arr
        k += nr
    for arr in (input_ids, positions, out_slots):
        packed[k : k + nt] = arr
        k += nt
    req_offsets = packed[k : k + nr + 1]
    seeds = packed[k + nr + 1 : head]
    req_offsets[0] = 0
    seeds[:] = -1
    err = np.zeros(2, dtype=np.int64)
    total_v = plan_sizes(rows, prefix, extend, r2t, out_slots, lut, use_lut, window, num_slots,
                         stride, phase, req_offsets, seeds, err)  # fmt: skip
    if err[0] != 0:
        return FALLBACK, 0, 0, 0, 0, 0, 0, False, False, 0, 0
    nw = req_offsets[nr]
    overflow = total_v > verify_capacity
    nv = 0 if overflow else total_v
    size = head + nw + 4 * nv
    if size > packed.shape[0]:
        return GROW_PACKED, size, 0, 0, 0, 0, 0, False, False, 0, 0
    w_slots = packed[head : head + nw]
    shadowed = plan_writes(out_slots, lut, use_lut, num_slots, marks, w_slots, err)
    if err[0] != 0:
        return FALLBACK, 0, 0, 0, 0, 0, 0, False, False, 0, 0
    v0 = head + nw
    v_slot, v_prev = packed[v0 : v0 + nv], packed[v0 + nv : v0 + 2 * nv]
    v_pos, v_tok = packed[v0 + 2 * nv : v0 + 3 * nv], packed[v0 + 3 * nv : size]
    if not overflow:
        plan_verifies(rows, prefix, r2t, lut, use_lut, window, num_slots, stride, phase, truth,
                      lens, offset, v_slot, v_prev, v_pos, v_tok, err)  # fmt: skip
        if err[0] != 0:
            return FALLBACK, 0, 0, 0, 0, 0, 0, False, False, 0, 0
    writes = 0
    for i in range(nw):
        writes += w_slots[i] >= 0
    status = DONE
    value = 0
    recorded = 0
    if nv + nw >= serial_limit:
        status = PLAN_ONLY
    elif nv + 2 * nw > ring.shape[0]:  # a verify row per entry, two write rows per entry
        status = GROW_SCRATCH
        value = nv + 2 * nw
    else:
        state[0] = 0
        stage_serial(
            buf, v_slot, v_prev, v_pos, v_tok, not overflow, seeds, req_offsets, w_slots,
            shadowed, input_ids, positions, _no_assert(nr), none, none, chain_position, s0, s1, s2, s3,
            params, count, tag, ring, state,
        )  # fmt: skip
        recorded = state[0]
    return status, value, nr, nt, nw, nv, total_v, overflow, shadowed, writes, recorded


@njit(cache=True)
def forward_tail(  # type: ignore[no-untyped-def]
    packed, nr, nt, nw, nv, overflow, shadowed, chain_position, buf, s0, s1, s2, s3, params,
    count, tag, ring, state,
):  # fmt: skip
    """The TAIL stage of a plan `forward_head` packed (the scratch ring sized by it), rows
    into `ring`/`state` (reset first); returns the ring rows the stage recorded."""
    none = np.empty(0, dtype=np.int64)
    ids = packed[4 * nr : 4 * nr + nt]
    pos = packed[4 * nr + nt : 4 * nr + 2 * nt]
    k = 4 * nr + 3 * nt
    req_offsets = packed[k : k + nr + 1]
    k += nr + 1
    seeds = packed[k : k + nr]
    k += nr
    w_slots = packed[k : k + nw]
    k += nw
    state[0] = 0
    stage_serial(
        buf, packed[k : k + nv], packed[k + nv : k + 2 * nv], packed[k + 2 * nv : k + 3 * nv],
        packed[k + 3 * nv : k + 4 * nv], not overflow, seeds, req_offsets, w_slots, shadowed,
        ids, pos, _no_assert(nr), none, none, chain_position, s0, s1, s2, s3, params, count, tag, ring,
        state,
    )  # fmt: skip
    return state[0]


@njit(cache=True)
def sweep_serial(  # type: ignore[no-untyped-def]
    walked, num_slots, buf, s0, s1, s2, s3, params, count, tag, ring, state
):  # fmt: skip
    """A FULL group's sweep of a walk (`[n, 3]` slot, position, prev_slot), range checks and
    `verify_serial` in one call, rows into `ring`/`state` (reset first). Returns the entries
    verified, `FALLBACK_SWEEP` when a slot is outside `[0, num_slots)` or a predecessor outside
    `[-1, num_slots)` (nothing verified: the general path raises the SPEC's error), or
    `-(rows needed)` when the scratch ring is too small."""
    n = walked.shape[0]
    slots = np.empty(n, dtype=np.int64)
    prevs = np.empty(n, dtype=np.int64)
    positions = np.empty(n, dtype=np.int64)
    for i in range(n):
        s = walked[i, 0]
        p = walked[i, 2]
        if s < 0 or s >= num_slots or p < -1 or p >= num_slots:
            return FALLBACK_SWEEP
        slots[i] = s
        positions[i] = walked[i, 1]
        prevs[i] = p
    if n > ring.shape[0]:
        return -n
    return _verify_walk(slots, positions, prevs, buf, s0, s1, s2, s3, params, count, tag, ring,
                        state)  # fmt: skip


@njit(cache=True)
def _verify_walk(  # type: ignore[no-untyped-def]
    slots, positions, prevs, buf, s0, s1, s2, s3, params, count, tag, ring, state
):  # fmt: skip
    """`verify_serial` of a sweep's entries (no token expected), rows into `ring`/`state`
    (reset first); returns the entries."""
    n = slots.shape[0]
    state[0] = 0
    verify_serial(buf, slots, prevs, positions, np.full(n, -1, dtype=np.int64), s0, s1, s2, s3,
                  params, count, tag, ring, state)  # fmt: skip
    return n


_INT64_MAX = (1 << 63) - 1


@njit(cache=True)
def sweep_runs_serial(  # type: ignore[no-untyped-def]
    runs, num_slots, serial_limit, buf, s0, s1, s2, s3, params, count, tag, ring, state
):  # fmt: skip
    """`sweep_serial` of a walk given as runs (`[m, 4]` first slot, first position, prev slot,
    length: a walker's `walk_runs`), expanded here: entry `j` of a run is slot `first + j` at
    position `position + j`, its predecessor `prev` for `j = 0` and `first + j - 1` after.
    Empty runs are skipped. `FALLBACK_SWEEP` (nothing verified) for a run with a negative
    length, a slot outside `[0, num_slots)`, a predecessor outside `[-1, num_slots)`, a position
    past int64, or a walk of `serial_limit` entries or more (the general path expands it and
    raises the SPEC's error, or does the work); else as `sweep_serial`."""
    m = runs.shape[0]
    n = 0
    for r in range(m):
        length = runs[r, 3]
        if length == 0:
            continue
        first, position, prev = runs[r, 0], runs[r, 1], runs[r, 2]
        if (length < 0 or length > num_slots or first < 0 or first > num_slots - length
                or prev < -1 or prev >= num_slots or position > _INT64_MAX - length):  # fmt: skip
            return FALLBACK_SWEEP
        n += length
        if n >= serial_limit:
            return FALLBACK_SWEEP
    if n > ring.shape[0]:
        return -n
    slots = np.empty(n, dtype=np.int64)
    prevs = np.empty(n, dtype=np.int64)
    positions = np.empty(n, dtype=np.int64)
    k = 0
    for r in range(m):
        first, position, prev = runs[r, 0], runs[r, 1], runs[r, 2]
        for j in range(runs[r, 3]):
            slots[k] = first + j
            positions[k] = position + j
            prevs[k] = prev if j == 0 else first + j - 1
            k += 1
    return _verify_walk(slots, positions, prevs, buf, s0, s1, s2, s3, params, count, tag, ring,
                        state)  # fmt: skip
