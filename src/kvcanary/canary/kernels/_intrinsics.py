"""Shared numba building blocks of the fast kernels: splitmix64 / mix3, the real-KV fold, the
row-prefetch intrinsics and the fill-once ring append (SPEC §4, §5).

Each helper is a plain `@njit` function (or an intrinsic), compiled once; LLVM inlines it into the
loops of `fast_plan`, `fast_verify`, `fast_write_lanes` and `fast_write` when it optimises their
linked module. Helpers that only kernels call are `@internal`.
"""

from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import njit, types, uint64
from numba.core import cgutils
from numba.core import config as numba_config
from numba.extending import intrinsic

_C1 = uint64(0xBF58476D1CE4E5B9)
_C2 = uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = uint64(30), uint64(27), uint64(31)
HEAD_HASH_U64 = uint64(0xDE7FAE23A9A1B716)
_PREFETCH_AHEAD = 16  # entries: random rows are requested this far ahead of their use

#: decorator of a kernel helper that only other kernels call: numba builds no Python- or
#: C-callable wrapper for it (each wrapper costs a cold compile ~0.1 s; see compile_cache)
internal = njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True)


def _emit_prefetch(context, builder, signature, args, extra=(), rw=0):  # type: ignore[no-untyped-def]
    """Emit `llvm.prefetch` (data cache, highest locality) of the element of the intrinsic's
    array argument `args[0]` at its other arguments (cast to intp) followed by `extra`
    (constant indices). Unchecked address arithmetic: a prefetch never faults."""
    aryty = signature.args[0]
    ary = context.make_array(aryty)(context, builder, args[0])
    idx = [context.cast(builder, a, t, types.intp)
           for a, t in zip(args[1:], signature.args[1:], strict=True)]  # fmt: skip
    idx += [context.get_constant(types.intp, e) for e in extra]
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    ptr = cgutils.get_item_pointer(
        context, builder, aryty, ary, idx, wraparound=False, boundscheck=False
    )
    builder.call(fn, [builder.bitcast(ptr, i8p), i32(rw), i32(3), i32(1)])


def _make_prefetch(rw: int):  # type: ignore[no-untyped-def]
    """An intrinsic `(words, row)` that prefetches the cache line of `words[row]`'s first word.

    A hint only: it never faults (any `row`, -1 included, is fine) and changes no result. The
    canary's record buffers start on a cache line (`records.new_record_buffer`), so a 32-byte
    row is one line and one request covers it. Asking for both ends (which rows of a
    16-byte-aligned buffer needed) doubles the requests: a random verify with rows requested
    ahead was faster with one in 7 of 9 in-process interleaved comparisons (1M and 4M slots),
    by a few percent; whole `bench/kernels.py` runs alternated could not tell them apart.
    """

    @intrinsic
    def prefetch_row(typingctx, words, row):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            _emit_prefetch(context, builder, signature, args, (0,), rw)
            return context.get_dummy_value()

        return types.void(words, row), codegen

    return prefetch_row


_prefetch_read = _make_prefetch(0)
_prefetch_write = _make_prefetch(1)


def _prefetch_read_at(context, builder, signature, args):  # type: ignore[no-untyped-def]
    _emit_prefetch(context, builder, signature, args)
    return context.get_dummy_value()


@intrinsic
def _prefetch_word(typingctx, words, row, col):  # type: ignore[no-untyped-def]
    """Prefetch (for reading) the cache line holding `words[row, col]`; a hint that never
    faults, whatever `row` and `col` are, and changes no result."""
    return types.void(words, row, col), _prefetch_read_at


@intrinsic
def prefetch_element(typingctx, arr, i):  # type: ignore[no-untyped-def]
    """Prefetch (for reading) the cache line holding `arr[i]` of a 1-D array; a hint that never
    faults, whatever `i` is, and changes no result (the vLLM adapter's mirror gather)."""
    return types.void(arr, i), _prefetch_read_at


