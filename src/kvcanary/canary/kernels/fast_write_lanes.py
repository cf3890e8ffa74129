"""Per-entry steps of `fast_write`'s request chains: one entry's row write (`_write_step`,
`_plain_step`), a lane's start (`_lane`), its violation bits (`_write_bits`), four lanes
advanced in lockstep (`_lockstep`), every chain in flat order on one thread
(`_chains_in_order`, for a plan that writes some slot twice) and the real-KV folds of a run of
write entries, computed before the chains (`fold_slots`).

Each chain is a serial mix3 dependency, so `fast_write` interleaves four lanes per task and the
CPU overlaps their mix3 latencies; rows are prefetched `_PREFETCH_AHEAD` entries ahead only when
the slots are scattered (the hardware streams consecutive rows). A record's fold does not depend
on its chain, so the folds are computed first, in a loop LLVM vectorizes (`_fold_lanes`), and
the chains then store them: folded inside each chain step, four sources are twelve serial
splitmix64 rounds an entry, and a vLLM prefill TAIL (two chains of 256 entries) took ~50 us.
"""

from __future__ import annotations

import numpy as np
from numba import uint64

from kvcanary.canary.kernels._intrinsics import (
    _PREFETCH_AHEAD,
    _prefetch_write,
    fold_sources,
    internal,
    mix3,
    splitmix64,
    wide_vectors,
)
from kvcanary.canary.kernels.fast_verify import _NONNEG, _pair_at

_CHAIN_POSITION_FLAG = 64  # internal: the chain-position row of SPEC §5.2 (reported as bit 16)


@internal
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


@internal
def _lane(r, nreq, req_offsets, start_hash, start_pos, seeds, chain_position):  # type: ignore[no-untyped-def]
    """(first entry, end entry, running hash, previous position, do_pos) of request `r`'s lane."""
    if r >= nreq:
        return 0, 0, uint64(0), 0, False
    do_pos = chain_position and seeds[r] >= 1
    return req_offsets[r], req_offsets[r + 1], start_hash[r], start_pos[r], do_pos


@internal  # a call, not IR-inlined: see compile_cache
def _write_step(  # type: ignore[no-untyped-def]
    buf, i, nw, running, prev_pos, do_pos, w_slots, input_ids, positions, do_assert, exp_tok,
    exp_pos, s0, s1, s2, s3, params, count,
):  # fmt: skip
    """Write entry `i` of a chain; returns (running, prev_pos, 1 if it needs a ring row else 0)."""
    if i + _PREFETCH_AHEAD < nw:
        _prefetch_write(buf, w_slots[i + _PREFETCH_AHEAD])
    slot = w_slots[i]
    if slot < 0:
        return running, prev_pos, 0
    tok = input_ids[i]
    pos = positions[i]
    bad = 0
    if _write_bits(tok, pos, i, do_assert, exp_tok, exp_pos, do_pos, prev_pos) != 0:
        bad = 1
    buf[slot, 0] = uint64(tok)
    buf[slot, 1] = uint64(pos)
    buf[slot, 2] = running
    buf[slot, 3] = fold_sources(s0, s1, s2, s3, params, count, slot)
    return mix3(running, uint64(tok), uint64(pos)), pos, bad


@internal  # a call, not IR-inlined: see compile_cache
def _plain_step(  # type: ignore[no-untyped-def]
    buf, i, running, prev_pos, do_pos, w_slots, input_ids, positions, prefetch, last, folds,
):  # fmt: skip
    """`_write_step` without write assert, its fold taken from `folds[i]` (`fold_slots`; an empty
    `folds`: no real-KV sources, fold 0): returns (running, prev_pos, True if the entry needs a
    ring row). `i` and `last` (the last entry) are unsigned, so numba indexes without
    negative-index wraparound."""
    if prefetch:
        _prefetch_write(buf, w_slots[min(i + uint64(_PREFETCH_AHEAD), last)])
    slot = w_slots[i]
    if slot < 0:
        return running, prev_pos, False
    tok = input_ids[i]
    pos = positions[i]
    buf[slot, 0] = uint64(tok)
    buf[slot, 1] = uint64(pos)
    buf[slot, 2] = running
    buf[slot, 3] = folds[i] if folds.shape[0] != 0 else uint64(0)
    return mix3(running, uint64(tok), uint64(pos)), pos, do_pos & (pos != prev_pos + 1)


@internal
def _consecutive(w_slots, lo, hi):  # type: ignore[no-untyped-def]
    """True when `w_slots[lo:hi]` are consecutive slots (the hardware streams such rows)."""
    seg = w_slots[lo:hi]
    ok = True
    for k in range(seg.shape[0]):
        ok &= seg[k] == seg[0] + k
    return ok


