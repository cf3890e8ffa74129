"""Numba `build_plan`: translate an endpoint's slots and lay out its write and verify plans
(SPEC §4); byte-equal to `kernels.reference.build_plan`."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, inline="always")
def _translate(x, lut, use_lut):  # type: ignore[no-untyped-def]
    """SWA translation T; returns (value, ok)."""
    if not use_lut or x == -1:
        return x, True
    if x < 0 or x >= lut.shape[0]:
        return x, False
    return lut[x], True


@njit(cache=True)
def build_plan(  # type: ignore[no-untyped-def]
    rows, prefix_lens, extend_lens, r2t, out_slots, lut, use_lut, window, num_slots,
    truth, truth_lens, offset, verify_capacity,
):  # fmt: skip
    """See `kernels.reference.build_plan`."""
    nrows = rows.shape[0]
    ncols = r2t.shape[1]
    err = np.zeros(2, dtype=np.int64)
    req_offsets = np.zeros(nrows + 1, dtype=np.int64)
    for r in range(nrows):
        wl = max(extend_lens[r], 0) if rows[r] != 0 else 0
        req_offsets[r + 1] = req_offsets[r] + wl
    total_w = req_offsets[nrows]
    seeds = np.full(nrows, -1, dtype=np.int64)
    w_slots = np.empty(total_w, dtype=np.int64)
    total_v = 0
    for r in range(nrows):
        if rows[r] == 0:
            continue
        wl = req_offsets[r + 1] - req_offsets[r]
        if prefix_lens[r] + wl > ncols or rows[r] < 0 or rows[r] >= r2t.shape[0]:
            err[0] = 3
            err[1] = r
            return req_offsets, seeds, w_slots, w_slots, w_slots, w_slots, w_slots, 0, False, err
        if prefix_lens[r] > 0 and wl > 0:
            s, ok = _translate(r2t[rows[r], prefix_lens[r] - 1], lut, use_lut)
            if not ok:
                err[0] = 1
                err[1] = s
                return (
                    req_offsets,
                    seeds,
                    w_slots,
                    w_slots,
                    w_slots,
                    w_slots,
                    w_slots,
                    0,
                    False,
                    err,
                )
            seeds[r] = -1 if s == 0 else s
        total_v += max(prefix_lens[r] - max(0, prefix_lens[r] - window), 0)
    for i in range(total_w):
        s, ok = _translate(out_slots[i], lut, use_lut)
        if not ok:
            err[0] = 1
            err[1] = s
            return req_offsets, seeds, w_slots, w_slots, w_slots, w_slots, w_slots, 0, False, err
        if s < -1 or s >= num_slots:
            err[0] = 2
            err[1] = s
            return req_offsets, seeds, w_slots, w_slots, w_slots, w_slots, w_slots, 0, False, err
        w_slots[i] = s
    overflow = total_v > verify_capacity
    n = 0 if overflow else total_v
    v_slot = np.empty(n, dtype=np.int64)
    v_prev = np.empty(n, dtype=np.int64)
    v_pos = np.empty(n, dtype=np.int64)
    v_tok = np.empty(n, dtype=np.int64)
    if overflow:
        return req_offsets, seeds, w_slots, v_slot, v_prev, v_pos, v_tok, total_v, True, err
    k = 0
    for r in range(nrows):
        if rows[r] == 0:
            continue
        row = rows[r]
        limit = min(truth_lens[r], ncols, truth.shape[1])
        for pos in range(max(0, prefix_lens[r] - window), prefix_lens[r]):
            s, ok = _translate(r2t[row, pos], lut, use_lut)
            p = -1
            ok2 = True
            if pos > 0:
                p, ok2 = _translate(r2t[row, pos - 1], lut, use_lut)
            if not ok or not ok2:
                err[0] = 1
                err[1] = s if not ok else p
                return req_offsets, seeds, w_slots, v_slot, v_prev, v_pos, v_tok, 0, False, err
            if s < 0 or s >= num_slots or p < -1 or p >= num_slots:
                err[0] = 2
                err[1] = s if (s < 0 or s >= num_slots) else p
                return req_offsets, seeds, w_slots, v_slot, v_prev, v_pos, v_tok, 0, False, err
            t = pos + offset
            v_slot[k] = s
            v_prev[k] = p
            v_pos[k] = pos
            v_tok[k] = truth[r, t] if 0 <= t < limit else -1
            k += 1
    return req_offsets, seeds, w_slots, v_slot, v_prev, v_pos, v_tok, total_v, False, err