#: LLVM CPU names whose 512-bit integer multiplies lower the core clock for milliseconds (the
#: AVX-512 "heavy" licence of Skylake-SP and its refreshes): the kernels keep LLVM's 256-bit
#: preference there, as they would slow the engine's own forward down
_THROTTLING_AVX512 = frozenset({"skylake-avx512", "cascadelake", "cooperlake"})


def wide_vectors_wanted() -> bool:
    """Whether the kernels' vectorized loops ask LLVM for 512-bit vectors on this CPU (the
    target numba compiles for: `NUMBA_CPU_NAME`, else the host)."""
    return (numba_config.CPU_NAME or llvm.get_host_cpu_name()) not in _THROTTLING_AVX512


@intrinsic
def wide_vectors(typingctx):  # type: ignore[no-untyped-def]
    """Mark the calling function `"prefer-vector-width"="512"` (LLVM's per-function override).

    LLVM's tuning for Intel server cores since Skylake-SP vectorizes with 256-bit registers
    even where AVX-512 is there; the verify loops are bound by mix3's 64-bit multiplies
    (`vpmullq`), which take about as many cycles at 512 bits as at 256, so 512-bit lanes run
    the hash at ~1.4x the rate (bench/kernels.py, 2 threads of an Emerald Rapids: random
    verify 2.31x -> 1.81x its floor, sequential 2.86x -> 2.15x). Without AVX-512 the widest
    legal vector stays 256 bits and the attribute changes nothing; on CPUs in
    `_THROTTLING_AVX512` it is not set. The attribute travels with the function into the
    kernel LLVM inlines it into. Emits no instruction."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        if wide_vectors_wanted():
            # llvmlite's attribute set accepts only enum attributes through `add`; a string
            # attribute is rendered as written
            set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return types.void(), codegen


@njit(cache=True)
def splitmix64(x):  # type: ignore[no-untyped-def]
    x ^= x >> _S30
    x *= _C1
    x ^= x >> _S27
    x *= _C2
    x ^= x >> _S31
    return x


@njit(cache=True)
def mix3(a, b, c):  # type: ignore[no-untyped-def]
    h = splitmix64(a)
    h = splitmix64(h ^ b)
    return splitmix64(h ^ c)


@internal
def _tile(page_size, shift, per_token, slot):  # type: ignore[no-untyped-def]
    """(row, first word) of `slot`'s tile. A page of a power-of-two number of tokens (`shift`
    = its log2, else -1) needs no division: a 64-bit division costs more than the fold itself
    (about 13 ns of a 23 ns fold, measured for 32-token vLLM blocks)."""
    if shift >= 0:
        return slot >> shift, (slot & (page_size - 1)) * per_token
    return slot // page_size, (slot % page_size) * per_token


@internal
def _fold_one(words, page_size, shift, per_token, nread, slot):  # type: ignore[no-untyped-def]
    row, col = _tile(page_size, shift, per_token, slot)
    acc = uint64(0)
    for w in range(nread):
        acc = splitmix64(acc ^ words[row, col + w])
    return acc


@internal
def _prefetch_tile(words, page_size, shift, per_token, nread, slot):  # type: ignore[no-untyped-def]
    """Prefetch the words `_fold_one` reads for `slot` (first and last: a tile may straddle a
    cache line)."""
    row, col = _tile(page_size, shift, per_token, slot)
    _prefetch_word(words, row, col)
    _prefetch_word(words, row, col + nread - 1)


@internal
def _fold_pair(words, row, col):  # type: ignore[no-untyped-def]
    """`_fold_one` of a two-word (16-byte) tile."""
    return splitmix64(splitmix64(uint64(0) ^ words[row, col]) ^ words[row, col + 1])


@internal
def fold_uniform(s0, s1, s2, s3, count, page, shift, w0, w1, w2, w3, slot):  # type: ignore[no-untyped-def]
    """`fold_sources` when every source shares one power-of-two page size and reads 16 bytes
    (`params[:, 4] == 1`): one row and one in-page index for all sources, each source's tile at
    that index times its own words per token (`w0..w3`); no per-source loops or divisions."""
    row, lo = slot >> shift, slot & (page - 1)
    acc = uint64(0)
    if count > 0:
        acc = splitmix64(acc ^ _fold_pair(s0, row, lo * w0))
    if count > 1:
        acc = splitmix64(acc ^ _fold_pair(s1, row, lo * w1))
    if count > 2:
        acc = splitmix64(acc ^ _fold_pair(s2, row, lo * w2))
    if count > 3:
        acc = splitmix64(acc ^ _fold_pair(s3, row, lo * w3))
    return acc


@internal
def prefetch_uniform(s0, s1, s2, s3, count, page, shift, w0, w1, w2, w3, slot):  # type: ignore[no-untyped-def]
    """`prefetch_sources` under `fold_uniform`'s geometry (the first word of each tile: a
    16-byte tile of a row whose stride is a multiple of 16 bytes is in one cache line)."""
    row, lo = slot >> shift, slot & (page - 1)
    if count > 0:
        _prefetch_word(s0, row, lo * w0)
    if count > 1:
        _prefetch_word(s1, row, lo * w1)
    if count > 2:
        _prefetch_word(s2, row, lo * w2)
    if count > 3:
        _prefetch_word(s3, row, lo * w3)


@internal
def prefetch_sources(s0, s1, s2, s3, params, count, slot):  # type: ignore[no-untyped-def]
    """Prefetch every source tile `fold_sources` reads for `slot` (real-KV rows are far apart
    in memory, so a fold over many entries is otherwise one DRAM latency per entry)."""
    if params[0, 4] != 0:
        prefetch_uniform(
            s0, s1, s2, s3, count, params[0, 0], params[0, 3], params[0, 1], params[1, 1],
            params[2, 1], params[3, 1], slot,
        )  # fmt: skip
        return
    if count > 0:
        _prefetch_tile(s0, params[0, 0], params[0, 3], params[0, 1], params[0, 2], slot)
    if count > 1:
        _prefetch_tile(s1, params[1, 0], params[1, 3], params[1, 1], params[1, 2], slot)
    if count > 2:
        _prefetch_tile(s2, params[2, 0], params[2, 3], params[2, 1], params[2, 2], slot)
    if count > 3:
        _prefetch_tile(s3, params[3, 0], params[3, 3], params[3, 1], params[3, 2], slot)


@njit(cache=True)
def fold_sources(s0, s1, s2, s3, params, count, slot):  # type: ignore[no-untyped-def]
    """The real-KV fold of `slot` over `count` sources (SPEC §4); `params` as built by
    `kvcanary.canary.sources.FoldSources`."""
    if params[0, 4] != 0:  # one page geometry, 16-byte reads: 2-4x faster in the verify loops
        return fold_uniform(
            s0, s1, s2, s3, count, params[0, 0], params[0, 3], params[0, 1], params[1, 1],
            params[2, 1], params[3, 1], slot,
        )  # fmt: skip
    acc = uint64(0)
    if count > 0:
        acc = splitmix64(
            acc ^ _fold_one(s0, params[0, 0], params[0, 3], params[0, 1], params[0, 2], slot)
        )
    if count > 1:
        acc = splitmix64(
            acc ^ _fold_one(s1, params[1, 0], params[1, 3], params[1, 1], params[1, 2], slot)
        )
    if count > 2:
        acc = splitmix64(
            acc ^ _fold_one(s2, params[2, 0], params[2, 3], params[2, 1], params[2, 2], slot)
        )
    if count > 3:
        acc = splitmix64(
            acc ^ _fold_one(s3, params[3, 0], params[3, 3], params[3, 1], params[3, 2], slot)
        )
    return acc


@internal
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
