"""Planted engine bugs: named switches that put a realistic KV-bookkeeping bug back into the engine.

A campaign turns plants on with `EngineConfig.plants` and checks that the canary reports each one.
Every plant is modelled on a real class of serving-engine bug (SPEC §1.1), records what it did in
a journal (`Engine.plant_journal()`), and is switched by a hook of the form
`if self._plants.armed("name"): ...` in the scheduler, the KV manager or the radix cache. With no
plant configured every hook is skipped and the engine behaves exactly as before.

Firing policy (all plants): a plant is *armed* from engine step `plant_warmup_steps` on (so clean
history exists first) until it has fired `plant_max_fires` times (default 1); it fires at the
first opportunity while armed. Choices inside a firing (which locked node, which shift direction)
come from a `random.Random` seeded by `EngineConfig.seed` and the plant's name, so a run is
deterministic for a given config and workload. Steps are 0-based engine steps, the same count as
the canary's `step_when_pumped`.

| plant | models | fires when | journal names |
|---|---|---|---|
| `radix_evict_locked` | eviction ignoring `lock_ref` (slots of a running request's matched prefix freed and reallocated) | the radix cache must evict and a locked leaf exists | the node's slots, their depths, a row mapping them |
| `chunk_boundary_off_by_one` | a chunked-prefill continuation whose `req_to_token` window is written one position early (or late) | a second-or-later prefill chunk is scheduled | the mis-mapped slots, row and positions |
| `retract_stale_row` | a retraction that frees the KV but keeps the request's stale row, which it reads again on resume | a running request is retracted to make room for another and at least one of its computed slots becomes free | the freed row entries (slots, row, positions) |
| `spec_rollback_stale` | a speculative-verify rollback that frees rejected draft slots but leaves them mapped, so the next forward writes and reads them while the allocator hands them out again | a verify rejected at least one draft | the rejected slots, row and positions |
| `prefix_reused_slots` | eviction that frees a leaf's slots but leaves the node linked, so a later prefix match (and the sweep) returns freed, reused slots | the radix cache evicts an unlocked leaf | the leaf's slots and depths; a second record (not counted as a fire) when a match returns them |

A fired plant leaves the allocator's reference counts inconsistent, as the real bugs do. So that
the engine keeps serving (and the canary keeps reporting) instead of crashing on the next
`decref`, the first firing switches the slot allocator to `tolerate_unheld`: an `incref` or
`decref` of a slot that is not held is ignored. The unplanted engine never sets it.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvcanary.engine.slot_allocator import SlotAllocator

__all__ = ["PLANT_NAMES", "UNREAD_PREFIX", "PlantRecord", "PlantSet", "validate_plants"]

#: description prefix of the record that marks a firing whose damage nothing ever read
UNREAD_PREFIX = "unread: "

PLANT_NAMES: tuple[str, ...] = (
    "radix_evict_locked",
    "chunk_boundary_off_by_one",
    "retract_stale_row",
    "spec_rollback_stale",
    "prefix_reused_slots",
)


def validate_plants(plants: Iterable[str]) -> None:
    """Raise a one-line ValueError naming `EngineConfig.plants`, the bad value and the valid
    names when `plants` holds an unknown name."""
    for name in plants:
        if name not in PLANT_NAMES:
            raise ValueError(
                f"EngineConfig.plants has unknown plant {name!r}; valid names: "
                f"{', '.join(PLANT_NAMES)}"
            )


@dataclass(frozen=True, slots=True)
class PlantRecord:
    """One thing a plant did.

    Attributes:
        plant: the plant's name.
        step: 0-based engine step (the canary's `step_when_pumped` of the same step).
        slots: the KV slots involved (freed, reused or mis-mapped).
        row: the `req_to_token` row that maps them, 0 when none does (a cache-only entry).
        positions: the sequence positions of `slots`, pairwise (`positions[i]` for `slots[i]`).
        description: one human-readable line.
        request_id: the request the plant hit, when there is one.
        counted: False for follow-up records that do not count as a firing.
    """

    plant: str
    step: int
    slots: tuple[int, ...]
    row: int
    positions: tuple[int, ...]
    description: str
    request_id: str = ""
    counted: bool = True


@dataclass(frozen=True, slots=True)
class _StaleMapping:
    """Slots a plant freed while a request still maps them at `start ..`."""

    row: int
    start: int
    slots: tuple[int, ...]


class PlantSet:
    """The configured plants, their seeded RNGs, counters, cross-hook state and the journal."""

    __slots__ = (
        "_allocator",
        "_find_row",
        "_fires",
        "_max_fires",
        "_names",
        "_rngs",
        "_warmup",
        "ghost_nodes",
        "ghost_slots",
        "journal",
        "stale_drafts",
        "stale_rows",
        "step",
        "tainted",
        "unread",
    )

    def __init__(
        self,
        names: Iterable[str] = (),
        *,
        seed: int = 0,
        warmup_steps: int = 10,
        max_fires: int = 1,
    ) -> None:
        """Plants `names` (validated), armed from step `warmup_steps` for `max_fires` firings."""
        names = tuple(names)
        validate_plants(names)
        self._names = frozenset(names)
        self._warmup = warmup_steps
        self._max_fires = max_fires
        self._fires = dict.fromkeys(self._names, 0)
        self._rngs = {
            n: random.Random((seed << 32) ^ zlib.crc32(n.encode())) for n in sorted(self._names)
        }
        self._allocator: SlotAllocator | None = None
        self._find_row: Callable[[int, int], int] = lambda slot, position: 0
        self.step = 0
        self.journal: list[PlantRecord] = []
        #: retract_stale_row: request id -> the row entries it still believes in
        self.stale_rows: dict[str, _StaleMapping] = {}
        #: spec_rollback_stale: request id -> rejected draft slots still mapped in its row
        self.stale_drafts: dict[str, _StaleMapping] = {}
        #: prefix_reused_slots: ids of nodes left linked after their slots were freed
        self.ghost_nodes: set[int] = set()
        #: prefix_reused_slots: slot -> cached position, for slots of ghost nodes
        self.ghost_slots: dict[int, int] = {}
        #: slots a fired plant left mapped somewhere -> (plant, position); their first reuse by
        #: the allocator is journaled, since that is when the stale mapping turns into wrong KV
        self.tainted: dict[int, tuple[str, int]] = {}
        #: request id -> plant whose stale state it took on but no forward has read yet
        self.unread: dict[str, str] = {}

    @property
    def names(self) -> frozenset[str]:
        """The configured plant names."""
        return self._names

    def bind(self, allocator: SlotAllocator, find_row: Callable[[int, int], int]) -> None:
        """Give the set the allocator to make lenient on the first firing, and a lookup of the
        running row mapping `(slot, position)` (0 when none)."""
        self._allocator = allocator
        self._find_row = find_row

    def enabled(self, name: str) -> bool:
        """Whether plant `name` is configured (cheap; False for every name when none is)."""
        return name in self._names

    def armed(self, name: str) -> bool:
        """Whether `name` is configured, past the warm-up and below its firing budget."""
        return (
            name in self._names
            and self.step >= self._warmup
            and self._fires[name] < self._max_fires
        )

    def fires(self, name: str) -> int:
        """How many times `name` has fired."""
        return self._fires.get(name, 0)

    def awaiting_follow_up(self) -> bool:
        """Whether a fired plant's second half is still due: a retracted request has not yet
        resumed through its stale row, or a request has not yet reused its freed drafts."""
        return bool(self.stale_rows or self.stale_drafts)

    def rng(self, name: str) -> random.Random:
        """The seeded RNG of plant `name`."""
        return self._rngs[name]

    def find_row(self, slot: int, position: int) -> int:
        """A running row mapping `slot` at `position`, or 0."""
        return self._find_row(slot, position)

    def record(
        self,
        name: str,
        *,
        slots: Sequence[int],
        row: int,
        positions: Sequence[int],
        description: str,
        request_id: str = "",
        counted: bool = True,
    ) -> PlantRecord:
        """Journal one action of plant `name`; a counted record uses up one firing."""
        rec = PlantRecord(
            plant=name,
            step=self.step,
            slots=tuple(int(s) for s in slots),
            row=int(row),
            positions=tuple(int(p) for p in positions),
            description=description,
            request_id=request_id,
            counted=counted,
        )
        self.journal.append(rec)
        if counted:
            self._fires[name] += 1
            for slot, position in zip(rec.slots, rec.positions, strict=False):
                self.tainted.setdefault(slot, (name, position))
        if self._allocator is not None:
            self._allocator.tolerate_unheld = True
        return rec

    def note_read(self, request_id: str) -> None:
        """A forward of `request_id` ran: any stale state it took on has now been read."""
        self.unread.pop(request_id, None)

    def note_dropped(self, request_id: str) -> None:
        """`request_id` gave up its state before any forward read the stale part: the firing
        did no harm, so it is journaled as unread and its budget is refunded (it may fire again)."""
        name = self.unread.pop(request_id, None)
        if name is None:
            return
        self._fires[name] -= 1
        self.record(
            name, slots=(), row=0, positions=(), counted=False, request_id=request_id,
            description=f"{UNREAD_PREFIX}{request_id!r} dropped its stale state before any forward read it",
        )  # fmt: skip

    def note_alloc(self, slots: Sequence[int]) -> None:
        """Journal (uncounted) the first reuse of slots a fired plant left mapped."""
        if not self.tainted:
            return
        hits = [(s, self.tainted.pop(s)) for s in slots if s in self.tainted]
        for slot, (name, position) in hits:
            self.record(
                name, slots=(slot,), row=0, positions=(position,), counted=False,
                description=f"slot {slot} (still mapped at position {position}) handed out again",
            )  # fmt: skip

    # ---- helpers the hooks share -----------------------------------------------------------

    def force_free(self, slots: Iterable[int]) -> int:
        """Drop every reference on `slots` (the bug: the holders are ignored); returns how many
        became free."""
        assert self._allocator is not None, "PlantSet.bind was not called"
        freed = 0
        for slot in slots:
            while self._allocator.refcount(slot) > 0:
                freed += self._allocator.decref([slot])
        return freed

    def save_stale(
        self,
        table: dict[str, _StaleMapping],
        request_id: str,
        row: int,
        start: int,
        slots: list[int],
    ) -> None:
        """Remember that `request_id` still maps `slots` from `start` in `row`."""
        table[request_id] = _StaleMapping(row, start, tuple(slots))

    @staticmethod
    def take_stale(
        table: dict[str, _StaleMapping], request_id: str, row: int | None, start: int
    ) -> tuple[int, ...]:
        """Pop the stale mapping of `request_id` if it still starts at `start` (and, unless
        `row` is None, in `row`); else an empty tuple (and forget a mapping that no longer
        applies)."""
        stale = table.pop(request_id, None)
        if stale is None or stale.start != start or (row is not None and stale.row != row):
            return ()
        return stale.slots