@internal
def _lockstep(  # type: ignore[no-untyped-def]
    buf, w_slots, input_ids, positions, idx, steps, run, pp, dp, last, prefetch, track, folds,
):  # fmt: skip
    """`steps` entries of each of four lanes, one of each in turn, with no end-of-lane tests.

    `idx`, `run`, `pp`, `dp` are the lanes' (unsigned) next entries, running hashes, previous
    positions and do_pos flags. `prefetch` and `track` are constants at each call site, so each
    call compiles to its own loop: without prefetch (the lanes' slots are consecutive) and without
    position tracking (no lane checks chain positions) a step is just the four mix3 chains and
    their row stores (`folds` as in `_plain_step`). Returns the lanes' (run, pp) and whether
    any entry needs a ring row.
    """
    i0, i1, i2, i3 = idx
    r0, r1, r2, r3 = run
    p0, p1, p2, p3 = pp
    d0, d1, d2, d3 = dp
    if not track:
        d0 = d1 = d2 = d3 = False
    bad = False
    for t in range(steps):
        j0, j1, j2, j3 = i0 + t, i1 + t, i2 + t, i3 + t
        r0, q0, b0 = _plain_step(
            buf, j0, r0, p0, d0, w_slots, input_ids, positions, prefetch, last, folds
        )
        r1, q1, b1 = _plain_step(
            buf, j1, r1, p1, d1, w_slots, input_ids, positions, prefetch, last, folds
        )
        r2, q2, b2 = _plain_step(
            buf, j2, r2, p2, d2, w_slots, input_ids, positions, prefetch, last, folds
        )
        r3, q3, b3 = _plain_step(
            buf, j3, r3, p3, d3, w_slots, input_ids, positions, prefetch, last, folds
        )
        if track:
            p0, p1, p2, p3 = q0, q1, q2, q3
            bad |= b0 | b1 | b2 | b3
    return (r0, r1, r2, r3), (p0, p1, p2, p3), bad


@internal
def _chains_in_order(  # type: ignore[no-untyped-def]
    buf, req_offsets, w_slots, input_ids, positions, do_assert, exp_tok, exp_pos, seeds,
    chain_position, s0, s1, s2, s3, params, count, start_hash, start_pos,
):  # fmt: skip
    """Every request's chain on this thread, in flat order (SPEC §14.1): when two entries name
    one slot the later entry's record remains, as in `kernels.reference`. Used when the plan says
    some slot is written twice (the double-allocation bug class), where the parallel chains
    would race; returns per request whether it needs ring rows."""
    nreq = seeds.shape[0]
    nw = w_slots.shape[0]
    bad = np.empty(nreq, dtype=np.bool_)
    for r in range(nreq):
        i, e, running, prev_pos, do_pos = _lane(
            r, nreq, req_offsets, start_hash, start_pos, seeds, chain_position
        )
        nb = 0
        while i < e:
            running, prev_pos, b = _write_step(
                buf, i, nw, running, prev_pos, do_pos, w_slots, input_ids, positions, do_assert,
                exp_tok, exp_pos, s0, s1, s2, s3, params, count,
            )  # fmt: skip
            nb += b
            i += 1
        bad[r] = nb != 0
    return bad


@internal
def _fold_lanes(slots, out, s0, s1, s2, s3, count, page, shift, w0, w1, w2, w3):  # type: ignore[no-untyped-def]
    """`out[k] = fold_uniform(..., slots[k])` (slot -1 folds as slot 0): one branch-free loop
    LLVM vectorizes with gathers, as `fast_verify._folded_lanes` (`count` a literal).

    The fold is written out here as there, on purpose: the two loops shared a helper for it
    once, and LLVM then kept the verify's loop scalar (a 4608-entry folded verify 53-60 ->
    76-80 us); each loop must be one flat body for the vectorizer."""
    wide_vectors()
    mask = page - 1
    for k in range(slots.shape[0]):
        s = max(slots[k], 0)
        row = (s >> shift) & _NONNEG
        lo = s & mask
        fold = splitmix64(_pair_at(s0, row, (lo * w0) & _NONNEG))
        if count > 1:
            fold = splitmix64(fold ^ _pair_at(s1, row, (lo * w1) & _NONNEG))
        if count > 2:
            fold = splitmix64(fold ^ _pair_at(s2, row, (lo * w2) & _NONNEG))
        if count > 3:
            fold = splitmix64(fold ^ _pair_at(s3, row, (lo * w3) & _NONNEG))
        out[k] = fold


@internal
def fold_slots(slots, out, s0, s1, s2, s3, params, count):  # type: ignore[no-untyped-def]
    """`out[k] = fold_sources(..., slots[k])` for each write entry of a run (`count > 0`; an
    entry that writes nothing, slot -1, gets a value no record stores). One page geometry
    (`params[0, 4]`): `_fold_lanes` with `count` as a literal; otherwise entry by entry (each
    fold independent of the last, so the CPU overlaps them)."""
    if params[0, 4] != 0:
        page, shift = params[0, 0], params[0, 3]
        w0, w1, w2, w3 = params[0, 1], params[1, 1], params[2, 1], params[3, 1]
        if count == 4:
            _fold_lanes(slots, out, s0, s1, s2, s3, 4, page, shift, w0, w1, w2, w3)
        elif count == 3:
            _fold_lanes(slots, out, s0, s1, s2, s3, 3, page, shift, w0, w1, w2, w3)
        elif count == 2:
            _fold_lanes(slots, out, s0, s1, s2, s3, 2, page, shift, w0, w1, w2, w3)
        else:
            _fold_lanes(slots, out, s0, s1, s2, s3, 1, page, shift, w0, w1, w2, w3)
        return
    for k in range(slots.shape[0]):
        out[k] = fold_sources(s0, s1, s2, s3, params, count, max(slots[k], 0))
