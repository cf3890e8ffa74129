"""Plain-Python reference kernels: the executable reading of SPEC §4-§5.

Same signatures and results as `kernels.fast`, byte for byte; slow, and meant to be read.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvcanary.canary.config import VERIFY_STRIDE_SPAN
from kvcanary.canary.hashing import HEAD_HASH, MASK64, mix3, splitmix64

Arr = npt.NDArray[Any]


def _u(x: Any) -> int:
    return int(x) & MASK64


def fold_sources(s0: Arr, s1: Arr, s2: Arr, s3: Arr, params: Arr, count: int, slot: int) -> int:
    """acc = splitmix64(acc ^ fold_one(src, slot)) over the sources in order; 0 with none."""
    acc = 0
    for words, (page_size, per_token, nread) in list(
        zip((s0, s1, s2, s3), params[:, :3], strict=False)
    )[:count]:
        row, col = slot // int(page_size), (slot % int(page_size)) * int(per_token)
        one = 0
        for w in range(int(nread)):
            one = splitmix64(one ^ _u(words[row, col + w]))
        acc = splitmix64(acc ^ one)
    return acc


def _record(ring: Arr, state: Arr, *cols: Any) -> None:
    seq = int(state[0])
    state[0] = seq + 1
    if seq < ring.shape[0]:
        ring[seq] = [_u(c) for c in cols]


def _translate(
    x: Any, lut: Arr, use_lut: bool, num_slots: int, allow_none: bool
) -> tuple[int, int]:
    """(T(x), error kind): SWA translation, then the group's range check (SPEC §2.3, §14.2).

    -1 is the "no slot" sentinel (kind 2 unless `allow_none`); a LUT index outside the LUT is
    kind 1; any other value outside `[0, num_slots)`, a LUT value included, kind 2.
    """
    x = int(x)
    if x == -1:
        return x, 0 if allow_none else 2
    if use_lut:
        if not 0 <= x < len(lut):
            return x, 1
        x = int(lut[x])
    return x, 0 if 0 <= x < num_slots else 2


def verified(pos: int, stride: int, phase: int) -> bool:
    """Whether phase `phase` of a verify stride `stride` verifies position `pos`: positions go
    in units of `VERIFY_STRIDE_SPAN`, and unit `u` is verified in phase `u % stride`, so each
    unit is verified once in any `stride` consecutive phases. The rule reads the position only
    (not the request's row, which an engine may reassign between steps), so the bound holds
    whatever the batch does. Stride 1 verifies every position (SPEC §5.1)."""
    return stride == 1 or (pos // VERIFY_STRIDE_SPAN) % stride == phase


def build_plan(
    rows: Arr, prefix_lens: Arr, extend_lens: Arr, r2t: Arr, out_slots: Arr, lut: Arr,
    use_lut: bool, window: int, num_slots: int, truth: Arr, truth_lens: Arr, offset: int,
    verify_capacity: int, marks: Arr, stride: int, phase: int,
) -> tuple[Any, ...]:  # fmt: skip
    """Build one group's plan (SPEC §5.1) and range-check every slot in it (SPEC §14.2).

    With a verify stride (`stride > 1`, `0 <= phase < stride`) the verify plan holds only the
    positions `verified` in `phase`; every attended slot is still range-checked, in the same
    order, so the errors do not depend on the stride.

    Returns `(req_offsets, seeds, w_slots, v_slot, v_prev, v_pos, v_tok, verify_total, overflow,
    err, shadowed)`. `err = (kind, value)`: kind 1 is a SWA index outside the LUT, 2 a slot (or
    LUT value) outside the group, 3 an active row (value = batch index, or -1 when the flat
    arrays are too short) outside `req_to_token` or with a negative prefix; 0 means no error,
    and on error the arrays are unspecified. Checked in order: rows, seeds, write slots, then
    verify entries (slot, then prev), each in plan order. `shadowed` is True when two write
    entries name one slot, so the writes must be applied in flat order (SPEC §14.1). `marks` is
    the fast kernel's scratch array (unused here).
    """
    del marks
    i64 = np.int64
    nrows, ncols = len(rows), r2t.shape[1]
    wl = [max(int(extend_lens[r]), 0) if rows[r] != 0 else 0 for r in range(nrows)]
    req_offsets = np.concatenate([[0], np.cumsum(wl, dtype=i64)]).astype(i64)
    seeds = np.full(nrows, -1, dtype=i64)
    empty = np.empty(0, dtype=i64)

    def fail(kind: int, value: int) -> tuple[Any, ...]:
        return (req_offsets, seeds, empty, empty, empty, empty, empty, 0, False,
                np.array([kind, value]), False)  # fmt: skip

    for r in range(nrows):
        row, prefix = int(rows[r]), int(prefix_lens[r])
        if row != 0 and (not 0 <= row < r2t.shape[0] or prefix < 0 or prefix + wl[r] > ncols):
            return fail(3, r)
    if sum(wl) > len(out_slots):
        return fail(3, -1)
    total_v = 0
    for r in range(nrows):
        row, prefix = int(rows[r]), int(prefix_lens[r])
        if row == 0:
            continue
        if prefix > 0 and wl[r] > 0:
            seed, kind = _translate(r2t[row, prefix - 1], lut, use_lut, num_slots, True)
            if kind:
                return fail(kind, seed)
            seeds[r] = -1 if seed == 0 else seed
        total_v += sum(verified(p, stride, phase) for p in range(max(0, prefix - window), prefix))
    w_slots = np.empty(int(req_offsets[-1]), dtype=i64)
    for i in range(len(w_slots)):
        slot, kind = _translate(out_slots[i], lut, use_lut, num_slots, True)
        if kind:
            return fail(kind, slot)
        w_slots[i] = slot
    written = [int(s) for s in w_slots if s >= 0]
    shadowed = len(set(written)) != len(written)
    if total_v > verify_capacity:
        return (req_offsets, seeds, w_slots, empty, empty, empty, empty, total_v, True,
                np.zeros(2), shadowed)  # fmt: skip
    entries: list[tuple[int, int, int, int]] = []
    for r in range(nrows):
        row, prefix = int(rows[r]), int(prefix_lens[r])
        if row == 0:
            continue
        limit = min(int(truth_lens[r]), ncols, truth.shape[1]) if r < truth.shape[0] else 0
        for pos in range(max(0, prefix - window), prefix):
            slot, kind = _translate(r2t[row, pos], lut, use_lut, num_slots, False)
            if kind:
                return fail(kind, slot)
            prev = -1
            if pos > 0:
                prev, kind = _translate(r2t[row, pos - 1], lut, use_lut, num_slots, True)
                if kind:
                    return fail(kind, prev)
            if not verified(pos, stride, phase):
                continue
            t = pos + offset
            entries.append((slot, prev, pos, int(truth[r, t]) if 0 <= t < limit else -1))
    cols = np.array(entries, dtype=i64).reshape(-1, 4).T
    return (req_offsets, seeds, w_slots, *(c.copy() for c in cols), total_v, False, np.zeros(2),
            shadowed)  # fmt: skip


def _row(buf: Arr, slot: int) -> Arr:
    """Record row `slot`, refusing what NumPy would wrap or a numba kernel would read out of
    bounds: the plan's range checks (SPEC §14.2) guarantee it never happens, and the property
    tests rely on this kernel to fail loudly if it does."""
    if not 0 <= slot < buf.shape[0]:
        raise IndexError(f"reference kernel: slot {slot} outside a buffer of {buf.shape[0]} rows")
    row: Arr = buf[slot]
    return row


def slot_hash(buf: Arr, slot: int) -> int:
    """mix3(PREV_HASH, TOKEN, POSITION) of `slot`'s record; HEAD_HASH for -1."""
    if slot == -1:
        return HEAD_HASH
    token, position, prev_hash = (_u(x) for x in _row(buf, slot)[:3])
    return mix3(prev_hash, token, position)


def verify(
    buf: Arr, v_slot: Arr, v_prev: Arr, v_pos: Arr, v_tok: Arr, s0: Arr, s1: Arr, s2: Arr,
    s3: Arr, params: Arr, count: int, tag: int, ring: Arr, state: Arr,
) -> None:  # fmt: skip
    """Verify each entry (SPEC §5.3); read-only on `buf`."""
    for slot, prev, exp_pos, exp_tok in zip(
        v_slot.tolist(), v_prev.tolist(), v_pos.tolist(), v_tok.tolist(), strict=False
    ):
        if slot == 0:
            continue  # reserved or evicted: counted, never checked
        token, position, prev_hash, real_kv = (_u(x) for x in _row(buf, slot))
        reachable = prev != 0
        exp_chain = slot_hash(buf, prev) if reachable else prev_hash
        bits = 1 if reachable and prev_hash != exp_chain else 0
        bits |= 2 if position != _u(exp_pos) else 0
        bits |= 4 if real_kv != fold_sources(s0, s1, s2, s3, params, count, slot) else 0
        bits |= 32 if exp_tok != -1 and token != _u(exp_tok) else 0
        if bits:
            _record(ring, state, tag, slot, position, token, exp_tok, prev_hash, exp_chain, bits)


def write(
    buf: Arr, seeds: Arr, req_offsets: Arr, w_slots: Arr, in_order: bool, input_ids: Arr,
    positions: Arr, do_assert: bool, exp_tok: Arr, exp_pos: Arr, chain_position: bool, s0: Arr,
    s1: Arr, s2: Arr, s3: Arr, params: Arr, count: int, tag: int, ring: Arr, state: Arr,
) -> None:  # fmt: skip
    """Write one serial chain per request (SPEC §5.2, §14.1): every seed is read before any
    write, and entries are applied in flat order, so when two entries name one slot the later
    one's record remains. This kernel is always in flat order; `in_order` (the plan's
    `shadowed`) tells the fast kernel to be."""
    del in_order
    words = buf.view(np.uint64)
    starts = [
        (slot_hash(buf, int(seed)), _signed(_row(buf, int(seed))[1]))
        if seed >= 1
        else (HEAD_HASH, 0)
        for seed in seeds
    ]
    for r, (running, prev_pos) in enumerate(starts):
        do_pos = chain_position and seeds[r] >= 1
        for i in range(int(req_offsets[r]), int(req_offsets[r + 1])):
            slot = int(w_slots[i])
            if slot < 0:
                continue  # no write, no advance, not counted
            tok, pos = int(input_ids[i]), int(positions[i])
            if do_assert:
                bits = (8 if tok != exp_tok[i] else 0) | (16 if pos != exp_pos[i] else 0)
                if bits:
                    _record(ring, state, tag, slot, pos, tok, exp_tok[i], running, exp_pos[i], bits)
            if do_pos:
                expected = _signed(prev_pos + 1)  # int64 arithmetic, as the fast kernel's
                if pos != expected:
                    _record(ring, state, tag, slot, pos, tok, tok, running, expected, 16)
                prev_pos = pos
            fold = fold_sources(s0, s1, s2, s3, params, count, slot)
            _row(words, slot)[:] = [_u(tok), _u(pos), running, fold]
            running = mix3(running, tok, pos)


def build_plan_packed(*args: Any) -> tuple[Any, ...]:
    """`build_plan` in the fast module's packed layout (`fast_plan.build_plan_packed`)."""
    req_offsets, seeds, w_slots, v_slot, v_prev, v_pos, v_tok, total_v, overflow, err, shadowed = (
        build_plan(*args)
    )
    buf = np.concatenate([np.asarray(a, dtype=np.int64) for a in
                          (req_offsets, seeds, w_slots, v_slot, v_prev, v_pos, v_tok)])  # fmt: skip
    writes = int((np.asarray(w_slots) >= 0).sum())
    return (buf, len(seeds), len(w_slots), len(v_slot), int(total_v), bool(overflow),
            int(err[0]), int(err[1]), bool(shadowed), writes)  # fmt: skip


def _signed(x: Any) -> int:
    v = _u(x)
    return v - (1 << 64) if v >> 63 else v


#: the fast module's one-thread twins; the reference is single-threaded already
verify_serial = verify
write_serial = write


def stage_serial(
    buf: Arr, v_slot: Arr, v_prev: Arr, v_pos: Arr, v_tok: Arr, do_verify: bool, seeds: Arr,
    req_offsets: Arr, w_slots: Arr, in_order: bool, input_ids: Arr, positions: Arr,
    do_assert: bool, exp_tok: Arr, exp_pos: Arr, chain_position: bool, s0: Arr, s1: Arr, s2: Arr,
    s3: Arr, params: Arr, count: int, tag: int, ring: Arr, state: Arr,
) -> int:  # fmt: skip
    """`verify` (when `do_verify`) then `write`; returns the ring's write index after the
    verify (the fast module fuses the two into one call)."""
    if do_verify:
        verify(buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count, tag, ring, state)
    verified = int(state[0])
    write(buf, seeds, req_offsets, w_slots, in_order, input_ids, positions, do_assert, exp_tok,
          exp_pos, chain_position, s0, s1, s2, s3, params, count, tag, ring, state)  # fmt: skip
    return verified
