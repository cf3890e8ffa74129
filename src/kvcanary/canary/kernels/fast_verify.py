"""Numba `verify`: check every verify entry against the record buffer, in parallel across
entries, then record violations in plan order by a serial pass (SPEC §5).

Performance (bench/kernels.py): verify prefetches record rows ahead (random slot orders are
otherwise DRAM-latency bound). Without real-KV sources, runs of consecutive slots are checked by a
vectorized loop with unit-stride row loads and other entries by a vectorized loop with gathers
(random verify 2.4-2.7x -> 2.0-2.2x its floor, 2 threads), with 512-bit vectors where the CPU
has AVX-512 (`wide_vectors`: 2.3x -> 1.8x on an Emerald Rapids). With sources of one page geometry
(the common case) a vectorized loop with gathers folds them (64-bit multiplies in vector units:
a vLLM decode TAIL verify, 1008 entries over four sources, 65 -> ~10 us); with sources of
several geometries, four entries per step in branch-free code, so their chains overlap.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, uint64
from numba.extending import overload

from kvcanary.canary.kernels._intrinsics import (
    _PREFETCH_AHEAD,
    HEAD_HASH_U64,
    _prefetch_read,
    _record,
    fold_sources,
    internal,
    mix3,
    prefetch_sources,
    prefetch_uniform,
    splitmix64,
    wide_vectors,
)

_FOLD_AHEAD = 32  # entries: real-KV tiles are requested this far ahead of their fold

_CHUNK = 256  # verify entries per chunk (a consecutive chunk is checked vectorized)


@internal
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


@internal
def _prefetch_entry(buf, slots, j, n):  # type: ignore[no-untyped-def]
    """Prefetch row `slots[j]` unless it follows `slots[j - 1]` (the hardware streams those).

    A verify entry's `prev` is the previous entry's slot along a chain, so it is not prefetched.
    """
    if j < n:
        s = slots[j]
        if s - slots[j - 1] != 1:
            _prefetch_read(buf, s)


@internal
def _entry_ok(buf, slot, prev, exp_pos, exp_tok, fold):  # type: ignore[no-untyped-def]
    """True when verify entry (slot != 0) has no violation bit; see `_verify_one`."""
    chain = buf[slot, 2]
    if prev == 0:
        chain_ok = True
    elif prev == -1:
        chain_ok = chain == HEAD_HASH_U64
    else:
        chain_ok = chain == mix3(buf[prev, 2], buf[prev, 0], buf[prev, 1])
    return (
        chain_ok
        & (buf[slot, 1] == uint64(exp_pos))
        & (buf[slot, 3] == fold)
        & ((exp_tok == -1) | (buf[slot, 0] == uint64(exp_tok)))
    )


@internal
def _chain_input(buf, slot, prev):  # type: ignore[no-untyped-def]
    """The row whose hash an entry's chain is checked against: `prev`, or (when prev is 0 or -1
    and the hash is unused) the entry's own row, so that loads and mix3 need no branch."""
    return slot if (prev == 0) | (prev == -1) else prev


@internal
def _entry_bad(buf, slot, prev, exp_pos, exp_tok, hashed, fold):  # type: ignore[no-untyped-def]
    """1 when entry has a violation bit, else 0; slot 0 is never bad. `hashed` is mix3 of row
    `_chain_input(buf, slot, prev)`, `fold` the entry's real-KV fold (0 without sources). Same
    bits as `_verify_one`, without branches."""
    exp_chain = HEAD_HASH_U64 if prev == -1 else hashed
    ok = (
        ((prev == 0) | (buf[slot, 2] == exp_chain))
        & (buf[slot, 1] == uint64(exp_pos))
        & (buf[slot, 3] == fold)
        & ((exp_tok == -1) | (buf[slot, 0] == uint64(exp_tok)))
    )
    return 0 if ok | (slot == 0) else 1


