"""Numba CPU kernels: plan building, verify, write and the real-KV fold (SPEC §4, §5).

Byte-equal to `kernels.reference` (the tests check it). Buffers are `[num_slots, 4]` u64 word
views of the record buffers; the ring is the `[capacity, 8]` u64 view of the int64 ring, `state[0]` its write index
(numba loses writes through `.view` inside parallel functions, so callers pass the view).
Verify and write are parallel across entries and requests respectively; ring rows are recorded
afterwards by a serial pass in plan order, so the ring is deterministic.

Performance (bench/kernels.py): verify prefetches record rows ahead (random slot orders are
otherwise DRAM-latency bound) and, without real-KV sources, checks runs of consecutive slots with
a vectorized loop (unit-stride row loads, not gathers) and other entries four per step with
branch-free code so their mix3 chains overlap; write interleaves up to four requests' chains per
task for the same reason (each chain is a serial mix3 dependency), and without real-KV sources or
write assert advances them in lockstep, prefetching only when some chain's slots are scattered.
Each kernel is one parallel region (a thread barrier): a barrier waits for every worker thread,
which is slow whenever another process holds a core, so no np.zeros (numba runs it as a parallel
loop) in a parallel function.
"""

from __future__ import annotations

import warnings

import numpy as np
from llvmlite import ir
from numba import njit, prange, types, uint64
from numba.core import cgutils
from numba.extending import intrinsic

# `verify` is parallel=True only so that loading it from numba's cache starts the thread pool its
# parallel helpers need; numba warns that it found nothing to parallelise in its own body.
warnings.filterwarnings(
    "ignore", message=r"(?s).*'parallel=True' was specified but no transformation", category=Warning
)

_C1 = uint64(0xBF58476D1CE4E5B9)
_C2 = uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = uint64(30), uint64(27), uint64(31)
HEAD_HASH_U64 = uint64(0xDE7FAE23A9A1B716)
_CHAIN_POSITION_FLAG = 64  # internal: the chain-position row of SPEC §5.2 (reported as bit 16)
_PREFETCH_AHEAD = 16  # entries: random rows are requested this far ahead of their use
_CHUNK = 256  # verify entries per chunk (a consecutive chunk is checked vectorized)
_LANES = 4  # independent request chains interleaved per write task (hides mix3 latency)


