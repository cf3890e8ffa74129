"""Transfer faults: named switches that break KV on its way between pools (self-test only).

Each fault models a real transfer bug class (SPEC §1.1 "Transfer corruption", §14.4) and is
switched on by name; with none configured every hook is skipped. A fault is *armed* from step
`warmup_steps` on until it has fired `max_fires` times, and fires at the first opportunity while
armed. Choices inside a firing come from a `random.Random` seeded by the seed and the fault's
name, so a run is deterministic. Every firing is journaled (`TransferFaultRecord`) with the
*receiver's* slots it damaged, which is what the self-test correlates violations with.

| fault | models | where |
|---|---|---|
| `wrong_slots` | two pages land in each other's slots (a bad index translation) | any landing |
| `page_never_written` | one page (KV and records) is never written, the landing reports complete | any landing |
| `late_landing` | a transfer lands after the receiver aborted, freed and reallocated its slots (PD abort race) | disaggregation |
| `partial_layers` | a layer-wise transfer stops after some layers: TAIL sidecar and later layers never land | any landing |
| `bit_flip_in_transit` | one bit of one page's layer-0 K flips on the wire | any landing |
| `stale_host_copy` | a host-tier restore reads host pages reclaimed by another node (a stale generation) | host tier |
| `failed_store_visible` | a host store failed but its entry still answers lookups (the pages hold what they held before) | host tier |
| `contiguous_block_ids` | the landing assumes the destination slots are contiguous from the first one | any landing |
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "DISAGG_FAULTS",
    "HOST_FAULTS",
    "TRANSFER_FAULT_NAMES",
    "TransferFaultRecord",
    "TransferFaults",
]

TRANSFER_FAULT_NAMES: tuple[str, ...] = (
    "wrong_slots",
    "page_never_written",
    "late_landing",
    "partial_layers",
    "bit_flip_in_transit",
    "stale_host_copy",
    "failed_store_visible",
    "contiguous_block_ids",
)
#: faults a host-tier restore can suffer (late_landing needs an abort race across processes)
HOST_FAULTS: tuple[str, ...] = tuple(f for f in TRANSFER_FAULT_NAMES if f != "late_landing")
#: faults a prefill->decode transfer can suffer (no host tier involved)
DISAGG_FAULTS: tuple[str, ...] = tuple(
    f for f in TRANSFER_FAULT_NAMES if f not in ("stale_host_copy", "failed_store_visible")
)


@dataclass(frozen=True, slots=True)
class TransferFaultRecord:
    """One firing: the receiver's damaged slots and the positions they were meant to hold."""

    fault: str
    step: int
    slots: tuple[int, ...]
    positions: tuple[int, ...]
    description: str


@dataclass(slots=True)
class TransferFaults:
    """The switched-on transfer faults of one receiver and their journal.

    `step` is read through `step_of` (the receiver's 0-based engine step, the canary's
    `step_when_pumped` of the same step).
    """

    names: frozenset[str] = frozenset()
    seed: int = 0
    warmup_steps: int = 0
    max_fires: int = 1
    step_of: Callable[[], int] = field(default=lambda: 0)
    journal: list[TransferFaultRecord] = field(default_factory=list)
    #: firings taken back out of the journal: they did no harm and could not be observed
    unread: list[TransferFaultRecord] = field(default_factory=list)
    _fires: dict[str, int] = field(default_factory=dict)
    _rngs: dict[str, random.Random] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_transfer_faults(self.names)

    def enabled(self, name: str) -> bool:
        """Whether `name` is switched on (it may still be in warm-up or spent)."""
        return name in self.names

    def armed(self, name: str) -> bool:
        """Whether `name` may fire now."""
        return (
            name in self.names
            and self.step_of() >= self.warmup_steps
            and self._fires.get(name, 0) < self.max_fires
        )

    def rng(self, name: str) -> random.Random:
        """The fault's own seeded generator."""
        if name not in self._rngs:
            self._rngs[name] = random.Random(zlib.crc32(f"{name}:{self.seed}".encode()))
        return self._rngs[name]

    def record(
        self, name: str, slots: Iterable[int], positions: Iterable[int], description: str
    ) -> TransferFaultRecord:
        """Journal one firing (counts towards `max_fires`)."""
        self._fires[name] = self._fires.get(name, 0) + 1
        rec = TransferFaultRecord(name, self.step_of(), tuple(slots), tuple(positions), description)
        self.journal.append(rec)
        return rec

    def unrecord(self, rec: TransferFaultRecord) -> None:
        """Take back a firing that did no harm (never readable): out of the journal, into
        `unread`, and its budget refunded, so the fault may fire again."""
        self.journal.remove(rec)
        self.unread.append(rec)
        self._fires[rec.fault] -= 1


def validate_transfer_faults(
    names: Iterable[str], allowed: Sequence[str] = TRANSFER_FAULT_NAMES
) -> None:
    """One-line ValueError naming the bad fault and the valid names."""
    for name in names:
        if name not in allowed:
            raise ValueError(
                f"--modes: unknown transfer fault {name!r}; valid names: {', '.join(allowed)}"
            )
