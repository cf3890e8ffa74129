"""Byte-level edits of real KV tiles and canary records (SPEC §11.1 "Byte flips").

Real KV is reached through the group's `RealKvSource` tensors (live views of the engine's
layer-0 K buffer); records through the group's HEAD/TAIL buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvcanary.canary.buffers import GroupBuffers
from kvcanary.canary.perturb.journal import byte_text
from kvcanary.canary.records import RECORD_BYTES
from kvcanary.contract.groups import RealKvSource

__all__ = [
    "FIELD_NAMES",
    "ByteFlip",
    "SlotImage",
    "flip_byte",
    "hashed_k_sources",
    "read_image",
    "source_bytes",
    "write_image",
    "xor_field",
]

FIELD_NAMES = ("token", "position", "prev_hash", "real_kv_hash")
_PARTIAL = 16


def hashed_k_sources(group: GroupBuffers) -> tuple[RealKvSource, ...]:
    """The K sources the group actually fingerprints (none when real data is off)."""
    return group.spec.k_sources[: group.sources["k"].count]


def source_bytes(source: RealKvSource) -> npt.NDArray[np.uint8]:
    """A live `[rows, row_bytes]` uint8 view of the source tensor (shares memory)."""
    t = source.tensor
    flat = t.view(t.shape[0], -1) if t.dim() > 2 else t
    as_bytes = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    return as_bytes.numpy()


def _tile(source: RealKvSource, slot: int, nbytes: int) -> tuple[int, int, npt.NDArray[np.uint8]]:
    row = slot // source.page_size
    col = (slot % source.page_size) * source.num_bytes_per_token
    return row, col, source_bytes(source)[row, col : col + nbytes]


@dataclass(frozen=True, slots=True)
class ByteFlip:
    """Where a flip landed, as the journal reports it."""

    source_idx: int
    row: int
    col: int
    original: int
    new: int

    def extras(self) -> dict[str, object]:
        """The byte-mode journal extras."""
        return {
            "source_idx": self.source_idx,
            "row": self.row,
            "col": self.col,
            "original_byte": byte_text(self.original),
            "new_byte": byte_text(self.new),
        }


def flip_byte(sources: tuple[RealKvSource, ...], source_idx: int, slot: int) -> ByteFlip:
    """XOR 0xFF into byte 0 of `slot`'s tile in `sources[source_idx]`."""
    row, col, tile = _tile(sources[source_idx], slot, 1)
    original = int(tile[0])
    tile[0] = original ^ 0xFF
    return ByteFlip(source_idx, row, col, original, int(tile[0]))


@dataclass(frozen=True, slots=True)
class SlotImage:
    """A slot's K-half HEAD and TAIL records plus leading tile bytes of each hashed K source."""

    head: bytes
    tail: bytes
    tiles: tuple[bytes, ...]

    def generation(self) -> tuple[int, int, int]:
        """(TOKEN, POSITION, PREV_HASH) of the HEAD record."""
        words = np.frombuffer(self.head, dtype="<i8")
        return int(words[0]), int(words[1]), int(words[2])


def read_image(group: GroupBuffers, slot: int, *, tile_bytes: int | None = _PARTIAL) -> SlotImage:
    """Copy `slot`'s records and its first `tile_bytes` bytes per K source (None = whole tile)."""
    tiles = tuple(
        _tile(src, slot, src.num_bytes_per_token if tile_bytes is None else tile_bytes)[2].tobytes()
        for src in hashed_k_sources(group)
    )
    return SlotImage(
        group.buffer("head", "k")[slot].tobytes(), group.buffer("tail", "k")[slot].tobytes(), tiles
    )


def write_image(group: GroupBuffers, slot: int, image: SlotImage) -> None:
    """Store `image` into `slot` (records and as many tile bytes as the image holds)."""
    group.buffer("head", "k")[slot] = np.frombuffer(image.head, dtype=np.uint8)
    group.buffer("tail", "k")[slot] = np.frombuffer(image.tail, dtype=np.uint8)
    for src, data in zip(hashed_k_sources(group), image.tiles, strict=True):
        _tile(src, slot, len(data))[2][:] = np.frombuffer(data, dtype=np.uint8)


def xor_field(group: GroupBuffers, stage: str, slot: int, field: str, mask: int = 1) -> None:
    """XOR `mask` into one int64 field of `slot`'s K record in the `stage` buffer."""
    idx = FIELD_NAMES.index(field)
    assert group.buffer(stage, "k").shape[1] == RECORD_BYTES
    words = group.words(stage, "k")
    words[slot, idx] ^= np.uint64(mask)
