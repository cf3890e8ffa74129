"""What a KV transfer carries besides the KV bytes (SPEC §2.7 item 3, §14.4).

Whenever KV leaves or enters a pool (prefill->decode disaggregation, a host tier, a connector)
the HEAD and TAIL records of both halves travel with it, byte for byte, for exactly the slots
whose KV moves. `SidecarRecords` is that payload; `SidecarTransfer` is what an engine or a
connector calls to export it, install it at the landing slots and verify what landed before the
first forward reads it. `NullSidecars` is the no-canary default: nothing travels, nothing is
checked. Stdlib only; the canary implements the protocol, engines call it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol, final

from kvcanary.contract.errors import CanaryContractError

__all__ = [
    "RECORD_BYTES",
    "SIDECAR_HEAD",
    "SIDECAR_TAIL",
    "NullSidecars",
    "SidecarRecords",
    "SidecarTransfer",
    "layered_transfer_order",
]

#: Bytes of one slot record (SPEC §3).
RECORD_BYTES: Final = 32
#: Names of the sidecar entries of a layer-wise transfer list.
SIDECAR_HEAD: Final = "head"
SIDECAR_TAIL: Final = "tail"

_GROUPS: Final = ("full", "swa")
_HALVES: Final = (("k",), ("k", "v"))
_MAGIC: Final = b"KVCS"
_HEADER = struct.Struct("<4sBBxxQ")  # magic, group index, number of halves, pad, slots


@dataclass(frozen=True, slots=True)
class SidecarRecords:
    """The HEAD and TAIL records of one group for a list of slots, in list order.

    `head[i]` and `tail[i]` belong to half `halves[i]` and hold `num_slots * 32` bytes: record j
    is the record of the j-th exported slot. Bytes are copied verbatim from the record buffers
    (SPEC §3); nothing is re-hashed on the way. Construction validates shapes, so a payload
    decoded from an untrusted peer either is well-formed or raises `CanaryContractError`.
    """

    group: str
    halves: tuple[str, ...]
    head: tuple[bytes, ...]
    tail: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if self.group not in _GROUPS:
            raise CanaryContractError(
                f"kv-canary: sidecar group must be 'full' or 'swa', got {self.group!r}"
            )
        if self.halves not in _HALVES:
            raise CanaryContractError(
                f"kv-canary: sidecar halves must be ('k',) or ('k', 'v'), got {self.halves!r}"
            )
        if len(self.head) != len(self.halves) or len(self.tail) != len(self.halves):
            raise CanaryContractError(
                f"kv-canary: sidecar has {len(self.halves)} halves but {len(self.head)} HEAD and "
                f"{len(self.tail)} TAIL buffers"
            )
        sizes = {len(b) for b in (*self.head, *self.tail)}
        if len(sizes) != 1 or next(iter(sizes)) % RECORD_BYTES:
            raise CanaryContractError(
                "kv-canary: sidecar buffers must all hold the same whole number of 32-byte "
                f"records, got sizes {sorted(len(b) for b in (*self.head, *self.tail))}"
            )

    @property
    def num_slots(self) -> int:
        """Records per buffer."""
        return len(self.head[0]) // RECORD_BYTES

    def slice(self, start: int, stop: int) -> SidecarRecords:
        """The records of exported slots `[start, stop)` (a prefix or part of a transfer)."""
        if not 0 <= start <= stop <= self.num_slots:
            raise CanaryContractError(
                f"kv-canary: sidecar slice [{start}, {stop}) is outside its {self.num_slots} slots"
            )
        a, b = start * RECORD_BYTES, stop * RECORD_BYTES
        return SidecarRecords(
            self.group, self.halves, tuple(h[a:b] for h in self.head),
            tuple(t[a:b] for t in self.tail),
        )  # fmt: skip

    def to_bytes(self) -> bytes:
        """A self-describing wire form: header, then HEAD buffers, then TAIL buffers."""
        header = _HEADER.pack(_MAGIC, _GROUPS.index(self.group), len(self.halves), self.num_slots)
        return header + b"".join(self.head) + b"".join(self.tail)

    @classmethod
    def from_bytes(cls, data: bytes) -> SidecarRecords:
        """Decode `to_bytes` output; `CanaryContractError` for anything malformed."""
        if len(data) < _HEADER.size:
            raise CanaryContractError(
                f"kv-canary: sidecar payload of {len(data)} bytes is shorter than its "
                f"{_HEADER.size}-byte header"
            )
        magic, group, nhalves, nslots = _HEADER.unpack_from(data)
        if magic != _MAGIC or group >= len(_GROUPS) or nhalves not in (1, 2):
            raise CanaryContractError(
                f"kv-canary: sidecar payload header is malformed (magic={magic!r}, "
                f"group={group}, halves={nhalves})"
            )
        size = nslots * RECORD_BYTES
        if len(data) != _HEADER.size + 2 * nhalves * size:
            raise CanaryContractError(
                f"kv-canary: sidecar payload is {len(data)} bytes but its header announces "
                f"{nslots} slots x {nhalves} halves ({_HEADER.size + 2 * nhalves * size} bytes)"
            )
        body = data[_HEADER.size :]
        bufs = [body[i * size : (i + 1) * size] for i in range(2 * nhalves)]
        return cls(
            _GROUPS[group], _HALVES[nhalves - 1], tuple(bufs[:nhalves]), tuple(bufs[nhalves:])
        )


def layered_transfer_order(num_layers: int) -> tuple[str | int, ...]:
    """The entries of a layer-wise transfer: HEAD sidecars first, layers 0..n-1, TAIL last.

    A transfer that stops part-way has landed HEAD but not TAIL, so the two disagree at the
    landing slots and the receiver's verify reports it (SPEC §14.4).
    """
    if num_layers < 1:
        raise ValueError(f"layered_transfer_order needs at least one layer, got {num_layers}")
    return (SIDECAR_HEAD, *range(num_layers), SIDECAR_TAIL)


class SidecarTransfer(Protocol):
    """The canary side of a transfer, as an engine or connector calls it.

    Slots are group-local indices. The receiver calls `import_sidecars` once the KV bytes landed
    and `verify_landed` before the first forward that reads the landed slots; a mismatch is
    reported as a violation of the receiving canary (TAIL tags of the group).
    """

    @property
    def carries_sidecars(self) -> bool:
        """False for `NullSidecars`: `export_sidecars` returns None and the rest is a no-op."""
        ...

    def export_sidecars(self, *, group: str, slots: Sequence[int]) -> SidecarRecords | None:
        """The records of `slots`, in order (None when no canary is installed)."""
        ...

    def import_sidecars(self, *, records: SidecarRecords, slots: Sequence[int]) -> None:
        """Install `records` at the landing `slots` (record j at `slots[j]`), both stages and
        halves; nothing is re-derived."""
        ...

    def verify_landed(
        self,
        *,
        group: str,
        slots: Sequence[int],
        positions: Sequence[int],
        prev_slots: Sequence[int],
        tokens: Sequence[int] | None = None,
    ) -> int:
        """Verify landed slots: entry j is `slots[j]` at sequence position `positions[j]` whose
        predecessor is the receiver's slot `prev_slots[j]` (-1 at position 0). `tokens[j]` is
        the expected token or -1 (unknown). Returns the number of violations recorded."""
        ...

    def report_landed_bytes(
        self,
        *,
        group: str,
        slots: Sequence[int],
        positions: Sequence[int],
        landed: Sequence[int],
        expected: Sequence[int],
        tokens: Sequence[int] | None = None,
    ) -> int:
        """Report landed slots whose transfer checksum (`landed[j]`, computed by the receiver
        over the bytes that arrived) differs from the sender's `expected[j]` (TAIL tag of the
        group, reason `verify_real_kv_hash`). Returns the number of violations recorded."""
        ...


@final
class NullSidecars:
    """No canary installed: no sidecars travel and nothing is verified."""

    @property
    def carries_sidecars(self) -> bool:
        """Always False."""
        return False

    def export_sidecars(self, *, group: str, slots: Sequence[int]) -> SidecarRecords | None:
        """Always None."""
        return None

    def import_sidecars(self, *, records: SidecarRecords, slots: Sequence[int]) -> None:
        """No-op."""

    def verify_landed(
        self,
        *,
        group: str,
        slots: Sequence[int],
        positions: Sequence[int],
        prev_slots: Sequence[int],
        tokens: Sequence[int] | None = None,
    ) -> int:
        """Always 0."""
        return 0

    def report_landed_bytes(
        self,
        *,
        group: str,
        slots: Sequence[int],
        positions: Sequence[int],
        landed: Sequence[int],
        expected: Sequence[int],
        tokens: Sequence[int] | None = None,
    ) -> int:
        """Always 0."""
        return 0
