"""Modes that rewrite engine metadata before the plan (SPEC §11.2): `req_to_token`,
`double_alloc`, `position_off_by_one` and `swa_lut_tamper`.

Each function runs after its mode's draw fired; it either injects and journals once or logs a
skip. The first three edit the view's own arrays and so skip on an immutable view.
"""

from __future__ import annotations

from kvcanary.canary.buffers import GroupBuffers
from kvcanary.canary.perturb.runner import ModeRunner
from kvcanary.canary.perturb.targets import (
    HALF,
    Entry,
    ViewArrays,
    distinguishable,
    find_group,
    head_record,
    unique_slots,
    verified_entries,
    write_entries,
)
from kvcanary.canary.perturb_seam import CanaryState

__all__ = ["double_alloc", "position_off_by_one", "req_to_token", "swa_lut_tamper"]


def req_to_token(run: ModeRunner, canary: CanaryState, view: ViewArrays, step: int) -> None:
    """Point `req_to_token[row, p]` (p < prefix_len) at another live slot of the active set whose
    HEAD record differs in POSITION or PREV_HASH. Not undone."""
    full = find_group(canary, "full")
    if full is None or not view.mutable:
        run.skip(step, "immutable_view" if full is not None else "no_full_group")
        return
    picked = _pick_remap(run, full, view, step)
    if picked is None:
        return
    target, repl = picked
    view.req_to_token[target.req_row, target.position] = repl.slot
    run.record(
        step=step, slot=repl.slot, position=target.position, group="full",
        req_row=target.req_row, half=HALF, original_slot=target.slot,
    )  # fmt: skip


def double_alloc(run: ModeRunner, canary: CanaryState, view: ViewArrays, step: int) -> None:
    """Hand request B's write entry (out_slots[i] and req_to_token[B, q]) another request's live
    verified slot S_A. FULL group only."""
    full = find_group(canary, "full")
    if full is None or not view.mutable:
        run.skip(step, "immutable_view" if full is not None else "no_full_group")
        return
    writes = write_entries(view, None)
    if not writes:
        run.skip(step, "no_write_entry")
        return
    writer = run.pick(writes)
    others = [e for e in unique_slots(verified_entries(view, full)) if e.req_row != writer.req_row]
    if not others:
        run.skip(step, "no_other_request_slot")
        return
    taken = run.pick(others)
    view.out_slots[writer.index] = taken.slot
    view.req_to_token[writer.req_row, writer.position] = taken.slot
    run.record(
        step=step, slot=taken.slot, position=writer.position, group="full",
        req_row=writer.req_row, half=HALF, displaced_slot=writer.full_slot,
        owner_req_row=taken.req_row, owner_position=taken.position,
    )  # fmt: skip


def position_off_by_one(run: ModeRunner, canary: CanaryState, view: ViewArrays, step: int) -> None:
    """`positions[i] += 1` for one write entry of a linear-chain forward whose row has a seed,
    after `mark_init_finished`, so the chain-position assert sees it."""
    if not view.mutable:
        run.skip(step, "immutable_view")
        return
    if not view.linear_chain:
        run.skip(step, "not_linear_chain")
        return
    if not canary.chain_position_assert_enabled:
        run.skip(step, "init_not_finished")
        return
    table = view.req_to_token
    seeded = [
        e
        for e in write_entries(view, None)
        if 0 < int(view.prefix_lens[e.view_row]) <= table.shape[1]
        and int(table[e.req_row, int(view.prefix_lens[e.view_row]) - 1]) >= 1
    ]
    if not seeded:
        run.skip(step, "no_candidates")
        return
    entry = run.pick(seeded)
    view.positions[entry.index] = entry.position + 1
    run.record(
        step=step, slot=entry.full_slot, position=entry.position, group="full",
        req_row=entry.req_row, half=HALF,
    )  # fmt: skip


def swa_lut_tamper(run: ModeRunner, canary: CanaryState, view: ViewArrays, step: int) -> None:
    """Point `lut[f]` of an in-window full slot at another in-window live SWA slot whose HEAD
    record differs in POSITION or PREV_HASH. Not undone; the FULL group stays silent."""
    swa = find_group(canary, "swa")
    if swa is None or swa.lut is None:
        run.skip(step, "no_swa_group")
        return
    picked = _pick_remap(run, swa, view, step)
    if picked is None:
        return
    target, repl = picked
    swa.lut[target.full_slot] = repl.slot
    run.record(
        step=step, slot=repl.slot, position=target.position, group="swa",
        req_row=target.req_row, half=HALF, full_slot=target.full_slot,
        original_slot=target.slot,
    )  # fmt: skip


def _pick_remap(
    run: ModeRunner, group: GroupBuffers, view: ViewArrays, step: int
) -> tuple[Entry, Entry] | None:
    """A verified entry to remap and a live replacement slot whose HEAD record differs in
    POSITION or PREV_HASH (else the remap would be undetectable by design); None after a skip."""
    entries = verified_entries(view, group)
    if not entries:
        run.skip(step, "no_candidates")
        return None
    target = run.pick(entries)
    original = head_record(group, target.slot)
    replacements = [
        e
        for e in unique_slots(entries)
        if e.slot != target.slot and distinguishable(head_record(group, e.slot), original)
    ]
    if not replacements:
        run.skip(step, "no_distinguishable_replacement")
        return None
    return target, run.pick(replacements)