def _flat_rows(buf):  # type: ignore[no-untyped-def]
    """`buf` (a `[n, 4]` record buffer) as one flat array: word `c` of row `r` at `4 * r + c`."""
    raise NotImplementedError  # compiled only, through the overload below


@overload(_flat_rows)
def _flat_rows_impl(buf):  # type: ignore[no-untyped-def]
    if buf.layout == "C":  # the canary's own buffers: a view, and constant-stride gathers
        return lambda buf: buf.reshape(-1)
    # any other layout (a caller's strided view): a contiguous copy, read-only use
    return lambda buf: np.ascontiguousarray(buf).reshape(-1)


@internal
def _plain_run(buf, v_slot, v_prev, v_pos, v_tok, lo, hi):  # type: ignore[no-untyped-def]
    """0 when entries `lo:hi` are all clean, their slots run consecutively from `v_slot[lo]` and
    each prev is 0, -1 or the slot before; else the number of entries that are bad or break
    that assumption (the caller then counts the chunk again by `_plain_lanes`: a violation, or a
    chunk that is not a run, takes the slower path; a clean run never does).

    Rows are then contiguous and each entry's chain input is the row just before its own, so this
    loop needs no per-entry select of the chain row, no prefetch test and no slot-0 test; it is
    branch-free and LLVM vectorizes it (mix3 in AVX2/AVX-512 lanes). Two things keep its loads
    unit-stride rather than gathers: the plan arrays are sliced to `lo:hi` and indexed by the
    (provably non-negative) loop counter, so numba emits no negative-index wraparound; and the
    `shape[1] == 4` test tells LLVM the row stride, so it loads the 32-byte rows whole and
    shuffles the words apart (it cannot know a numba array's inner extent otherwise). One count
    for both tests: a second accumulator cost ~5 % of the loop (bench/kernels.py, sequential).
    Reads only rows `v_slot[lo] - 1 .. v_slot[hi - 1]`, which the caller checks are in `buf`.
    """
    wide_vectors()
    if buf.shape[1] != 4:
        return 1  # not a record buffer layout this loop is written for: checked per entry
    first = v_slot[lo]
    rows = buf[first - 1 : first + hi - lo]
    slots, prevs, poss, toks = v_slot[lo:hi], v_prev[lo:hi], v_pos[lo:hi], v_tok[lo:hi]
    nb = 0
    for k in range(hi - lo):
        p = prevs[k]
        t = toks[k]
        h = mix3(rows[k, 2], rows[k, 0], rows[k, 1])
        exp_chain = HEAD_HASH_U64 if p == -1 else h
        slot = first + k
        ok = (
            ((p == 0) | (rows[k + 1, 2] == exp_chain))
            & (rows[k + 1, 1] == uint64(poss[k]))
            & (rows[k + 1, 3] == uint64(0))
            & ((t == -1) | (rows[k + 1, 0] == uint64(t)))
            & (slots[k] == slot)
            & ((p == 0) | (p == -1) | (p == slot - 1))
        )
        nb += 0 if ok else 1
    return nb


@internal
def _row_and_chain(flat, s, p):  # type: ignore[no-untyped-def]
    """(word index of row `s` in `flat`, the chain hash entry (s, p) must hold): mix3 of its
    chain input row (`_chain_input`), HEAD_HASH for p == -1. Unsigned indices, so numba emits
    no negative-index wraparound (slots are range-checked before any kernel, SPEC §14.2), which
    keeps the lanes loops that call it vectorizable."""
    q = uint64(s if (p == 0) | (p == -1) else p) * uint64(4)
    h = mix3(flat[q + uint64(2)], flat[q], flat[q + uint64(1)])
    return uint64(s) * uint64(4), HEAD_HASH_U64 if p == -1 else h


