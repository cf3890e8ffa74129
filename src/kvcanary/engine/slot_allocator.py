"""Token-slot allocator with reference counts (ints only).

A slot is one token's KV entry in the pool. Slot 0 is the "no slot" sentinel (SPEC §2.7) and is
never handed out. Every holder of a slot owns one reference: a running request for each position
in its slot list, the radix cache for each slot stored in its tree. A slot returns to the free
list when its last reference is dropped.

Reuse order is FIFO over the free list, so it is deterministic; an optional `seed` shuffles the
initial free order (still deterministic for a given seed).

`tolerate_unheld` is set only by a fired planted bug (`engine/plants.py`): it makes `incref`,
`decref` and `free` ignore slots that are not held instead of raising, so a deliberately broken
engine keeps serving for the canary to report on.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable

__all__ = ["SlotAllocator"]


class SlotAllocator:
    """Reference-counted allocator over slots `1 .. num_slots - 1`."""

    __slots__ = ("_allocs", "_free", "_num_held", "_refs", "tolerate_unheld")

    def __init__(self, num_slots: int, *, seed: int | None = None) -> None:
        """`num_slots` counts slot 0; `seed` (optional) shuffles the initial free order."""
        if num_slots < 2:
            raise ValueError(
                f"SlotAllocator needs num_slots >= 2 (slot 0 is reserved), got {num_slots}"
            )
        order = list(range(1, num_slots))
        if seed is not None:
            random.Random(seed).shuffle(order)
        self._refs = [0] * num_slots
        self._allocs = [0] * num_slots  # times each slot was handed out
        self._free: deque[int] = deque(order)
        self._num_held = 0
        self.tolerate_unheld = False

    @property
    def num_slots(self) -> int:
        """Total slots, reserved slot 0 included."""
        return len(self._refs)

    @property
    def num_free(self) -> int:
        """Slots available to `alloc`."""
        return len(self._free)

    @property
    def num_held(self) -> int:
        """Slots with at least one reference."""
        return self._num_held

    def refcount(self, slot: int) -> int:
        """Current reference count of `slot` (0 when free)."""
        return self._refs[slot]

    def allocations(self, slot: int) -> int:
        """How many times `alloc` has handed `slot` out (a new owner writes it before reading)."""
        return self._allocs[slot]

    def alloc(self, n: int) -> list[int] | None:
        """`n` fresh slots with one reference each, or None (and no change) if fewer are free."""
        if n < 0:
            raise ValueError(f"SlotAllocator.alloc needs n >= 0, got {n}")
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for slot in out:
            self._refs[slot] = 1
            self._allocs[slot] += 1
        self._num_held += n
        return out

    def incref(self, slots: Iterable[int]) -> None:
        """Add one reference to each (held) slot."""
        for slot in slots:
            if self._check_held(slot, "incref"):
                self._refs[slot] += 1

    def decref(self, slots: Iterable[int]) -> int:
        """Drop one reference from each (held) slot; returns how many slots became free."""
        freed = 0
        for slot in slots:
            if not self._check_held(slot, "decref"):
                continue
            self._refs[slot] -= 1
            if self._refs[slot] == 0:
                self._free.append(slot)
                self._num_held -= 1
                freed += 1
        return freed

    def reuse_first(self, slots: Iterable[int]) -> None:
        """Move these free slots to the front of the free list (LIFO reuse); held ones are
        ignored. Planted bugs use it so freed-but-still-mapped slots are overwritten promptly."""
        wanted = [s for s in slots if self._refs[s] == 0]
        if not wanted:
            return
        chosen = set(wanted)
        rest = [s for s in self._free if s not in chosen]
        self._free = deque([*(s for s in wanted if s in set(self._free)), *rest])

    def free(self, slots: Iterable[int]) -> None:
        """Release slots held exactly once (private slots); a shared slot raises."""
        slots = list(slots)
        for slot in slots:
            if self._check_held(slot, "free") and self._refs[slot] != 1:
                raise ValueError(
                    f"SlotAllocator.free: slot {slot} is shared ({self._refs[slot]} refs)"
                )
        self.decref(slots)

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + held == total - 1, the free list has no duplicate or
        reserved slot, free slots have 0 references and held slots at least 1."""
        free = set(self._free)
        assert len(free) == len(self._free), "free list holds a slot twice"
        assert 0 not in free and self._refs[0] == 0, "reserved slot 0 was handed out"
        held = {s for s in range(1, len(self._refs)) if self._refs[s] > 0}
        assert not free & held, f"slots both free and held: {sorted(free & held)[:8]}"
        assert all(r >= 0 for r in self._refs), "negative reference count"
        assert len(held) == self._num_held, f"held count {self._num_held} != {len(held)}"
        assert len(free) + len(held) == len(self._refs) - 1, (
            f"free {len(free)} + held {len(held)} != total {len(self._refs) - 1}"
        )

    def _check_held(self, slot: int, op: str) -> bool:
        """True when `slot` is held; an unheld slot raises, or returns False under
        `tolerate_unheld`."""
        if not 0 < slot < len(self._refs):
            raise ValueError(f"SlotAllocator.{op}: slot {slot} is outside [1, {len(self._refs)})")
        if self._refs[slot] == 0:
            if self.tolerate_unheld:
                return False
            raise ValueError(f"SlotAllocator.{op}: slot {slot} is not held")
        return True
