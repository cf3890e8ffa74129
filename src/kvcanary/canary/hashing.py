"""Hash constants and the plain-integer reference of the record hashes (SPEC §4).

All arithmetic is on u64; stored values are the int64 with the same bit pattern.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcanary.contract.oracle import MASK64, splitmix64

__all__ = [
    "ANCHOR",
    "HEAD_HASH",
    "MASK64",
    "fold_one",
    "fold_sources",
    "mix3",
    "splitmix64",
    "to_i64",
    "to_u64",
]

ANCHOR = 0xC0FFEE1234567890
HEAD_HASH = splitmix64(ANCHOR)


def to_u64(x: int) -> int:
    """The u64 with the same low 64 bits as `x`."""
    return x & MASK64


def to_i64(x: int) -> int:
    """The signed int64 with the same bit pattern as the u64 `x`."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def mix3(a: int, b: int, c: int) -> int:
    """Order-sensitive three-way mix: splitmix(splitmix(splitmix(a) ^ b) ^ c) on u64."""
    h = splitmix64(to_u64(a))
    h = splitmix64(h ^ to_u64(b))
    return splitmix64(h ^ to_u64(c))


def fold_one(tile: bytes) -> int:
    """Fold a tile (length a multiple of 16) of little-endian u64 words into one u64."""
    if len(tile) % 16:
        raise ValueError(f"kv-canary: fold tile must be a multiple of 16 bytes, got {len(tile)}")
    acc = 0
    for off in range(0, len(tile), 8):
        acc = splitmix64(acc ^ int.from_bytes(tile[off : off + 8], "little"))
    return acc


def fold_sources(tiles: Sequence[bytes]) -> int:
    """Fold each source's tile in order: acc = splitmix64(acc ^ fold_one(tile)). 0 if none."""
    acc = 0
    for tile in tiles:
        acc = splitmix64(acc ^ fold_one(tile))
    return acc
