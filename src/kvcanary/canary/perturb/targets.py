"""Candidate targets read from a ForwardView (SPEC §11.1 "Common exclusions"), plus the small
record and group helpers the mode modules share.

Every list is in canonical order: view row, then position, then slot. Slots are kept both as
full-pool indices and group-local ones (through the SWA table when the group has one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcanary.canary.buffers import GroupBuffers
from kvcanary.canary.perturb_seam import CanaryState
from kvcanary.canary.plan import as_int_array
from kvcanary.canary.records import SlotRecord, read_record
from kvcanary.contract.view import ForwardView
from kvcanary.contract.walker import PrefixCacheWalker

__all__ = [
    "HALF",
    "Entry",
    "ViewArrays",
    "cache_entries",
    "distinguishable",
    "find_group",
    "head_record",
    "local_slot",
    "swa_extras",
    "unique_slots",
    "verified_entries",
    "write_entries",
]

IntArray = npt.NDArray[np.integer[Any]]


def local_slot(group: GroupBuffers, full_slot: int) -> int:
    """`T(full_slot)`: identity for FULL; the SWA table for SWA (-1 kept, out of range -> -1)."""
    if group.lut is None or full_slot < 0:
        return full_slot
    return int(group.lut[full_slot]) if full_slot < len(group.lut) else -1


@dataclass(frozen=True, slots=True)
class Entry:
    """One target: `index` is the flat token index for write entries, -1 for verify entries."""

    view_row: int
    req_row: int
    position: int
    full_slot: int
    slot: int
    index: int = -1


class ViewArrays:
    """NumPy views of a ForwardView's arrays; they share memory, so edits reach the engine."""

    def __init__(self, view: ForwardView) -> None:
        self.rows = as_int_array("rows", view.rows)
        self.prefix_lens = as_int_array("prefix_lens", view.prefix_lens)
        self.extend_lens = as_int_array("extend_lens", view.extend_lens)
        self.input_ids = as_int_array("input_ids", view.input_ids)
        self.positions = as_int_array("positions", view.positions)
        self.out_slots = as_int_array("out_slots", view.out_slots)
        self.req_to_token = as_int_array("req_to_token", view.req_to_token)
        self.mutable = view.mutable
        self.linear_chain = view.linear_chain

    def active_rows(self) -> list[int]:
        """View rows whose `rows` entry is not padding."""
        return [r for r in range(len(self.rows)) if int(self.rows[r]) != 0]

    def write_offsets(self) -> list[tuple[int, int]]:
        """Per view row, the flat range `[start, end)` of its write entries."""
        out, start = [], 0
        for r in range(len(self.rows)):
            n = max(int(self.extend_lens[r]), 0) if int(self.rows[r]) != 0 else 0
            out.append((start, start + n))
            start += n
        return out

    def written_full_slots(self) -> set[int]:
        """Full-pool slots written by this forward (>= 1)."""
        return {e.full_slot for e in write_entries(self, None)}


def write_entries(arrays: ViewArrays, group: GroupBuffers | None) -> list[Entry]:
    """This forward's write entries with full slot >= 1 (and group-local slot >= 1)."""
    out: list[Entry] = []
    n = len(arrays.out_slots)
    for r, (start, end) in enumerate(arrays.write_offsets()):
        for i in range(start, min(end, n)):
            full = int(arrays.out_slots[i])
            slot = full if group is None else local_slot(group, full)
            if full >= 1 and slot >= 1:
                req = int(arrays.rows[r])
                out.append(Entry(r, req, int(arrays.positions[i]), full, slot, i))
    return out


def verified_entries(
    arrays: ViewArrays, group: GroupBuffers, *, exclude_written: bool = True
) -> list[Entry]:
    """Live verified-range slots of active requests (SWA: in-window only).

    Slot 0, negatives and unmapped SWA slots are dropped; with `exclude_written`, so are this
    forward's `out_slots` (full and group-local).
    """
    written_full = arrays.written_full_slots() if exclude_written else set()
    written = {local_slot(group, f) for f in written_full}
    table: IntArray = arrays.req_to_token
    out: list[Entry] = []
    for r in arrays.active_rows():
        req, prefix = int(arrays.rows[r]), min(int(arrays.prefix_lens[r]), table.shape[1])
        start = 0 if group.window is None else max(0, prefix - group.window)
        for pos in range(start, prefix):
            full = int(table[req, pos])
            slot = local_slot(group, full)
            if full >= 1 and slot >= 1 and full not in written_full and slot not in written:
                out.append(Entry(r, req, pos, full, slot))
    return out


def cache_entries(walker: PrefixCacheWalker, group: GroupBuffers) -> list[Entry]:
    """Unlocked cached slots (SWA: resident only), ordered by position then slot, deduplicated."""
    seen: set[int] = set()
    out: list[Entry] = []
    walked = walker.walk(unlocked_only=True, swa_resident_only=group.is_swa)
    for full, pos, _prev in sorted(walked, key=lambda t: (t[1], t[0])):
        slot = local_slot(group, full)
        if full >= 1 and slot >= 1 and slot not in seen:
            seen.add(slot)
            out.append(Entry(-1, -1, pos, full, slot))
    return out


def unique_slots(entries: list[Entry]) -> list[Entry]:
    """The first entry of each group-local slot, order kept."""
    seen: set[int] = set()
    out: list[Entry] = []
    for e in entries:
        if e.slot not in seen:
            seen.add(e.slot)
            out.append(e)
    return out


HALF = "k"  # every injection targets the K half


def find_group(canary: CanaryState, name: str) -> GroupBuffers | None:
    """The installed group named `full` or `swa`, or None."""
    return next((g for g in canary.groups if g.name == name), None)


def head_record(group: GroupBuffers, slot: int) -> SlotRecord:
    """`slot`'s K-half HEAD record."""
    return read_record(group.buffer("head", HALF), slot)


def distinguishable(a: SlotRecord, b: SlotRecord) -> bool:
    """True when the records differ in POSITION or PREV_HASH (a swap CP can see)."""
    return a.position != b.position or a.prev_hash != b.prev_hash


def swa_extras(group: GroupBuffers, entry: Entry) -> dict[str, object]:
    """`full_slot` for SWA targets (the slot before translation); nothing for FULL."""
    return {"full_slot": entry.full_slot} if group.is_swa else {}
