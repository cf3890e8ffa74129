"""Mode `recover`: turn each kernel pass's violation rows into incidents (SPEC §14.3).

Every kernel pass records into a `PassRows` scratch ring sized for the worst case of that pass
(one row per verify entry, two per write entry), so the canary sees every row of the pass no
matter how full the fill-once ring is; the rows are then appended to the ring (`absorb`) and, in
mode `recover`, attributed to view rows by `IncidentCollector`:

- a verify row belongs to the plan entries that fail: the candidates are the entries reading a
  failing slot, and each is re-checked on its own with the reference kernel (read-only, same
  buffer, same sources), so a slot shared by two requests is charged only to the requests whose
  entry actually fails (a stale prefix fails for the reader, not for the owner);
- a write row belongs to the write entry with its slot, token and position;
- a SWEEP row belongs to no request, only to its cached slots.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcanary.canary.kernels import reference
from kvcanary.canary.plan import GroupPlan, ViewSnapshot
from kvcanary.canary.sources import FoldSources
from kvcanary.contract.incident import Incident, IncidentRow

__all__ = ["IncidentCollector", "PassRows"]

I64 = npt.NDArray[np.int64]


class PassRows:
    """A scratch violation ring for one kernel pass; `prepare(n)` before, `take()` after."""

    def __init__(self) -> None:
        self._rows: I64 = np.zeros((64, 8), dtype=np.int64)
        self.words: npt.NDArray[np.uint64] = self._rows.view(np.uint64)
        self.state: I64 = np.zeros(1, dtype=np.int64)

    def prepare(self, max_rows: int) -> None:
        """Room for `max_rows` rows, write index reset to 0."""
        if max_rows > len(self._rows):
            self._rows = np.zeros((max(max_rows, 2 * len(self._rows)), 8), dtype=np.int64)
            self.words = self._rows.view(np.uint64)
        self.state[0] = 0

    def take(self) -> I64:
        """A copy of the rows recorded since `prepare` (every one: the ring was sized for them)."""
        n = min(int(self.state[0]), len(self._rows))
        if n == 0:  # the common case: a clean pass allocates nothing
            return self._rows[:0]
        return self._rows[:n].copy()


@dataclass(slots=True)
class _Hit:
    """One failing entry: its view row, sequence position, full-pool slot and bits."""

    view_row: int
    position: int
    slot: int
    bits: int


class IncidentCollector:
    """Builds incidents pass by pass; `take()` hands them over oldest first."""

    def __init__(self) -> None:
        self._pending: list[Incident] = []

    def take(self) -> list[Incident]:
        """Incidents since the previous call."""
        out, self._pending = self._pending, []
        return out

    # ------------------------------------------------------------------ per pass
    def verify_pass(
        self,
        *,
        stage: str,
        tag: int,
        step: int,
        rows: I64,
        snap: ViewSnapshot,
        plan: GroupPlan,
        words: npt.NDArray[np.uint64],
        src: FoldSources,
        window: int | None,
    ) -> None:
        """Attribute a HEAD/TAIL verify pass's rows to the plan entries that fail."""
        entry_rows = _verify_entry_rows(snap, window, len(plan.v_slot))
        hits: list[_Hit] = []
        for slot in np.unique(rows[:, 1]).tolist():
            candidates = np.flatnonzero(plan.v_slot == slot).tolist()
            failing = [
                (e, bits) for e in candidates if (bits := _recheck(words, src, plan, e, tag)) != 0
            ]
            if not failing:  # cannot happen with a read-only verify; charge every reader
                slot_bits = int(np.bitwise_or.reduce(rows[rows[:, 1] == slot, 7]))
                failing = [(e, slot_bits) for e in candidates]
            for e, bits in failing:
                r = int(entry_rows[e]) if entry_rows is not None else -1
                pos = int(plan.v_pos[e])
                full = _full_slot(snap, r, pos, slot)
                hits.append(_Hit(r, pos, full, bits))
        self._add(stage, tag, step, rows, snap, hits)

    def write_pass(
        self, *, stage: str, tag: int, step: int, rows: I64, snap: ViewSnapshot, plan: GroupPlan
    ) -> None:
        """Attribute a write pass's rows (write-input, chain-position) to their write entries."""
        n = len(plan.w_slots)
        offsets = plan.req_offsets
        hits: dict[int, _Hit] = {}
        for row in rows.tolist():
            slot, pos, tok, bits = row[1], row[2], row[3], row[7]
            same_slot = plan.w_slots == slot
            exact = np.flatnonzero(
                same_slot & (snap.input_ids[:n] == tok) & (snap.positions[:n] == pos)
            )
            for i in (exact if len(exact) else np.flatnonzero(same_slot)).tolist():
                r = int(np.searchsorted(offsets, i, side="right")) - 1
                if i in hits:
                    hits[i].bits |= bits
                    continue
                position = int(snap.prefix_lens[r]) + i - int(offsets[r])
                hits[i] = _Hit(r, position, int(snap.out_slots[i]), bits)
        self._add(stage, tag, step, rows, snap, list(hits.values()))

    def sweep_pass(
        self,
        *,
        tag: int,
        step: int,
        rows: I64,
        walked: I64,
        group_slots: I64,
        stage: str = "sweep",
    ) -> None:
        """A SWEEP pass (or a verify of landed slots): no request, only the failing slots
        (full-pool indices, `walked[:, 0]`)."""
        failing = np.isin(group_slots, np.unique(rows[:, 1]))
        slots = sorted({int(s) for s in walked[failing, 0].tolist() if s > 0})
        self._pending.append(
            Incident(
                stage=stage,
                tag=tag,
                step=step,
                violations=len(rows),
                fail_reason_bits=int(np.bitwise_or.reduce(rows[:, 7])),
                slots=tuple(slots),
            )
        )

    # ------------------------------------------------------------------ internals
    def _add(
        self, stage: str, tag: int, step: int, rows: I64, snap: ViewSnapshot, hits: Iterable[_Hit]
    ) -> None:
        by_row: dict[int, list[_Hit]] = {}
        for h in hits:
            by_row.setdefault(h.view_row, []).append(h)
        incident_rows = tuple(
            IncidentRow(
                view_row=r,
                req_row=int(snap.rows[r]) if r >= 0 else 0,
                first_position=min(h.position for h in group),
                slots=tuple(sorted({h.slot for h in group if h.slot > 0})),
                fail_reason_bits=_or(h.bits for h in group),
            )
            for r, group in sorted(by_row.items())
        )
        slots = sorted({s for ir in incident_rows for s in ir.slots})
        self._pending.append(
            Incident(
                stage=stage,
                tag=tag,
                step=step,
                violations=len(rows),
                fail_reason_bits=int(np.bitwise_or.reduce(rows[:, 7])),
                slots=tuple(slots),
                rows=incident_rows,
            )
        )


