"""Real-KV byte-flip modes (SPEC §11.2): `real_kv_used`, `real_kv_unused_cache` and
`real_kv_post_forward`.

A flip XORs 0xFF into byte 0 of the target's tile in one randomly chosen hashed K source of the
target group; the slot is group-local, so a FULL slot goes through the SWA table exactly once.
"""

from __future__ import annotations

from kvcanary.canary.buffers import GroupBuffers
from kvcanary.canary.perturb.kvbytes import flip_byte, hashed_k_sources
from kvcanary.canary.perturb.runner import ModeRunner
from kvcanary.canary.perturb.targets import (
    HALF,
    Entry,
    ViewArrays,
    cache_entries,
    swa_extras,
    verified_entries,
    write_entries,
)
from kvcanary.canary.perturb_seam import CanaryState

__all__ = ["real_kv_post_forward", "real_kv_unused_cache", "real_kv_used"]


def _flip_one(
    run: ModeRunner, group: GroupBuffers, entries: list[Entry], step: int, empty_reason: str
) -> None:
    sources = hashed_k_sources(group)
    if not sources:
        run.skip(step, "no_real_kv_source")
        return
    if not entries:
        run.skip(step, empty_reason)
        return
    target = run.pick(entries)
    flip = flip_byte(sources, run.rng.index(len(sources)), target.slot)
    run.record(
        step=step, slot=target.slot, position=target.position, group=group.name,
        req_row=target.req_row, half=HALF, **flip.extras(), **swa_extras(group, target),
    )  # fmt: skip


def real_kv_used(run: ModeRunner, group: GroupBuffers, view: ViewArrays, step: int) -> None:
    """Before the plan: flip a byte of a verified-range slot of an active request (SWA: in
    window), never one this forward writes. Caught by TAIL RKV in the same step."""
    _flip_one(run, group, verified_entries(view, group), step, "no_candidates")


def real_kv_post_forward(run: ModeRunner, group: GroupBuffers, view: ViewArrays, step: int) -> None:
    """After the TAIL write: flip a byte of a slot this forward wrote. Caught at that slot's
    next TAIL verify (or the next sweep)."""
    _flip_one(run, group, write_entries(view, group), step, "no_written_slot")


def real_kv_unused_cache(
    run: ModeRunner, canary: CanaryState, group: GroupBuffers, step: int
) -> None:
    """In `end_step` when a sweep is due: flip a byte of an unlocked cached slot (SWA: resident
    only). Caught by that sweep."""
    walker = canary.walker
    if walker is None:
        run.skip(step, "no_walker")
        return
    _flip_one(run, group, cache_entries(walker, group), step, "no_unlocked_cache_slot")
