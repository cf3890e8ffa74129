"""The canary's side of a KV transfer (SPEC §14.4): export, import and verify of landed records.

`CanarySidecars` wraps an installed `Canary` and implements `kvcanary.contract.SidecarTransfer`:

- `export_sidecars` copies the HEAD and TAIL records of both halves for a list of slots, byte
  for byte (every half the pool has, whether or not its V endpoints run);
- `import_sidecars` writes received records at the landing slots: only the slot index changes,
  no record is re-derived from tokens;
- `verify_landed` checks the landed slots (chain to the receiver's predecessor slot, position,
  token when known, real-KV fingerprint of the bytes that actually landed) and reports any
  mismatch as a violation of this canary;
- `report_landed_bytes` reports landed slots whose transfer checksum (computed by the engine
  or connector over every byte it moved, all layers) differs from the sender's, so damage
  outside the bytes the fingerprint reads (another layer, a bit the partial fold skips) is a
  violation too.

Slot lists and records come from another process or a storage tier, so they are untrusted:
every index is range-checked and every shape validated before a buffer is touched, and a bad
input raises `CanaryContractError` with one clear line, never an IndexError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcanary.canary.buffers import GroupBuffers
from kvcanary.canary.records import RECORD_BYTES
from kvcanary.canary.runtime import Canary
from kvcanary.contract.errors import CanaryContractError
from kvcanary.contract.transfer import SidecarRecords

__all__ = ["CanarySidecars"]

I64 = npt.NDArray[np.int64]


def _ints(name: str, values: Sequence[int] | npt.NDArray[Any]) -> I64:
    """`values` as a 1-D int64 array; a float, bool or nested input is a contract error."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise CanaryContractError(
            f"kv-canary: transfer {name} must be a flat list of ints, got shape {arr.shape}"
        )
    if len(arr) and (arr.dtype.kind not in "iu" or arr.dtype == np.bool_):
        raise CanaryContractError(
            f"kv-canary: transfer {name} must hold ints, got dtype {arr.dtype}"
        )
    return arr.astype(np.int64)