@internal
def _plain_lanes(buf, slots, prevs, poss, toks):  # type: ignore[no-untyped-def]
    """Entries of `slots` (a chunk's slice) with a violation, no real-KV sources (fold 0): one
    branch-free loop that LLVM vectorizes with gathers (four entries per AVX2/AVX-512 lane
    group, mix3 in vector multiplies), for chunks whose slots do not run consecutively.

    Each entry loads its chain input row (`_chain_input`) and its own row; rows are indexed
    with unsigned integers so numba emits no negative-index wraparound (every slot and prev is
    range-checked before a kernel runs, SPEC §14.2). Same bits as `_entry_bad`."""
    wide_vectors()
    nb = 0
    flat = _flat_rows(buf)
    for k in range(slots.shape[0]):
        s, p, t = slots[k], prevs[k], toks[k]
        u, exp_chain = _row_and_chain(flat, s, p)
        ok = (
            ((p == 0) | (flat[u + uint64(2)] == exp_chain))
            & (flat[u + uint64(1)] == uint64(poss[k]))
            & (flat[u + uint64(3)] == uint64(0))
            & ((t == -1) | (flat[u] == uint64(t)))
        )
        nb += 0 if ok | (s == 0) else 1
    return nb


@internal
def _plain_chunk(buf, v_slot, v_prev, v_pos, v_tok, c):  # type: ignore[no-untyped-def]
    """Entries with a violation in chunk `c` (`_CHUNK` entries), no real-KV sources (fold 0).

    A chunk whose slots run consecutively (chains over contiguous rows) goes through
    `_plain_run`, vectorized with unit-stride loads, and is done when that finds it clean. Any
    other chunk (or one with a violation) first requests the rows of the next chunk (random rows
    are otherwise one DRAM latency each; the next chunk is usually this thread's next one,
    prange hands each thread a contiguous range) and is then checked by `_plain_lanes`,
    vectorized with gathers.
    """
    n = v_slot.shape[0]
    lo = c * _CHUNK
    hi = min(lo + _CHUNK, n)
    first = v_slot[lo]
    last = v_slot[hi - 1]
    in_buf = (first >= 1) & (last - first == hi - 1 - lo) & (last < buf.shape[0])
    if in_buf and _plain_run(buf, v_slot, v_prev, v_pos, v_tok, lo, hi) == 0:
        return 0
    for j in range(hi, min(hi + _CHUNK, n)):
        _prefetch_entry(buf, v_slot, j, n)
    return _plain_lanes(buf, v_slot[lo:hi], v_prev[lo:hi], v_pos[lo:hi], v_tok[lo:hi])


#: int64 mask that proves an index non-negative to LLVM: numba wraps negative indices, and that
#: select keeps LLVM from vectorizing a loop with gathers (slots are range-checked, never < 0)
_NONNEG = np.int64(0x7FFF_FFFF_FFFF_FFFF)


@internal
def _pair_at(words, row, col):  # type: ignore[no-untyped-def]
    """`_fold_pair` of the tile at (row, col), both known non-negative."""
    return splitmix64(splitmix64(uint64(0) ^ words[row, col]) ^ words[row, col + 1])


@internal
def _folded_lanes(  # type: ignore[no-untyped-def]
    buf, slots, prevs, poss, toks, s0, s1, s2, s3, count, page, shift, w0, w1, w2, w3,
):  # fmt: skip
    """Entries of `slots` (a chunk's slice) with a violation, folding `count` sources of one page
    geometry (`params[:, 4] == 1`): one branch-free loop that LLVM vectorizes with gathers
    (AVX-512: eight entries per lane group, the 64-bit multiplies of splitmix in vector units).
    Same bits as `_entry_bad` with `fold_uniform`; the caller passes `count` as a literal so each
    copy has its sources fixed (a run-time count inside the loop keeps it scalar)."""
    wide_vectors()
    nb = 0
    flat = _flat_rows(buf)
    mask = page - 1
    for k in range(slots.shape[0]):
        s, p, t = slots[k], prevs[k], toks[k]
        u, exp_chain = _row_and_chain(flat, s, p)
        row = (s >> shift) & _NONNEG
        lo = s & mask
        fold = splitmix64(_pair_at(s0, row, (lo * w0) & _NONNEG))
        if count > 1:
            fold = splitmix64(fold ^ _pair_at(s1, row, (lo * w1) & _NONNEG))
        if count > 2:
            fold = splitmix64(fold ^ _pair_at(s2, row, (lo * w2) & _NONNEG))
        if count > 3:
            fold = splitmix64(fold ^ _pair_at(s3, row, (lo * w3) & _NONNEG))
        ok = (
            ((p == 0) | (flat[u + uint64(2)] == exp_chain))
            & (flat[u + uint64(1)] == uint64(poss[k]))
            & (flat[u + uint64(3)] == fold)
            & ((t == -1) | (flat[u] == uint64(t)))
        )
        nb += 0 if ok | (s == 0) else 1
    return nb


