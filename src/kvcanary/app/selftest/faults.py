"""Turn the canary's injection journal and the engine's plant journal into `Fault`s.

`RelatedSlots` wraps the `Perturber` to note, at injection time, the slot that follows each
injected position in its request (`req_to_token[row, position + 1]`): a broken record also breaks
its successor's chain check, and those rows belong to the same fault (SPEC §11.2).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvcanary.app.selftest.correlate import Fault
from kvcanary.canary import PerturbRecord
from kvcanary.canary.perturb import Perturber
from kvcanary.canary.perturb_seam import CanaryState
from kvcanary.contract import ForwardView
from kvcanary.engine.plants import UNREAD_PREFIX, PlantRecord

__all__ = ["CACHE_MODES", "RelatedSlots", "fault_from_record", "faults_of", "faults_of_plants"]

CACHE_MODES = frozenset({"real_kv_unused_cache", "stale_prefix", "late_write"})
_SLOT_EXTRAS = frozenset({"original_slot", "displaced_slot", "source_slot"})


class RelatedSlots:
    """A `Perturber` that also remembers each new record's successor slot."""

    def __init__(self, inner: Perturber) -> None:
        self.inner = inner
        self.successors: dict[int, frozenset[int]] = {}  # journal index -> related slots

    def bind(self, canary: CanaryState) -> None:
        """Forwarded."""
        self.inner.bind(canary)

    def _note(self, view: ForwardView | None) -> None:
        records = self.inner.injections()
        for i in range(len(self.successors), len(records)):
            self.successors[i] = _successors(records[i], view)

    def before_plan(self, *, view: ForwardView, step: int) -> None:
        """Forwarded; notes successors against the live table."""
        self.inner.before_plan(view=view, step=step)
        self._note(view)

    def after_tail(self, *, view: ForwardView, step: int) -> None:
        """Forwarded; notes successors against the live table."""
        self.inner.after_tail(view=view, step=step)
        self._note(view)

    def at_end_step(self, *, step: int, sweep_due: bool) -> None:
        """Forwarded."""
        self.inner.at_end_step(step=step, sweep_due=sweep_due)
        self._note(None)

    def maybe_swap_next_tokens(self, *, tokens: list[int], step: int) -> list[int]:
        """Forwarded."""
        out = self.inner.maybe_swap_next_tokens(tokens=tokens, step=step)
        self._note(None)
        return out

    def injections(self) -> list[PerturbRecord]:
        """The inner journal."""
        return self.inner.injections()


def _successors(record: PerturbRecord, view: ForwardView | None) -> frozenset[int]:
    if view is None:
        return frozenset()
    table = np.asarray(view.req_to_token)
    pairs = [(record.extras.get("req_row"), record.position)]
    if record.mode == "double_alloc":  # the displaced owner's chain breaks after its slot
        pairs.append((record.extras.get("owner_req_row"), record.extras.get("owner_position")))
    out = set()
    for row, pos in pairs:
        if (
            isinstance(row, int)
            and isinstance(pos, int)
            and 0 < row < table.shape[0]
            and 0 <= pos + 1 < table.shape[1]
        ):
            nxt = int(table[row, pos + 1])
            if nxt > 0:
                out.add(nxt)
    return frozenset(out)


def fault_from_record(
    record: PerturbRecord, related: frozenset[int], *, sweep_interval: int
) -> Fault:
    """A canary injection as a Fault: its slot, its successor, and the next position."""
    window = max(1, sweep_interval) if record.mode in CACHE_MODES else 1
    positions = {record.position + 1}
    if record.mode == "next_token_swap":  # slot -1: the swapped tokens land at these positions
        positions = {record.position, record.extras.get("other_position", record.position)}  # type: ignore[arg-type]
    owner = record.extras.get("owner_position")
    if isinstance(owner, int):
        positions.add(owner + 1)
    # slots the fault displaced or copied also carry its consequences (e.g. a displaced slot
    # that the request still caches but never wrote)
    named = {
        v for k, v in record.extras.items() if k in _SLOT_EXTRAS and isinstance(v, int) and v > 0
    }
    slots = ({record.slot} if record.slot > 0 else set()) | set(related) | named
    return Fault(record.mode, record.step, record.group, frozenset(slots), window,
                 positions=frozenset(p for p in positions if isinstance(p, int)), detail=str(dict(record.extras)))  # fmt: skip


def faults_of(
    records: Sequence[PerturbRecord], related: dict[int, frozenset[int]], *, sweep_interval: int
) -> list[Fault]:
    """All injections of one run."""
    return [
        fault_from_record(r, related.get(i, frozenset()), sweep_interval=sweep_interval)
        for i, r in enumerate(records)
    ]


def faults_of_plants(records: Sequence[PlantRecord], *, sweep_interval: int) -> list[Fault]:
    """One Fault per counted firing; follow-up records (`counted=False`) widen the latest firing
    of the same plant with the slots and positions they name."""
    faults: list[Fault] = []
    for r in records:
        if r.description.startswith(UNREAD_PREFIX):  # that firing did no harm: not an injection
            latest = next(
                (i for i in range(len(faults) - 1, -1, -1) if faults[i].name == r.plant), None
            )
            if latest is not None:
                del faults[latest]
            continue
        slots = frozenset(s for s in r.slots if s > 0)
        positions = frozenset(r.positions) | {p + 1 for p in r.positions}
        latest = next(
            (i for i in range(len(faults) - 1, -1, -1) if faults[i].name == r.plant), None
        )
        if r.counted or latest is None:
            faults.append(Fault(r.plant, r.step, "full", slots, max(1, sweep_interval),
                                positions=positions, detail=r.description))  # fmt: skip
        else:
            f = faults[latest]
            faults[latest] = Fault(f.name, f.step, f.group, f.slots | slots, f.window,
                                   positions=f.positions | positions, detail=f.detail,
                                   follow_steps=(*f.follow_steps, r.step))  # fmt: skip
    return faults
