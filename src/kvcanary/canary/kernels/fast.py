"""Numba CPU kernels: plan building, verify, write and the real-KV fold (SPEC §4, §5).

Byte-equal to `kernels.reference` (the tests check it). Buffers are `[num_slots, 4]` u64 word
views of the record buffers; the ring is the `[capacity, 8]` u64 view of the int64 ring, `state[0]` its write index
(numba loses writes through `.view` inside parallel functions, so callers pass the view).
Verify and write are parallel across entries and requests respectively; ring rows are recorded
afterwards by a serial pass in plan order, so the ring is deterministic.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, uint64

_C1 = uint64(0xBF58476D1CE4E5B9)
_C2 = uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = uint64(30), uint64(27), uint64(31)
HEAD_HASH_U64 = uint64(0xDE7FAE23A9A1B716)
_CHAIN_POSITION_FLAG = 64  # internal: the chain-position row of SPEC §5.2 (reported as bit 16)


@njit(cache=True, inline="always")
def splitmix64(x):  # type: ignore[no-untyped-def]
    x ^= x >> _S30
    x *= _C1
    x ^= x >> _S27
    x *= _C2
    x ^= x >> _S31
    return x


@njit(cache=True, inline="always")
def mix3(a, b, c):  # type: ignore[no-untyped-def]
    h = splitmix64(a)
    h = splitmix64(h ^ b)
    return splitmix64(h ^ c)


@njit(cache=True, inline="always")
def _fold_one(words, page_size, per_token, nread, slot):  # type: ignore[no-untyped-def]
    row = slot // page_size
    col = (slot % page_size) * per_token
    acc = uint64(0)
    for w in range(nread):
        acc = splitmix64(acc ^ words[row, col + w])
    return acc


@njit(cache=True, inline="always")
def fold_sources(s0, s1, s2, s3, params, count, slot):  # type: ignore[no-untyped-def]
    acc = uint64(0)
    if count > 0:
        acc = splitmix64(acc ^ _fold_one(s0, params[0, 0], params[0, 1], params[0, 2], slot))
    if count > 1:
        acc = splitmix64(acc ^ _fold_one(s1, params[1, 0], params[1, 1], params[1, 2], slot))
    if count > 2:
        acc = splitmix64(acc ^ _fold_one(s2, params[2, 0], params[2, 1], params[2, 2], slot))
    if count > 3:
        acc = splitmix64(acc ^ _fold_one(s3, params[3, 0], params[3, 1], params[3, 2], slot))
    return acc


@njit(cache=True, inline="always")
def _record(ring, state, c0, c1, c2, c3, c4, c5, c6, c7):  # type: ignore[no-untyped-def]
    """Fill-once ring append: take seq = write index, bump it, store only below capacity."""
    seq = state[0]
    state[0] = seq + 1
    if seq < ring.shape[0]:
        ring[seq, 0] = uint64(c0)
        ring[seq, 1] = uint64(c1)
        ring[seq, 2] = uint64(c2)
        ring[seq, 3] = uint64(c3)
        ring[seq, 4] = uint64(c4)
        ring[seq, 5] = uint64(c5)
        ring[seq, 6] = uint64(c6)
        ring[seq, 7] = uint64(c7)


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


@njit(cache=True, inline="always")
def _verify_one(buf, slot, prev, exp_pos, exp_tok, s0, s1, s2, s3, params, count):  # type: ignore[no-untyped-def]
    """Returns (bits, expected_chain) for one verify entry (slot != 0)."""
    reachable = prev != 0
    if not reachable:
        exp_chain = buf[slot, 2]
    elif prev == -1:
        exp_chain = HEAD_HASH_U64
    else:
        exp_chain = mix3(buf[prev, 2], buf[prev, 0], buf[prev, 1])
    bits = 0
    if reachable and buf[slot, 2] != exp_chain:
        bits |= 1
    if buf[slot, 1] != uint64(exp_pos):
        bits |= 2
    if buf[slot, 3] != fold_sources(s0, s1, s2, s3, params, count, slot):
        bits |= 4
    if exp_tok != -1 and buf[slot, 0] != uint64(exp_tok):
        bits |= 32
    return bits, exp_chain


@njit(cache=True, parallel=True)
def verify(  # type: ignore[no-untyped-def]
    buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count, tag, ring, state,
):  # fmt: skip
    """Verify every entry against `buf` (read-only); record violations in plan order."""
    n = v_slot.shape[0]
    bad = 0
    for i in prange(n):
        slot = v_slot[i]
        if slot != 0:
            bits, _ = _verify_one(
                buf, slot, v_prev[i], v_pos[i], v_tok[i], s0, s1, s2, s3, params, count
            )
            if bits != 0:
                bad += 1
    if bad == 0:
        return
    for i in range(n):
        slot = v_slot[i]
        if slot == 0:
            continue
        bits, exp_chain = _verify_one(
            buf, slot, v_prev[i], v_pos[i], v_tok[i], s0, s1, s2, s3, params, count
        )
        if bits != 0:
            rec = buf[slot]
            _record(ring, state, tag, slot, rec[1], rec[0], v_tok[i], rec[2], exp_chain, bits)


@njit(cache=True, inline="always")
def _write_bits(tok, pos, i, do_assert, exp_tok, exp_pos, do_pos, prev_pos):  # type: ignore[no-untyped-def]
    bits = 0
    if do_assert:
        if tok != exp_tok[i]:
            bits |= 8
        if pos != exp_pos[i]:
            bits |= 16
    if do_pos and pos != prev_pos + 1:
        bits |= _CHAIN_POSITION_FLAG
    return bits


@njit(cache=True, parallel=True)
def write(  # type: ignore[no-untyped-def]
    buf, seeds, req_offsets, w_slots, input_ids, positions, do_assert, exp_tok, exp_pos,
    chain_position, s0, s1, s2, s3, params, count, tag, ring, state,
):  # fmt: skip
    """Write one serial chain per request (parallel across requests), then record rows."""
    nreq = seeds.shape[0]
    start_hash = np.empty(nreq, dtype=np.uint64)
    start_pos = np.zeros(nreq, dtype=np.int64)
    # Seeds are read before any record of this endpoint is written.
    for r in range(nreq):
        seed = seeds[r]
        if seed >= 1:
            start_hash[r] = mix3(buf[seed, 2], buf[seed, 0], buf[seed, 1])
            start_pos[r] = np.int64(buf[seed, 1])
        else:
            start_hash[r] = HEAD_HASH_U64
    bad = np.zeros(nreq, dtype=np.int64)
    for r in prange(nreq):
        running = start_hash[r]
        do_pos = chain_position and seeds[r] >= 1
        prev_pos = start_pos[r]
        nbad = 0
        for i in range(req_offsets[r], req_offsets[r + 1]):
            slot = w_slots[i]
            if slot < 0:
                continue
            tok = input_ids[i]
            pos = positions[i]
            if _write_bits(tok, pos, i, do_assert, exp_tok, exp_pos, do_pos, prev_pos) != 0:
                nbad += 1
            prev_pos = pos
            buf[slot, 0] = uint64(tok)
            buf[slot, 1] = uint64(pos)
            buf[slot, 2] = running
            buf[slot, 3] = fold_sources(s0, s1, s2, s3, params, count, slot)
            running = mix3(running, uint64(tok), uint64(pos))
        bad[r] = nbad
    for r in range(nreq):
        if bad[r] == 0:
            continue
        # Replay the chain (no writes) to record this request's rows in entry order.
        running = start_hash[r]
        do_pos = chain_position and seeds[r] >= 1
        prev_pos = start_pos[r]
        for i in range(req_offsets[r], req_offsets[r + 1]):
            slot = w_slots[i]
            if slot < 0:
                continue
            tok = input_ids[i]
            pos = positions[i]
            bits = _write_bits(tok, pos, i, do_assert, exp_tok, exp_pos, do_pos, prev_pos)
            if bits & 24:
                _record(
                    ring, state, tag, slot, pos, tok, exp_tok[i], running, exp_pos[i], bits & 24
                )
            if bits & _CHAIN_POSITION_FLAG:
                _record(ring, state, tag, slot, pos, tok, tok, running, prev_pos + 1, 16)
            prev_pos = pos
            running = mix3(running, uint64(tok), uint64(pos))