@internal
def _uniform_chunk(buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count, lo, hi):  # type: ignore[no-untyped-def]
    """Entries with a violation in `lo:hi` under the one-page geometry: `_folded_lanes` with
    `count` as a literal (one vectorized copy per source count). The next chunk's tiles are
    requested first, as `_plain_chunk` requests rows: random slots are a DRAM latency each."""
    n = v_slot.shape[0]
    page, shift = params[0, 0], params[0, 3]
    w0, w1, w2, w3 = params[0, 1], params[1, 1], params[2, 1], params[3, 1]
    for j in range(hi, min(hi + _CHUNK, n)):
        ahead = v_slot[j]
        if ahead - v_slot[j - 1] != 1:  # a run of consecutive slots streams by itself
            _prefetch_read(buf, ahead)
            prefetch_uniform(s0, s1, s2, s3, count, page, shift, w0, w1, w2, w3, ahead)
    sl, pv, ps, tk = v_slot[lo:hi], v_prev[lo:hi], v_pos[lo:hi], v_tok[lo:hi]
    if count == 4:
        return _folded_lanes(buf, sl, pv, ps, tk, s0, s1, s2, s3, 4, page, shift, w0, w1, w2, w3)
    if count == 3:
        return _folded_lanes(buf, sl, pv, ps, tk, s0, s1, s2, s3, 3, page, shift, w0, w1, w2, w3)
    if count == 2:
        return _folded_lanes(buf, sl, pv, ps, tk, s0, s1, s2, s3, 2, page, shift, w0, w1, w2, w3)
    return _folded_lanes(buf, sl, pv, ps, tk, s0, s1, s2, s3, 1, page, shift, w0, w1, w2, w3)


@internal
def _folded_chunk(buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count, c):  # type: ignore[no-untyped-def]
    """Entries with a violation in chunk `c`, folding `count` real-KV sources. One page
    geometry (`params[:, 4]`): `_uniform_chunk`. Otherwise four entries at a time (each is two
    serial hash chains, mix3 and fold: eight in straight-line code overlap). Slot 0 is folded
    too (row 0 exists in every source) and never counted bad."""
    n = v_slot.shape[0]
    lo = c * _CHUNK
    hi = min(lo + _CHUNK, n)
    if params[0, 4] != 0:
        return _uniform_chunk(buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count,
                              lo, hi)  # fmt: skip
    bad = 0
    i = lo
    while i + 4 <= hi:
        for k in range(4):
            j = i + k
            _prefetch_entry(buf, v_slot, j + _PREFETCH_AHEAD, n)
            if j + _FOLD_AHEAD < n:
                ahead = v_slot[j + _FOLD_AHEAD]
                if ahead > 0:
                    prefetch_sources(s0, s1, s2, s3, params, count, ahead)
        a0, a1, a2, a3 = v_slot[i], v_slot[i + 1], v_slot[i + 2], v_slot[i + 3]
        p0, p1, p2, p3 = v_prev[i], v_prev[i + 1], v_prev[i + 2], v_prev[i + 3]
        q0, q1 = _chain_input(buf, a0, p0), _chain_input(buf, a1, p1)
        q2, q3 = _chain_input(buf, a2, p2), _chain_input(buf, a3, p3)
        h0 = mix3(buf[q0, 2], buf[q0, 0], buf[q0, 1])
        h1 = mix3(buf[q1, 2], buf[q1, 0], buf[q1, 1])
        h2 = mix3(buf[q2, 2], buf[q2, 0], buf[q2, 1])
        h3 = mix3(buf[q3, 2], buf[q3, 0], buf[q3, 1])
        f0 = fold_sources(s0, s1, s2, s3, params, count, a0)
        f1 = fold_sources(s0, s1, s2, s3, params, count, a1)
        f2 = fold_sources(s0, s1, s2, s3, params, count, a2)
        f3 = fold_sources(s0, s1, s2, s3, params, count, a3)
        bad += (
            _entry_bad(buf, a0, p0, v_pos[i], v_tok[i], h0, f0)
            + _entry_bad(buf, a1, p1, v_pos[i + 1], v_tok[i + 1], h1, f1)
            + _entry_bad(buf, a2, p2, v_pos[i + 2], v_tok[i + 2], h2, f2)
            + _entry_bad(buf, a3, p3, v_pos[i + 3], v_tok[i + 3], h3, f3)
        )
        i += 4
    while i < hi:
        slot = v_slot[i]
        if slot != 0:
            fold = fold_sources(s0, s1, s2, s3, params, count, slot)
            if not _entry_ok(buf, slot, v_prev[i], v_pos[i], v_tok[i], fold):
                bad += 1
        i += 1
    return bad


