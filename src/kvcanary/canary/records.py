"""The 32-byte slot record (SPEC §3): TOKEN, POSITION, PREV_HASH, REAL_KV_HASH as LE int64."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "CACHE_LINE_BYTES",
    "FIELD_POSITION",
    "FIELD_PREV_HASH",
    "FIELD_REAL_KV_HASH",
    "FIELD_TOKEN",
    "RECORD_BYTES",
    "SlotRecord",
    "new_record_buffer",
    "read_record",
    "record_words",
]

RECORD_BYTES = 32
#: record buffers start on a cache-line boundary, so no 32-byte record straddles two lines
CACHE_LINE_BYTES = 64
FIELD_TOKEN, FIELD_POSITION, FIELD_PREV_HASH, FIELD_REAL_KV_HASH = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class SlotRecord:
    """One decoded record; hashes as signed int64."""

    token: int
    position: int
    prev_hash: int
    real_kv_hash: int


def new_record_buffer(num_slots: int) -> npt.NDArray[np.uint8]:
    """A zeroed, C-contiguous `[num_slots, 32]` uint8 record buffer whose first byte is on a
    64-byte boundary, so every record lies in one cache line.

    NumPy aligns a large array to 16 bytes only: half the records of such a buffer straddle two
    lines, and a verify of slots in random order then reads 1.5 lines a record instead of one
    (bench/kernels.py, 1M slots on 2 threads: 10-15 % off the random verify and off its floor).
    """
    size = num_slots * RECORD_BYTES
    raw = np.zeros(size + CACHE_LINE_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % CACHE_LINE_BYTES
    return raw[start : start + size].reshape(num_slots, RECORD_BYTES)


def record_words(buf: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint64]:
    """The buffer as `[num_slots, 4]` u64 words (a view; little-endian host assumed)."""
    return buf.view("<u8")


def read_record(buf: npt.NDArray[np.uint8], slot: int) -> SlotRecord:
    """Decode the record of `slot`."""
    token, position, prev_hash, real_kv_hash = (int(x) for x in buf[slot].view("<i8"))
    return SlotRecord(token, position, prev_hash, real_kv_hash)
