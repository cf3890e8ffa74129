"""The prefix-cache walker the canary sweeps (SPEC §2.5)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

__all__ = ["PrefixCacheWalker", "walk_node_slots"]


class PrefixCacheWalker(Protocol):
    """Enumerates every cached slot as `(slot, position, prev_slot)` in full-pool indices.

    The walk is depth-first from the root (depth 0, parent-last -1). `unlocked_only` skips nodes
    held by running requests; `swa_resident_only` skips nodes whose SWA part was evicted. The
    engine guarantees the walk reflects the cache at the moment of the call (`end_step`).

    A walker may also offer (neither is part of the protocol: plain `walk` suffices):

    - `walk_array(*, unlocked_only=False, swa_resident_only=False)`: the same walk as one int64
      NumPy array of shape `[n, 3]`; the canary's sweep then reads it without a Python step
      per slot;
    - `walk_runs(*, unlocked_only=False, swa_resident_only=False)`: the same walk as a
      C-contiguous int64 array of shape `[m, 4]`, rows `(first_slot, first_position,
      prev_slot, length)`, each standing for the entries `(first_slot + j, first_position + j,
      prev_slot if j == 0 else first_slot + j - 1)`, `j < length` (a paged cache's block is one
      run); a small sweep then verifies it without building the `[n, 3]` walk. Preferred over
      `walk_array` when both exist.
    """

    def walk(
        self, *, unlocked_only: bool = False, swa_resident_only: bool = False
    ) -> Iterable[tuple[int, int, int]]:
        """Yield `(slot, position, prev_slot)` for every cached slot."""
        ...


def walk_node_slots(
    slots: Sequence[int], depth: int, parent_last: int
) -> Iterator[tuple[int, int, int]]:
    """The walker entries of one node: `(v[j], depth + j, prev)` with prev the parent's last slot
    for `j = 0` and `v[j-1]` after. Children continue at `depth + len(v)` with parent-last
    `v[-1]` (or the inherited value when `v` is empty)."""
    prev = parent_last
    for j, slot in enumerate(slots):
        yield slot, depth + j, prev
        prev = slot
