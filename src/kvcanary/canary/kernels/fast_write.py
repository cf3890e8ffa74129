"""Numba `write`: one serial chain per request, parallel across requests, then record rows by a
serial replay in plan order (SPEC §5).

Performance (bench/kernels.py): write interleaves up to four requests' chains per task (each
chain is a serial mix3 dependency, so the CPU overlaps them), and without write assert
advances them in lockstep, prefetching only when some chain's slots are scattered; with real-KV
sources each task first folds its requests' entries in a vectorized loop (`fold_slots`) and the
chains store those folds.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, uint64

from kvcanary.canary.kernels._intrinsics import HEAD_HASH_U64, _record, internal, mix3
from kvcanary.canary.kernels.fast_write_lanes import (
    _CHAIN_POSITION_FLAG,
    _chains_in_order,
    _consecutive,
    _lane,
    _lockstep,
    _plain_step,
    _write_bits,
    _write_step,
    fold_slots,
)

_LANES = 4  # independent request chains interleaved per write task (hides mix3 latency)

try:  # numba's intrinsic form: a cacheable call (numba.get_num_threads is not, in njit code)
    from numba.np.ufunc.parallel import _iget_num_threads as _num_threads
except ImportError:  # pragma: no cover - other numba versions

    @njit(cache=True)
    def _num_threads():  # type: ignore[no-untyped-def]
        return 8


@internal
def _write_tasks(nreq):  # type: ignore[no-untyped-def]
    """Tasks for `nreq` requests: four requests' chains per task (task g owns g, g + ntasks, ...),
    but at least one per thread while there are requests to spread."""
    ntasks = (nreq + _LANES - 1) // _LANES
    nthreads = _num_threads()
    if ntasks < nthreads:
        ntasks = min(nreq, nthreads)
    return ntasks


@internal
def _plain_task(  # type: ignore[no-untyped-def]
    buf, seeds, req_offsets, w_slots, input_ids, positions, chain_position, start_hash, start_pos,
    g, ntasks, bad, folds,
):  # fmt: skip
    """Task `g` of `write`'s parallel loop without write assert: sets `bad[r]` for its requests (a
    chain-position violation needs ring rows). Each record's fold is `folds[i]` (computed
    before, `fold_slots`), or 0 when `folds` is empty (no real-KV sources).

    Like `_folded_task`, but while all four lanes have entries left they advance in lockstep with
    no end-of-lane tests (`_lockstep`), prefetching rows only when some lane's slots are not
    consecutive and tracking positions only when some lane checks them.
    """
    nreq = seeds.shape[0]
    last = uint64(max(w_slots.shape[0] - 1, 0))
    r0, r1, r2, r3 = g, g + ntasks, g + 2 * ntasks, g + 3 * ntasks
    i0, e0, run0, pp0, dp0 = _lane(
        r0, nreq, req_offsets, start_hash, start_pos, seeds, chain_position
    )
    i1, e1, run1, pp1, dp1 = _lane(
        r1, nreq, req_offsets, start_hash, start_pos, seeds, chain_position
    )
    i2, e2, run2, pp2, dp2 = _lane(
        r2, nreq, req_offsets, start_hash, start_pos, seeds, chain_position
    )
    i3, e3, run3, pp3, dp3 = _lane(
        r3, nreq, req_offsets, start_hash, start_pos, seeds, chain_position
    )
    steps = min(min(e0 - i0, e1 - i1), min(e2 - i2, e3 - i3))
    b = False
    # The shape test tells LLVM the row stride (4 words), so row stores need no multiply.
    if steps > 0 and buf.shape[1] == 4:
        idx = (uint64(i0), uint64(i1), uint64(i2), uint64(i3))
        run = (run0, run1, run2, run3)
        pp = (pp0, pp1, pp2, pp3)
        dp = (dp0, dp1, dp2, dp3)
        track = dp0 | dp1 | dp2 | dp3
        streamed = (
            _consecutive(w_slots, i0, e0)
            & _consecutive(w_slots, i1, e1)
            & _consecutive(w_slots, i2, e2)
            & _consecutive(w_slots, i3, e3)
        )
        n = uint64(steps)
        # One loop per (prefetch, track) pair: the flags are constants in each.
        if streamed and not track:
            run, pp, b = _lockstep(
                buf, w_slots, input_ids, positions, idx, n, run, pp, dp, last, False, False, folds
            )
        elif streamed:
            run, pp, b = _lockstep(
                buf, w_slots, input_ids, positions, idx, n, run, pp, dp, last, False, True, folds
            )
        elif not track:
            run, pp, b = _lockstep(
                buf, w_slots, input_ids, positions, idx, n, run, pp, dp, last, True, False, folds
            )
        else:
            run, pp, b = _lockstep(
                buf, w_slots, input_ids, positions, idx, n, run, pp, dp, last, True, True, folds
            )
        run0, run1, run2, run3 = run
        pp0, pp1, pp2, pp3 = pp
        i0, i1, i2, i3 = i0 + steps, i1 + steps, i2 + steps, i3 + steps
    b0 = b1 = b2 = b3 = b
    # The lanes' remaining entries, interleaved while several lanes have some.
    while i0 < e0 or i1 < e1 or i2 < e2 or i3 < e3:
        if i0 < e0:
            run0, pp0, x = _plain_step(
                buf, uint64(i0), run0, pp0, dp0, w_slots, input_ids, positions, True,
                last, folds,
            )  # fmt: skip
            b0 |= x
            i0 += 1
        if i1 < e1:
            run1, pp1, x = _plain_step(
                buf, uint64(i1), run1, pp1, dp1, w_slots, input_ids, positions, True,
                last, folds,
            )  # fmt: skip
            b1 |= x
            i1 += 1
        if i2 < e2:
            run2, pp2, x = _plain_step(
                buf, uint64(i2), run2, pp2, dp2, w_slots, input_ids, positions, True,
                last, folds,
            )  # fmt: skip
            b2 |= x
            i2 += 1
        if i3 < e3:
            run3, pp3, x = _plain_step(
                buf, uint64(i3), run3, pp3, dp3, w_slots, input_ids, positions, True,
                last, folds,
            )  # fmt: skip
            b3 |= x
            i3 += 1
    # A lockstep violation is not attributed to its lane: all four replay (rows are the same).
    bad[r0] = b0
    if r1 < nreq:
        bad[r1] = b1
    if r2 < nreq:
        bad[r2] = b2
    if r3 < nreq:
        bad[r3] = b3


@internal
def _folded_task(  # type: ignore[no-untyped-def]
    buf, seeds, req_offsets, w_slots, input_ids, positions, do_assert, exp_tok, exp_pos,
    chain_position, s0, s1, s2, s3, params, count, start_hash, start_pos, g, ntasks, bad,
):  # fmt: skip
    """Task `g` of `write`'s parallel loop (any sources, write assert or not): sets `bad[r]` for its requests
    (whether each needs ring rows)."""
    nreq = seeds.shape[0]
    nw = w_slots.shape[0]
    r0, r1, r2, r3 = g, g + ntasks, g + 2 * ntasks, g + 3 * ntasks
    i0, e0, run0, pp0, dp0 = _lane(
        r0, nreq, req_offsets, start_hash, start_pos, seeds, chain_position
    )
    i1, e1, run1, pp1, dp1 = _lane(
        r1, nreq, req_offsets, start_hash, start_pos, seeds, chain_position
    )
    i2, e2, run2, pp2, dp2 = _lane(
        r2, nreq, req_offsets, start_hash, start_pos, seeds, chain_position
    )
    i3, e3, run3, pp3, dp3 = _lane(
        r3, nreq, req_offsets, start_hash, start_pos, seeds, chain_position
    )
    nb0 = nb1 = nb2 = nb3 = 0
    while i0 < e0 or i1 < e1 or i2 < e2 or i3 < e3:
        if i0 < e0:
            run0, pp0, b0 = _write_step(
                buf, i0, nw, run0, pp0, dp0, w_slots, input_ids, positions, do_assert,
                exp_tok, exp_pos, s0, s1, s2, s3, params, count,
            )  # fmt: skip
            nb0 += b0
            i0 += 1
        if i1 < e1:
            run1, pp1, b1 = _write_step(
                buf, i1, nw, run1, pp1, dp1, w_slots, input_ids, positions, do_assert,
                exp_tok, exp_pos, s0, s1, s2, s3, params, count,
            )  # fmt: skip
            nb1 += b1
            i1 += 1
        if i2 < e2:
            run2, pp2, b2 = _write_step(
                buf, i2, nw, run2, pp2, dp2, w_slots, input_ids, positions, do_assert,
                exp_tok, exp_pos, s0, s1, s2, s3, params, count,
            )  # fmt: skip
            nb2 += b2
            i2 += 1
        if i3 < e3:
            run3, pp3, b3 = _write_step(
                buf, i3, nw, run3, pp3, dp3, w_slots, input_ids, positions, do_assert,
                exp_tok, exp_pos, s0, s1, s2, s3, params, count,
            )  # fmt: skip
            nb3 += b3
            i3 += 1
    bad[r0] = nb0 != 0
    if r1 < nreq:
        bad[r1] = nb1 != 0
    if r2 < nreq:
        bad[r2] = nb2 != 0
    if r3 < nreq:
        bad[r3] = nb3 != 0


@internal
def _chain_starts(buf, seeds):  # type: ignore[no-untyped-def]
    """(start hash, start position) of each request's chain: its seed record's, or the head's.
    Seeds are read before any record of this endpoint is written (snapshot, SPEC §14.1)."""
    nreq = seeds.shape[0]
    # np.empty, not np.zeros: in a parallel function numba runs np.zeros as a parallel loop, and
    # every parallel region is a thread barrier, slow when another process holds a core.
    start_hash = np.empty(nreq, dtype=np.uint64)
    start_pos = np.empty(nreq, dtype=np.int64)
    for r in range(nreq):
        seed = seeds[r]
        if seed >= 1:
            start_hash[r] = mix3(buf[seed, 2], buf[seed, 0], buf[seed, 1])
            start_pos[r] = np.int64(buf[seed, 1])
        else:
            start_hash[r] = HEAD_HASH_U64
            start_pos[r] = 0
    return start_hash, start_pos


@internal
def _task(  # type: ignore[no-untyped-def]
    buf, seeds, req_offsets, w_slots, input_ids, positions, do_assert, exp_tok, exp_pos,
    chain_position, s0, s1, s2, s3, params, count, start_hash, start_pos, g, ntasks, bad, folds,
):  # fmt: skip
    """Task `g` of `ntasks`: without write assert, the folds of its requests' entries (into
    `folds`, sized by `_fold_buffer`), then `_plain_task`; with it, `_folded_task`."""
    if not do_assert:
        if count != 0:
            nreq = seeds.shape[0]
            for r in range(g, nreq, ntasks):  # the task's lanes: g, g + ntasks, ...
                lo, hi = req_offsets[r], req_offsets[r + 1]
                fold_slots(w_slots[lo:hi], folds[lo:hi], s0, s1, s2, s3, params, count)
        _plain_task(
            buf, seeds, req_offsets, w_slots, input_ids, positions, chain_position, start_hash,
            start_pos, g, ntasks, bad, folds,
        )  # fmt: skip
    else:
        _folded_task(
            buf, seeds, req_offsets, w_slots, input_ids, positions, do_assert, exp_tok, exp_pos,
            chain_position, s0, s1, s2, s3, params, count, start_hash, start_pos, g, ntasks, bad,
        )  # fmt: skip


@internal
def _fold_buffer(w_slots, count, do_assert):  # type: ignore[no-untyped-def]
    """The per-entry folds `_task` fills before the chains store them (real-KV sources, no write
    assert), else an empty array (`_plain_step` stores fold 0, `_folded_task` folds in place)."""
    n = w_slots.shape[0] if count != 0 and not do_assert else 0
    return np.empty(n, dtype=np.uint64)


@internal
def _replay_bad(  # type: ignore[no-untyped-def]
    seeds, req_offsets, w_slots, input_ids, positions, do_assert, exp_tok, exp_pos,
    chain_position, start_hash, start_pos, bad, tag, ring, state,
):  # fmt: skip
    """Record the rows of every request flagged in `bad`, replaying its chain (no writes) in
    entry order: the ring gets plan order whatever order the tasks ran in."""
    for r in range(seeds.shape[0]):
        if not bad[r]:
            continue
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


@njit(cache=True, parallel=True)
def write(  # type: ignore[no-untyped-def]
    buf, seeds, req_offsets, w_slots, in_order, input_ids, positions, do_assert, exp_tok,
    exp_pos, chain_position, s0, s1, s2, s3, params, count, tag, ring, state,
):  # fmt: skip
    """Write one serial chain per request (parallel across requests, or in flat order when
    `in_order`, the plan's `shadowed`), then record rows."""
    start_hash, start_pos = _chain_starts(buf, seeds)
    if in_order:
        bad = _chains_in_order(
            buf, req_offsets, w_slots, input_ids, positions, do_assert, exp_tok, exp_pos, seeds,
            chain_position, s0, s1, s2, s3, params, count, start_hash, start_pos,
        )  # fmt: skip
    else:
        # Each task runs up to _LANES requests' chains interleaved, one entry of each in turn:
        # the chains are independent, so the CPU overlaps their mix3 latencies. Task g owns
        # requests g, g + ntasks, ... (no two tasks write one request's rows, nor one slot: a
        # plan that writes a slot twice runs `_chains_in_order` instead). One parallel loop for
        # both task kinds: each costs numba ~2 s to compile, whatever its body.
        nreq = seeds.shape[0]
        bad = np.empty(nreq, dtype=np.bool_)  # every request's entry is set by its task
        folds = _fold_buffer(w_slots, count, do_assert)  # each task fills its requests' entries
        ntasks = _write_tasks(nreq)
        for task in prange(ntasks):
            # numba types the loop index int64, then uint64 in the parallel body it compiles:
            # one type here, or every task helper is compiled twice
            g = np.int64(task)
            _task(
                buf, seeds, req_offsets, w_slots, input_ids, positions, do_assert, exp_tok,
                exp_pos, chain_position, s0, s1, s2, s3, params, count, start_hash, start_pos,
                g, ntasks, bad, folds,
            )  # fmt: skip
    _replay_bad(
        seeds, req_offsets, w_slots, input_ids, positions, do_assert, exp_tok, exp_pos,
        chain_position, start_hash, start_pos, bad, tag, ring, state,
    )  # fmt: skip


@njit(cache=True)
def write_serial(  # type: ignore[no-untyped-def]
    buf, seeds, req_offsets, w_slots, in_order, input_ids, positions, do_assert, exp_tok,
    exp_pos, chain_position, s0, s1, s2, s3, params, count, tag, ring, state,
):  # fmt: skip
    """`write` on the calling thread, byte-equal to it (see `fast_verify.verify_serial`)."""
    start_hash, start_pos = _chain_starts(buf, seeds)
    if in_order:
        bad = _chains_in_order(
            buf, req_offsets, w_slots, input_ids, positions, do_assert, exp_tok, exp_pos, seeds,
            chain_position, s0, s1, s2, s3, params, count, start_hash, start_pos,
        )  # fmt: skip
    else:
        nreq = seeds.shape[0]
        bad = np.empty(nreq, dtype=np.bool_)
        folds = _fold_buffer(w_slots, count, do_assert)
        ntasks = (nreq + _LANES - 1) // _LANES  # four chains per task, interleaved
        for g in range(ntasks):
            _task(
                buf, seeds, req_offsets, w_slots, input_ids, positions, do_assert, exp_tok,
                exp_pos, chain_position, s0, s1, s2, s3, params, count, start_hash, start_pos,
                g, ntasks, bad, folds,
            )  # fmt: skip
    _replay_bad(
        seeds, req_offsets, w_slots, input_ids, positions, do_assert, exp_tok, exp_pos,
        chain_position, start_hash, start_pos, bad, tag, ring, state,
    )  # fmt: skip
