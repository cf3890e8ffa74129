"""1:1 correlation between injected faults and the violations they cause (issue: self-test).

A violation belongs to a fault when it names one of the fault's slots (in the fault's group) and
was reported at or after the fault's step. A persistent corruption is re-reported at every later
check, so later rows at the same slot still belong to it; when several faults claim a row, the
most recent one before the row wins. The fault is *caught* when its first row arrives within its
latency window; a row that no fault claims is a false alarm.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcanary.contract import Violation, fail_reason_labels, tag_name

__all__ = ["Correlation", "Fault", "correlate"]


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault: where it lands and how soon the canary must see it."""

    name: str
    step: int
    group: str  # full | swa
    slots: frozenset[int]
    window: int  # steps allowed between the fault and its first row
    positions: frozenset[int] = frozenset()  # sequence positions whose rows it also explains
    detail: str = ""
    follow_steps: tuple[int, ...] = ()  # later moments the fault's stale state was acted on

    def latency(self, first_row_step: int) -> int:
        """Steps from the latest moment the fault was acted on (its injection or a follow-up,
        e.g. a freed slot handed out again) up to its first row."""
        start = max(
            (s for s in (self.step, *self.follow_steps) if s <= first_row_step), default=self.step
        )
        return first_row_step - start

    def claims(self, v: Violation) -> bool:
        """True when `v` names one of this fault's slots, or a position it disturbed (a mapping
        or position fault shows up at the next position of the same request, whose slot did not
        exist yet when the fault was injected)."""
        return _group_of(v) == self.group and (
            v.slot_idx in self.slots or v.position in self.positions
        )


@dataclass(frozen=True, slots=True)
class Correlation:
    """The outcome of correlating one run's faults with its violations."""

    faults: tuple[Fault, ...]
    rows_per_fault: tuple[tuple[Violation, ...], ...]
    false_alarms: tuple[Violation, ...]
    latencies: tuple[int | None, ...] = field(default=())
    cascades: tuple[Violation, ...] = field(default=())

    @property
    def caught(self) -> int:
        """Faults whose first row came within their window."""
        return sum(
            lat is not None and lat <= f.window
            for f, lat in zip(self.faults, self.latencies, strict=True)
        )

    @property
    def missed(self) -> int:
        """Faults never seen within their window."""
        return len(self.faults) - self.caught

    @property
    def one_to_one(self) -> bool:
        """Every fault caught in time and every row explained by exactly one fault."""
        return bool(self.faults) and self.missed == 0 and not self.false_alarms

    @property
    def reasons_seen(self) -> set[str]:
        """Fail-reason labels of the rows that faults explain."""
        return {
            lab
            for rows in self.rows_per_fault
            for v in rows
            for lab in fail_reason_labels(v.fail_reason_bits)
        }

    def latency_stats(self) -> tuple[float | None, int | None]:
        """Median and max first-row latency over caught faults."""
        known = [lat for lat in self.latencies if lat is not None]
        if not known:
            return None, None
        return float(statistics.median(known)), max(known)


def _group_of(v: Violation) -> str:
    return "swa" if tag_name(v.kernel_kind).endswith("_SWA") else "full"


def correlate(
    faults: Sequence[Fault], violations: Sequence[Violation], *, cascades: bool = False
) -> Correlation:
    """Assign each violation to the most recent fault that claims it.

    With `cascades` (planted engine bugs, which keep corrupting the engine's state after they
    fire), an unclaimed row after the first fault is a *cascade* row, reported apart; without it
    (one-shot injected faults) every unclaimed row is a false alarm.
    """
    order = sorted(range(len(faults)), key=lambda i: faults[i].step)
    rows: list[list[Violation]] = [[] for _ in faults]
    false_alarms, cascade_rows = [], []
    first_step = min((f.step for f in faults), default=None)
    for v in violations:
        owner = None
        for i in order:
            f = faults[i]
            if f.step > v.step_when_pumped:
                break
            if f.claims(v):
                owner = i
        if (
            owner is None
            and cascades
            and first_step is not None
            and v.step_when_pumped >= first_step
        ):
            cascade_rows.append(v)
        elif owner is None:
            false_alarms.append(v)
        else:
            rows[owner].append(v)
    latencies = tuple(
        f.latency(min(v.step_when_pumped for v in r)) if r else None
        for f, r in zip(faults, rows, strict=True)
    )
    return Correlation(
        tuple(faults),
        tuple(tuple(r) for r in rows),
        tuple(false_alarms),
        latencies,
        tuple(cascade_rows),
    )
