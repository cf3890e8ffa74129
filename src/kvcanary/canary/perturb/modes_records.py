"""Modes that edit canary records or replay stale slot contents (SPEC §11.2): `canary_tamper`,
`stale_prefix` and `late_write`."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcanary.canary.buffers import GroupBuffers
from kvcanary.canary.perturb.kvbytes import (
    SlotImage,
    hashed_k_sources,
    read_image,
    write_image,
    xor_field,
)
from kvcanary.canary.perturb.runner import ModeRunner
from kvcanary.canary.perturb.targets import (
    HALF,
    Entry,
    ViewArrays,
    cache_entries,
    distinguishable,
    head_record,
    swa_extras,
    unique_slots,
    verified_entries,
    write_entries,
)
from kvcanary.canary.perturb_seam import CanaryState

__all__ = ["LateWriteTracker", "canary_tamper", "stale_prefix"]


def canary_tamper(run: ModeRunner, group: GroupBuffers, view: ViewArrays, step: int) -> None:
    """XOR 1 into one field of a verified-range record in the HEAD or TAIL K buffer.

    Fields: POSITION, PREV_HASH, TOKEN (only when `p + 1 < prefix_len`, so a successor checks
    it) and REAL_KV_HASH (TAIL with real data on). Only the tampered stage reports it.
    """
    entries = verified_entries(view, group)
    if not entries:
        run.skip(step, "no_candidates")
        return
    target = run.pick(entries)
    stage = run.pick(("head", "tail"))
    fields = ["position", "prev_hash"]
    if target.position + 1 < int(view.prefix_lens[target.view_row]):
        fields.append("token")
    if stage == "tail" and hashed_k_sources(group):
        fields.append("real_kv_hash")
    name = run.pick(fields)
    xor_field(group, stage, target.slot, name)
    run.record(
        step=step, slot=target.slot, position=target.position, group=group.name,
        req_row=target.req_row, half=HALF, buffer=stage, field=name,
        **swa_extras(group, target),
    )  # fmt: skip


def stale_prefix(
    run: ModeRunner, canary: CanaryState, group: GroupBuffers, view: ViewArrays, step: int
) -> None:
    """After the TAIL write: an unlocked cached slot C receives the records and whole tiles of a
    slot D written this forward (D differs from C in POSITION or PREV_HASH)."""
    walker = canary.walker
    if walker is None:
        run.skip(step, "no_walker")
        return
    written = unique_slots(write_entries(view, group))
    busy = {e.slot for e in written}
    cached = [e for e in cache_entries(walker, group) if e.slot not in busy]
    if not cached:
        run.skip(step, "no_unlocked_cache_slot")
        return
    target = run.pick(cached)
    before = head_record(group, target.slot)
    donors = [d for d in written if distinguishable(head_record(group, d.slot), before)]
    if not donors:
        run.skip(step, "no_distinguishable_source")
        return
    donor = run.pick(donors)
    write_image(group, target.slot, read_image(group, donor.slot, tile_bytes=None))
    run.record(
        step=step, slot=target.slot, position=target.position, group=group.name,
        req_row=donor.req_row, half=HALF, source_slot=donor.slot, **swa_extras(group, target),
    )  # fmt: skip


@dataclass
class LateWriteTracker:
    """Keeps, per written slot, its K records and first 16 tile bytes per K source; when a slot
    is rewritten by a new generation, the injection restores the old image (a stale transfer
    landing after free and reallocation).

    A rewrite is a candidate only when POSITION or PREV_HASH changed: a TOKEN-only change keeps
    the slot's chain link, so CP could not see the stale record at S.
    """

    images: dict[tuple[str, int], SlotImage] = field(default_factory=dict)

    def observe(self, group: GroupBuffers, view: ViewArrays) -> list[tuple[Entry, SlotImage]]:
        """Snapshot this forward's written slots; return rewrites with their previous image."""
        rewrites: list[tuple[Entry, SlotImage]] = []
        for e in unique_slots(write_entries(view, group)):
            now = read_image(group, e.slot)
            old = self.images.get((group.name, e.slot))
            if old is not None and _new_generation(old, now):
                rewrites.append((e, old))
            self.images[group.name, e.slot] = now
        return rewrites

    @staticmethod
    def inject(
        run: ModeRunner,
        group: GroupBuffers,
        rewrites: list[tuple[Entry, SlotImage]],
        step: int,
    ) -> None:
        """Restore one rewritten slot's previous image."""
        if not rewrites:
            run.skip(step, "no_rewritten_slot")
            return
        entry, old = run.pick(rewrites)
        write_image(group, entry.slot, old)
        stale_token, stale_position, _ = old.generation()
        run.record(
            step=step, slot=entry.slot, position=entry.position, group=group.name,
            req_row=entry.req_row, half=HALF, stale_position=stale_position,
            stale_token=stale_token, **swa_extras(group, entry),
        )  # fmt: skip


def _new_generation(old: SlotImage, now: SlotImage) -> bool:
    (_, old_pos, old_prev), (_, pos, prev) = old.generation(), now.generation()
    return old_pos != pos or old_prev != prev