def _make_prefetch(rw: int):  # type: ignore[no-untyped-def]
    """An intrinsic `(words, row)` that prefetches the first and last word of `words[row]`.

    A hint only: it never faults (any `row`, -1 included, is fine) and changes no result. Rows are
    32 bytes and need not be 32-byte aligned, so both ends are requested.
    """

    @intrinsic
    def prefetch_row(typingctx, words, row):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            row = context.cast(builder, args[1], signature.args[1], types.intp)
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
            for col in (0, 3):
                ptr = cgutils.get_item_pointer(
                    context, builder, aryty, ary, [row, context.get_constant(types.intp, col)],
                    wraparound=False, boundscheck=False,
                )  # fmt: skip
                builder.call(fn, [builder.bitcast(ptr, i8p), i32(rw), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(words, row), codegen

    return prefetch_row


try:  # numba's intrinsic form: a cacheable call (numba.get_num_threads is not, in njit code)
    from numba.np.ufunc.parallel import _iget_num_threads as _num_threads
except ImportError:  # pragma: no cover - other numba versions

    @njit(cache=True)
    def _num_threads():  # type: ignore[no-untyped-def]
        return 8


_prefetch_read = _make_prefetch(0)
_prefetch_write = _make_prefetch(1)


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


@njit(cache=True, inline="always")
def _prefetch_entry(buf, slots, j, n):  # type: ignore[no-untyped-def]
    """Prefetch row `slots[j]` unless it follows `slots[j - 1]` (the hardware streams those).

    A verify entry's `prev` is the previous entry's slot along a chain, so it is not prefetched.
    """
    if j < n:
        s = slots[j]
        if s - slots[j - 1] != 1:
            _prefetch_read(buf, s)


@njit(cache=True, inline="always")
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


@njit(cache=True, inline="always")
def _chain_input(buf, slot, prev):  # type: ignore[no-untyped-def]
    """The row whose hash an entry's chain is checked against: `prev`, or (when prev is 0 or -1
    and the hash is unused) the entry's own row, so that loads and mix3 need no branch."""
    return slot if (prev == 0) | (prev == -1) else prev


@njit(cache=True, inline="always")
def _plain_bad(buf, slot, prev, exp_pos, exp_tok, hashed):  # type: ignore[no-untyped-def]
    """1 when entry (fold 0) has a violation bit, else 0; slot 0 is never bad. `hashed` is
    mix3 of row `_chain_input(buf, slot, prev)`. Same bits as `_verify_one`, without branches."""
    exp_chain = HEAD_HASH_U64 if prev == -1 else hashed
    ok = (
        ((prev == 0) | (buf[slot, 2] == exp_chain))
        & (buf[slot, 1] == uint64(exp_pos))
        & (buf[slot, 3] == uint64(0))
        & ((exp_tok == -1) | (buf[slot, 0] == uint64(exp_tok)))
    )
    return 0 if ok | (slot == 0) else 1


@njit(cache=True, inline="always")
def _plain_run(buf, v_slot, v_prev, v_pos, v_tok, lo, hi):  # type: ignore[no-untyped-def]
    """(bad entries, 0) of entries `lo:hi` when their slots run consecutively from `v_slot[lo]`
    and each prev is 0, -1 or the slot before; (-, > 0) when that assumption fails somewhere.

    Rows are then contiguous and each entry's chain input is the row just before its own, so this
    loop needs no per-entry select of the chain row, no prefetch test and no slot-0 test; it is
    branch-free and LLVM vectorizes it (mix3 in AVX2/AVX-512 lanes). Two things keep its loads
    unit-stride rather than gathers: the plan arrays are sliced to `lo:hi` and indexed by the
    (provably non-negative) loop counter, so numba emits no negative-index wraparound; and the
    `shape[1] == 4` test tells LLVM the row stride, so it loads the 32-byte rows whole and
    shuffles the words apart (it cannot know a numba array's inner extent otherwise).
    Reads only rows `v_slot[lo] - 1 .. v_slot[hi - 1]`, which the caller checks are in `buf`.
    """
    if buf.shape[1] != 4:
        return 0, 1  # not a record buffer layout this loop is written for: checked per entry
    first = v_slot[lo]
    rows = buf[first - 1 : first + hi - lo]
    slots, prevs, poss, toks = v_slot[lo:hi], v_prev[lo:hi], v_pos[lo:hi], v_tok[lo:hi]
    nb = 0
    nmis = 0
    for k in range(hi - lo):
        p = prevs[k]
        t = toks[k]
        h = mix3(rows[k, 2], rows[k, 0], rows[k, 1])
        exp_chain = HEAD_HASH_U64 if p == -1 else h
        ok = (
            ((p == 0) | (rows[k + 1, 2] == exp_chain))
            & (rows[k + 1, 1] == uint64(poss[k]))
            & (rows[k + 1, 3] == uint64(0))
            & ((t == -1) | (rows[k + 1, 0] == uint64(t)))
        )
        nb += 0 if ok else 1
        slot = first + k
        nmis += 0 if (slots[k] == slot) & ((p == 0) | (p == -1) | (p == slot - 1)) else 1
    return nb, nmis


@njit(cache=True, parallel=True)
def _count_bad_plain(buf, v_slot, v_prev, v_pos, v_tok):  # type: ignore[no-untyped-def]
    """Entries with a violation, no real-KV sources (fold 0).

    Chunks of `_CHUNK` entries. A chunk whose slots run consecutively (chains over contiguous
    rows) goes through `_plain_run`, vectorized. Any other chunk is checked four entries at a
    time, prefetching rows ahead: their four mix3 chains are independent straight-line code, so
    the CPU overlaps them (one mix3 alone is a ~40-cycle dependency chain).
    """
    n = v_slot.shape[0]
    nchunks = (n + _CHUNK - 1) // _CHUNK
    bad = 0
    for c in prange(nchunks):
        lo = c * _CHUNK
        hi = min(lo + _CHUNK, n)
        first = v_slot[lo]
        last = v_slot[hi - 1]
        nb = 0
        nmis = 1
        if (first >= 1) & (last - first == hi - 1 - lo) & (last < buf.shape[0]):
            nb, nmis = _plain_run(buf, v_slot, v_prev, v_pos, v_tok, lo, hi)
        if nmis != 0:
            nb = 0
            i = lo
            while i + 4 <= hi:
                for k in range(4):
                    _prefetch_entry(buf, v_slot, i + k + _PREFETCH_AHEAD, n)
                a0, a1, a2, a3 = v_slot[i], v_slot[i + 1], v_slot[i + 2], v_slot[i + 3]
                p0, p1, p2, p3 = v_prev[i], v_prev[i + 1], v_prev[i + 2], v_prev[i + 3]
                q0, q1 = _chain_input(buf, a0, p0), _chain_input(buf, a1, p1)
                q2, q3 = _chain_input(buf, a2, p2), _chain_input(buf, a3, p3)
                h0 = mix3(buf[q0, 2], buf[q0, 0], buf[q0, 1])
                h1 = mix3(buf[q1, 2], buf[q1, 0], buf[q1, 1])
                h2 = mix3(buf[q2, 2], buf[q2, 0], buf[q2, 1])
                h3 = mix3(buf[q3, 2], buf[q3, 0], buf[q3, 1])
                nb += (
                    _plain_bad(buf, a0, p0, v_pos[i], v_tok[i], h0)
                    + _plain_bad(buf, a1, p1, v_pos[i + 1], v_tok[i + 1], h1)
                    + _plain_bad(buf, a2, p2, v_pos[i + 2], v_tok[i + 2], h2)
                    + _plain_bad(buf, a3, p3, v_pos[i + 3], v_tok[i + 3], h3)
                )
                i += 4
            while i < hi:
                slot = v_slot[i]
                if slot != 0 and not _entry_ok(buf, slot, v_prev[i], v_pos[i], v_tok[i], uint64(0)):
                    nb += 1
                i += 1
        bad += nb
    return bad


@njit(cache=True, parallel=True)
def _count_bad_folded(buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count):  # type: ignore[no-untyped-def]
    """Entries with a violation, folding `count` real-KV sources."""
    n = v_slot.shape[0]
    bad = 0
    for i in prange(n):
        _prefetch_entry(buf, v_slot, i + _PREFETCH_AHEAD, n)
        slot = v_slot[i]
        if slot != 0:
            fold = fold_sources(s0, s1, s2, s3, params, count, slot)
            if not _entry_ok(buf, slot, v_prev[i], v_pos[i], v_tok[i], fold):
                bad += 1
    return bad


@njit(cache=True, parallel=True)  # parallel: loading it from the cache starts numba's threads
def verify(  # type: ignore[no-untyped-def]
    buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count, tag, ring, state,
):  # fmt: skip
    """Verify every entry against `buf` (read-only); record violations in plan order."""
    n = v_slot.shape[0]
    if count == 0:
        bad = _count_bad_plain(buf, v_slot, v_prev, v_pos, v_tok)
    else:
        bad = _count_bad_folded(buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count)
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


@njit(cache=True, inline="always")
def _lane(r, nreq, req_offsets, start_hash, start_pos, seeds, chain_position):  # type: ignore[no-untyped-def]
    """(first entry, end entry, running hash, previous position, do_pos) of request `r`'s lane."""
    if r >= nreq:
        return 0, 0, uint64(0), 0, False
    do_pos = chain_position and seeds[r] >= 1
    return req_offsets[r], req_offsets[r + 1], start_hash[r], start_pos[r], do_pos


@njit(cache=True, inline="always")
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


@njit(cache=True, inline="always")
def _plain_step(  # type: ignore[no-untyped-def]
    buf, i, running, prev_pos, do_pos, w_slots, input_ids, positions, prefetch, last,
):  # fmt: skip
    """`_write_step` without real-KV sources (fold 0) or write assert: returns (running, prev_pos,
    True if the entry needs a ring row). `i` and `last` (the last entry) are unsigned, so numba
    indexes without negative-index wraparound."""
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
    buf[slot, 3] = uint64(0)
    return mix3(running, uint64(tok), uint64(pos)), pos, do_pos & (pos != prev_pos + 1)


@njit(cache=True, inline="always")
def _consecutive(w_slots, lo, hi):  # type: ignore[no-untyped-def]
    """True when `w_slots[lo:hi]` are consecutive slots (the hardware streams such rows)."""
    seg = w_slots[lo:hi]
    ok = True
    for k in range(seg.shape[0]):
        ok &= seg[k] == seg[0] + k
    return ok


@njit(cache=True)
def _lockstep(buf, w_slots, input_ids, positions, idx, steps, run, pp, dp, last, prefetch, track):  # type: ignore[no-untyped-def]
    """`steps` entries of each of four lanes, one of each in turn, with no end-of-lane tests.

    `idx`, `run`, `pp`, `dp` are the lanes' (unsigned) next entries, running hashes, previous
    positions and do_pos flags. `prefetch` and `track` are constants at each call site, so each
    call compiles to its own loop: without prefetch (the lanes' slots are consecutive) and without
    position tracking (no lane checks chain positions) a step is just the four mix3 chains and
    their row stores. Returns the lanes' (run, pp) and whether any entry needs a ring row.
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
        r0, q0, b0 = _plain_step(buf, j0, r0, p0, d0, w_slots, input_ids, positions, prefetch, last)
        r1, q1, b1 = _plain_step(buf, j1, r1, p1, d1, w_slots, input_ids, positions, prefetch, last)
        r2, q2, b2 = _plain_step(buf, j2, r2, p2, d2, w_slots, input_ids, positions, prefetch, last)
        r3, q3, b3 = _plain_step(buf, j3, r3, p3, d3, w_slots, input_ids, positions, prefetch, last)
        if track:
            p0, p1, p2, p3 = q0, q1, q2, q3
            bad |= b0 | b1 | b2 | b3
    return (r0, r1, r2, r3), (p0, p1, p2, p3), bad


@njit(cache=True, inline="always")
def _write_tasks(nreq):  # type: ignore[no-untyped-def]
    """Tasks for `nreq` requests: four requests' chains per task (task g owns g, g + ntasks, ...),
    but at least one per thread while there are requests to spread."""
    ntasks = (nreq + _LANES - 1) // _LANES
    nthreads = _num_threads()
    if ntasks < nthreads:
        ntasks = min(nreq, nthreads)
    return ntasks


@njit(cache=True, parallel=True)
def _chains_plain(  # type: ignore[no-untyped-def]
    buf, seeds, req_offsets, w_slots, input_ids, positions, chain_position, start_hash, start_pos,
):  # fmt: skip
    """Write every request's chain without real-KV sources or write assert; returns per request
    whether it needs ring rows (a chain-position violation).

    Like `_chains_folded`, but while all four lanes of a task have entries left they advance in
    lockstep with no end-of-lane tests (`_lockstep`), prefetching rows only when some lane's slots
    are not consecutive and tracking positions only when some lane checks them.
    """
    nreq = seeds.shape[0]
    bad = np.empty(nreq, dtype=np.bool_)  # every request's entry is set by its task
    ntasks = _write_tasks(nreq)
    nw = w_slots.shape[0]
    last = uint64(max(nw - 1, 0))
    for g in prange(ntasks):
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
                    buf, w_slots, input_ids, positions, idx, n, run, pp, dp, last, False, False
                )
            elif streamed:
                run, pp, b = _lockstep(
                    buf, w_slots, input_ids, positions, idx, n, run, pp, dp, last, False, True
                )
            elif not track:
                run, pp, b = _lockstep(
                    buf, w_slots, input_ids, positions, idx, n, run, pp, dp, last, True, False
                )
            else:
                run, pp, b = _lockstep(
                    buf, w_slots, input_ids, positions, idx, n, run, pp, dp, last, True, True
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
                    last,
                )  # fmt: skip
                b0 |= x
                i0 += 1
            if i1 < e1:
                run1, pp1, x = _plain_step(
                    buf, uint64(i1), run1, pp1, dp1, w_slots, input_ids, positions, True,
                    last,
                )  # fmt: skip
                b1 |= x
                i1 += 1
            if i2 < e2:
                run2, pp2, x = _plain_step(
                    buf, uint64(i2), run2, pp2, dp2, w_slots, input_ids, positions, True,
                    last,
                )  # fmt: skip
                b2 |= x
                i2 += 1
            if i3 < e3:
                run3, pp3, x = _plain_step(
                    buf, uint64(i3), run3, pp3, dp3, w_slots, input_ids, positions, True,
                    last,
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
    return bad


@njit(cache=True, parallel=True)
def _chains_folded(  # type: ignore[no-untyped-def]
    buf, seeds, req_offsets, w_slots, input_ids, positions, do_assert, exp_tok, exp_pos,
    chain_position, s0, s1, s2, s3, params, count, start_hash, start_pos,
):  # fmt: skip
    """Write every request's chain (any sources, write assert or not); returns per request
    whether it needs ring rows."""
    nreq = seeds.shape[0]
    bad = np.empty(nreq, dtype=np.bool_)  # every request's entry is set by its task
    # Each task runs up to _LANES requests' chains interleaved, one entry of each in turn: the
    # chains are independent, so the CPU overlaps their mix3 latencies. Task g owns requests
    # g, g + ntasks, ... (no two tasks write one request's rows, nor one slot: distinct slots).
    ntasks = _write_tasks(nreq)
    nw = w_slots.shape[0]
    for g in prange(ntasks):
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
    return bad


@njit(cache=True, parallel=True)
def write(  # type: ignore[no-untyped-def]
    buf, seeds, req_offsets, w_slots, input_ids, positions, do_assert, exp_tok, exp_pos,
    chain_position, s0, s1, s2, s3, params, count, tag, ring, state,
):  # fmt: skip
    """Write one serial chain per request (parallel across requests), then record rows."""
    nreq = seeds.shape[0]
    # np.empty, not np.zeros: in a parallel function numba runs np.zeros as a parallel loop, and
    # every parallel region is a thread barrier, slow when another process holds a core.
    start_hash = np.empty(nreq, dtype=np.uint64)
    start_pos = np.empty(nreq, dtype=np.int64)
    # Seeds are read before any record of this endpoint is written.
    for r in range(nreq):
        seed = seeds[r]
        if seed >= 1:
            start_hash[r] = mix3(buf[seed, 2], buf[seed, 0], buf[seed, 1])
            start_pos[r] = np.int64(buf[seed, 1])
        else:
            start_hash[r] = HEAD_HASH_U64
            start_pos[r] = 0
    if count == 0 and not do_assert:
        bad = _chains_plain(
            buf, seeds, req_offsets, w_slots, input_ids, positions, chain_position, start_hash,
            start_pos,
        )  # fmt: skip
    else:
        bad = _chains_folded(
            buf, seeds, req_offsets, w_slots, input_ids, positions, do_assert, exp_tok, exp_pos,
            chain_position, s0, s1, s2, s3, params, count, start_hash, start_pos,
        )  # fmt: skip
    for r in range(nreq):
        if not bad[r]:
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