def _or(values: Iterable[int]) -> int:
    out = 0
    for v in values:
        out |= v
    return out


def _verify_entry_rows(snap: ViewSnapshot, window: int | None, total: int) -> I64 | None:
    """The view row of each verify-plan entry (SPEC §5.1 order), or None if it does not add up."""
    prefix = snap.prefix_lens
    start = np.zeros_like(prefix) if window is None else np.maximum(prefix - window, 0)
    counts = np.where(snap.rows != 0, np.maximum(prefix - start, 0), 0)
    if int(counts.sum()) != total:
        return None
    return np.repeat(np.arange(len(counts), dtype=np.int64), counts)


def _recheck(
    words: npt.NDArray[np.uint64], src: FoldSources, plan: GroupPlan, e: int, tag: int
) -> int:
    """The fail bits of plan entry `e` alone (0 when it verifies clean)."""
    ring = np.zeros((1, 8), dtype=np.uint64)
    state = np.zeros(1, dtype=np.int64)
    one = slice(e, e + 1)
    s0, s1, s2, s3 = src.words
    reference.verify(
        words, plan.v_slot[one], plan.v_prev[one], plan.v_pos[one], plan.v_tok[one],
        s0, s1, s2, s3, src.params, src.count, tag, ring, state,
    )  # fmt: skip
    return int(ring[0, 7]) if state[0] else 0


def _full_slot(snap: ViewSnapshot, view_row: int, pos: int, group_slot: int) -> int:
    """The full-pool slot a verify entry read: `req_to_token[row, pos]` (the group slot when
    the row is unknown)."""
    if view_row < 0:
        return group_slot
    return int(snap.req_to_token[int(snap.rows[view_row]), pos])
