"""Transfer checksums of whole vLLM KV blocks, and the sidecar file that carries them.

The canary's records and real-KV fingerprint cover layer 0, and in `real_data=partial` only the
first bytes of each row. A transfer moves every layer of whole blocks, so the sender adds one
checksum per block over every byte it moved (all layers, in the order vLLM registered them:
BLAKE2b-64) and the receiver recomputes it over the bytes that landed. A landing that stopped
after some layers, a flipped bit anywhere, a late duplicate or another request's block then
differs, and the canary reports it (`SidecarTransfer.report_landed_bytes`). The cost is one pass
over the bytes the transfer moved, on each side, once per transfer.

Sidecar file (`kvcanary.sidecar`): `KVCX`, u32 version, u32 number of blocks, the blocks' int64
checksums in position order, then the canary's `SidecarRecords.to_bytes()`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt
import torch

from kvcanary.contract import CanaryContractError, SidecarRecords

__all__ = ["block_checksums", "pack_sidecar", "unpack_sidecar"]

_MAGIC: Final = b"KVCX"
_VERSION: Final = 1
_HEADER = struct.Struct("<4sII")


def block_checksums(caches: Sequence[torch.Tensor], blocks: npt.NDArray[np.int64]
                    ) -> npt.NDArray[np.int64]:  # fmt: skip
    """One BLAKE2b-64 per block id in `blocks`, over that block's bytes in every cache (each
    `[num_blocks, ...]`, block-major, as vLLM's CPU caches are), as signed int64."""
    out = np.empty(len(blocks), dtype=np.int64)
    for j, b in enumerate(blocks.tolist()):
        h = hashlib.blake2b(digest_size=8)
        for cache in caches:
            h.update(cache[b].contiguous().view(torch.uint8).numpy())
        out[j] = int.from_bytes(h.digest(), "little", signed=True)
    return out


def pack_sidecar(records: SidecarRecords, checksums: npt.NDArray[np.int64]) -> bytes:
    """The sidecar file's bytes (see the module docstring)."""
    body = np.ascontiguousarray(checksums, dtype="<i8").tobytes()
    return _HEADER.pack(_MAGIC, _VERSION, len(checksums)) + body + records.to_bytes()


def unpack_sidecar(data: bytes) -> tuple[SidecarRecords, npt.NDArray[np.int64]]:
    """`pack_sidecar`'s inverse; `CanaryContractError` for anything malformed (the file comes
    from another process or a stale folder)."""
    if len(data) < _HEADER.size:
        raise CanaryContractError(
            f"kv-canary: sidecar file of {len(data)} bytes is shorter than its header"
        )
    magic, version, nblocks = _HEADER.unpack_from(data)
    if magic != _MAGIC or version != _VERSION:
        raise CanaryContractError(
            f"kv-canary: sidecar file header is {magic!r} v{version}, expected {_MAGIC!r} "
            f"v{_VERSION} (written by another kvcanary version?)"
        )
    end = _HEADER.size + 8 * nblocks
    if len(data) < end:
        raise CanaryContractError(
            f"kv-canary: sidecar file announces {nblocks} block checksums but holds "
            f"{len(data) - _HEADER.size} bytes after its header"
        )
    checksums = np.frombuffer(data[_HEADER.size : end], dtype="<i8").astype(np.int64)
    return SidecarRecords.from_bytes(data[end:]), checksums