@internal
def _chunk_bad(buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count, c):  # type: ignore[no-untyped-def]
    """Entries with a violation in chunk `c`: `_plain_chunk` (no real-KV sources) or
    `_folded_chunk`."""
    if count == 0:
        return _plain_chunk(buf, v_slot, v_prev, v_pos, v_tok, c)
    return _folded_chunk(buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count, c)


@internal
def _record_all(  # type: ignore[no-untyped-def]
    buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count, tag, ring, state,
):  # fmt: skip
    """Record every violating entry's ring row, in plan order (serial: the ring is ordered)."""
    for i in range(v_slot.shape[0]):
        slot = v_slot[i]
        if slot == 0:
            continue
        bits, exp_chain = _verify_one(
            buf, slot, v_prev[i], v_pos[i], v_tok[i], s0, s1, s2, s3, params, count
        )
        if bits != 0:
            rec = buf[slot]
            _record(ring, state, tag, slot, rec[1], rec[0], v_tok[i], rec[2], exp_chain, bits)


@njit(cache=True, parallel=True)
def verify(  # type: ignore[no-untyped-def]
    buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count, tag, ring, state,
):  # fmt: skip
    """Verify every entry against `buf` (read-only); record violations in plan order."""
    # Count violating entries over chunks of `_CHUNK` entries in parallel. One parallel loop for
    # both chunk kinds: each costs numba ~2 s to compile, whatever its body.
    nchunks = (v_slot.shape[0] + _CHUNK - 1) // _CHUNK
    bad = 0
    for chunk in prange(nchunks):
        # numba types the loop index int64, then uint64 in the parallel body it compiles: one
        # type here, or each chunk helper is compiled twice
        c = np.int64(chunk)
        bad += _chunk_bad(buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count, c)
    if bad != 0:
        _record_all(buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count, tag, ring,
                    state)  # fmt: skip


@njit(cache=True)
def verify_serial(  # type: ignore[no-untyped-def]
    buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count, tag, ring, state,
):  # fmt: skip
    """`verify` on the calling thread, byte-equal to it: for launches too small to pay for
    waking numba's thread pool (and for waiting on a pool thread that another process's
    spinning threads keep off a core, as vLLM's OpenMP threads do after each forward)."""
    bad = 0
    for c in range((v_slot.shape[0] + _CHUNK - 1) // _CHUNK):
        bad += _chunk_bad(buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count, c)
    if bad != 0:
        _record_all(buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count, tag, ring,
                    state)  # fmt: skip
