"""SPEC §4.1 test vectors and the record layout (conformance items 1-4)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvcanary.canary.hashing import HEAD_HASH, fold_one, fold_sources, mix3, splitmix64, to_i64
from kvcanary.canary.records import (
    CACHE_LINE_BYTES,
    RECORD_BYTES,
    new_record_buffer,
    read_record,
    record_words,
)

BYTES_00_0F = bytes(range(16))
BYTES_10_1F = bytes(range(16, 32))


def test_spec_vectors() -> None:
    assert splitmix64(0) == 0
    assert HEAD_HASH == 0xDE7FAE23A9A1B716
    assert to_i64(HEAD_HASH) == -2414019407054260458
    v3 = mix3(HEAD_HASH, 5, 0)
    assert v3 == 0x91EAC0EC0344408D
    assert mix3(v3, 7, 1) == 0x521810296AAD6CDB
    assert mix3(HEAD_HASH, 0, 5) == 0xA7F8B56A297B7B66
    assert fold_one(BYTES_00_0F) == 0x447F1B95028CE131
    assert fold_sources([BYTES_00_0F]) == 0xD6D75024DFD6C30C
    assert fold_one(BYTES_00_0F + BYTES_10_1F) == 0xFAB780417B7BE8AD
    assert fold_sources([BYTES_00_0F, BYTES_10_1F]) == 0xB6209A488C3F52B0


def test_source_order_changes_the_fold() -> None:
    assert fold_sources([BYTES_10_1F, BYTES_00_0F]) != fold_sources([BYTES_00_0F, BYTES_10_1F])


def test_partial_window_ignores_byte_16_but_all_sees_it() -> None:
    tile = bytearray(BYTES_00_0F + BYTES_10_1F)
    flipped = bytearray(tile)
    flipped[16] ^= 0xFF
    assert fold_one(bytes(tile[:16])) == fold_one(bytes(flipped[:16]))
    assert fold_one(bytes(tile)) != fold_one(bytes(flipped))


@given(st.integers(min_value=-(2**63), max_value=2**63 - 1), st.integers(0, 2**63), st.integers())
def test_mix3_is_order_sensitive_and_masked(a: int, b: int, c: int) -> None:
    h = mix3(a, b, c)
    assert 0 <= h < 2**64
    assert h == mix3(a & (2**64 - 1), b, c & (2**64 - 1))


@given(
    st.lists(st.integers(0, 2**64 - 1), min_size=2, max_size=8).filter(lambda w: len(w) % 2 == 0)
)
def test_fold_word_at_a_time_equals_bytes(words: list[int]) -> None:
    tile = b"".join(w.to_bytes(8, "little") for w in words)
    acc = 0
    for w in words:
        acc = splitmix64(acc ^ w)
    assert fold_one(tile) == acc


@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=4, max_size=4))
def test_record_round_trips_negative_patterns(fields: list[int]) -> None:
    buf = new_record_buffer(3)
    assert buf.shape == (3, 32) and not buf.any()
    record_words(buf)[1] = np.array(fields, dtype=np.int64).view(np.uint64)
    rec = read_record(buf, 1)
    assert [rec.token, rec.position, rec.prev_hash, rec.real_kv_hash] == fields
    assert bytes(buf[1, :8]) == (fields[0] & (2**64 - 1)).to_bytes(8, "little")


@given(st.integers(1, 5000))
def test_record_buffer_rows_each_lie_in_one_cache_line(num_slots: int) -> None:
    buf = new_record_buffer(num_slots)
    assert buf.shape == (num_slots, RECORD_BYTES) and buf.dtype == np.uint8
    assert buf.flags.c_contiguous and buf.flags.writeable and not buf.any()
    # 64-byte aligned start, 32-byte rows: no record straddles two cache lines
    assert buf.ctypes.data % CACHE_LINE_BYTES == 0
    words = record_words(buf)
    words[:] = np.uint64(0xFFFF_FFFF_FFFF_FFFF)  # every byte is the buffer's own
    assert words.shape == (num_slots, 4) and bool((buf == 0xFF).all())
    assert new_record_buffer(0).shape == (0, RECORD_BYTES)  # a pool without slots: no rows
