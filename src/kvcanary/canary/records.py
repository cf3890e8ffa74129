"""The 32-byte slot record (SPEC §3): TOKEN, POSITION, PREV_HASH, REAL_KV_HASH as LE int64."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
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
FIELD_TOKEN, FIELD_POSITION, FIELD_PREV_HASH, FIELD_REAL_KV_HASH = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class SlotRecord:
    """One decoded record; hashes as signed int64."""

    token: int
    position: int
    prev_hash: int
    real_kv_hash: int


def new_record_buffer(num_slots: int) -> npt.NDArray[np.uint8]:
    """A zeroed `[num_slots, 32]` uint8 record buffer."""
    return np.zeros((num_slots, RECORD_BYTES), dtype=np.uint8)


def record_words(buf: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint64]:
    """The buffer as `[num_slots, 4]` u64 words (a view; little-endian host assumed)."""
    return buf.view("<u8")


def read_record(buf: npt.NDArray[np.uint8], slot: int) -> SlotRecord:
    """Decode the record of `slot`."""
    token, position, prev_hash, real_kv_hash = (int(x) for x in buf[slot].view("<i8"))
    return SlotRecord(token, position, prev_hash, real_kv_hash)