class CanarySidecars:
    """`SidecarTransfer` over one installed canary (sender, receiver, or both)."""

    __slots__ = ("_canary",)

    def __init__(self, canary: Canary) -> None:
        """Export from, import into and verify against `canary`'s record buffers."""
        self._canary = canary

    @property
    def carries_sidecars(self) -> bool:
        """Always True: this canary's records travel with the KV."""
        return True

    def _group(self, group: str) -> GroupBuffers:
        try:
            return self._canary.group(group)
        except KeyError:
            raise CanaryContractError(
                f"kv-canary: transfer names group {group!r}, but this canary has "
                f"{[g.name for g in self._canary.groups]}"
            ) from None

    def _slots(self, g: GroupBuffers, name: str, values: Sequence[int] | npt.NDArray[Any]) -> I64:
        """Range-checked landing or source slots: in `[1, num_slots)` and pairwise distinct."""
        slots = _ints(name, values)
        bad = (slots < 1) | (slots >= g.num_slots)
        if bad.any():
            raise CanaryContractError(
                f"kv-canary: slot {int(slots[bad][0])} is outside the {g.name} group's "
                f"{g.num_slots} slots (transfer {name}; slot 0 is reserved)"
            )
        if len(np.unique(slots)) != len(slots):
            values_, counts = np.unique(slots, return_counts=True)
            raise CanaryContractError(
                f"kv-canary: transfer {name} lists slot {int(values_[counts > 1][0])} twice; "
                "each landing slot receives exactly one record"
            )
        return slots

    def export_sidecars(self, *, group: str, slots: Sequence[int]) -> SidecarRecords:
        """HEAD and TAIL records of every half at `slots`, in order, as raw bytes."""
        g = self._group(group)
        index = self._slots(g, "source slots", slots)
        halves = ("k", "v") if g.spec.has_v else ("k",)
        head = tuple(g.buffer("head", h)[index].tobytes() for h in halves)
        tail = tuple(g.buffer("tail", h)[index].tobytes() for h in halves)
        return SidecarRecords(g.name, halves, head, tail)

    def import_sidecars(self, *, records: SidecarRecords, slots: Sequence[int]) -> None:
        """Write record j of every stage and half at `slots[j]` (translation of indices only)."""
        if not isinstance(records, SidecarRecords):
            raise CanaryContractError(
                f"kv-canary: import_sidecars needs SidecarRecords, got {type(records).__name__}"
            )
        g = self._group(records.group)
        index = self._slots(g, "landing slots", slots)
        halves = ("k", "v") if g.spec.has_v else ("k",)
        if records.halves != halves:
            raise CanaryContractError(
                f"kv-canary: sidecar carries halves {records.halves} but the {g.name} group has "
                f"{halves}"
            )
        if records.num_slots != len(index):
            raise CanaryContractError(
                f"kv-canary: sidecar carries {records.num_slots} records for {len(index)} "
                "landing slots"
            )
        for stage, bufs in (("head", records.head), ("tail", records.tail)):
            for half, data in zip(halves, bufs, strict=True):
                landed = np.frombuffer(data, dtype=np.uint8).reshape(-1, RECORD_BYTES)
                g.buffer(stage, half)[index] = landed

    def verify_landed(
        self,
        *,
        group: str,
        slots: Sequence[int],
        positions: Sequence[int],
        prev_slots: Sequence[int],
        tokens: Sequence[int] | None = None,
    ) -> int:
        """Verify landed slots in HEAD and TAIL (SPEC §5.3 per entry); returns the new rows.

        `prev_slots[j]` is -1 for position 0 (expects HEAD_HASH), else a receiver slot in
        `[1, num_slots)`; chains therefore link a landed run to the receiver's own prefix.
        """
        g = self._group(group)
        index = self._slots(g, "landing slots", slots)
        pos = _ints("positions", positions)
        prev = _ints("prev_slots", prev_slots)
        tok = np.full(len(index), -1, dtype=np.int64) if tokens is None else _ints("tokens", tokens)
        for name, arr in (("positions", pos), ("prev_slots", prev), ("tokens", tok)):
            if len(arr) != len(index):
                raise CanaryContractError(
                    f"kv-canary: transfer landing slots and {name} lengths differ: "
                    f"{len(index)} vs {len(arr)}"
                )
        if (pos < 0).any():
            raise CanaryContractError(
                f"kv-canary: transfer position {int(pos[pos < 0][0])} is negative"
            )
        bad = ((prev < 1) & (prev != -1)) | (prev >= g.num_slots) | ((prev == -1) != (pos == 0))
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            raise CanaryContractError(
                f"kv-canary: transfer prev slot {int(prev[j])} at position {int(pos[j])} is "
                f"invalid: -1 exactly at position 0, else a slot in [1, {g.num_slots})"
            )
        before = self._canary.total_violations
        self._canary.verify_entries(
            group=g.name, slots=index, prevs=prev, positions=pos, tokens=tok
        )
        return self._canary.total_violations - before

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
        """One violation per landed slot whose checksum `landed[j]` (receiver, over the bytes
        that arrived) differs from `expected[j]` (sender); returns the number recorded."""
        g = self._group(group)
        index = self._slots(g, "landing slots", slots)
        pos = _ints("positions", positions)
        got, want = _ints("landed checksums", landed), _ints("expected checksums", expected)
        tok = np.full(len(index), -1, dtype=np.int64) if tokens is None else _ints("tokens", tokens)
        for name, arr in (("positions", pos), ("landed checksums", got),
                          ("expected checksums", want), ("tokens", tok)):  # fmt: skip
            if len(arr) != len(index):
                raise CanaryContractError(
                    f"kv-canary: transfer landing slots and {name} lengths differ: "
                    f"{len(index)} vs {len(arr)}"
                )
        return self._canary.record_landed_bytes(
            group=g.name, slots=index, positions=pos, tokens=tok, landed=got, expected=want
        )
