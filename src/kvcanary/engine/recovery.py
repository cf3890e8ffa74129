"""Acting on canary incidents (SPEC §14.3, mode `recover`): which requests, and from where.

Pure functions on ints; the scheduler applies them. An incident names view rows (the chunk
indices of the forward's `StepPlan`), a first failing position per row and failing slots.

For an affected request with first failing position `p`:

| what | rule |
|---|---|
| samples of the affected forward | discarded (never applied, never returned) |
| tokens kept | positions `[0, max(prompt_len, p + 1))`; only `[0, p)` when the token at `p` itself was wrong (`write_token`) |
| KV kept | positions `[0, min(p, num_computed))`, one earlier when the token at `p` must be sampled again |
| slots from there on | released by the request and recomputed into freshly allocated slots |
| failing slots | cut out of the prefix cache with every node below them |
| retry budget | after `recovery_retries` recomputes, the next incident fails the request |
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvcanary.contract.incident import Incident

__all__ = ["RecoveryPoint", "RowDamage", "damage_by_chunk", "failing_slots", "recovery_point"]


@dataclass(frozen=True, slots=True)
class RowDamage:
    """What the incidents of one forward say about one chunk."""

    first_position: int
    bad_input_token: bool
    reasons_bits: int
    slots: frozenset[int] = frozenset()  # failing slots named for this chunk


@dataclass(frozen=True, slots=True)
class RecoveryPoint:
    """Where a request restarts: keep `keep_tokens` of its sequence and the KV of
    `keep_computed` positions."""

    keep_tokens: int
    keep_computed: int


def damage_by_chunk(incidents: Iterable[Incident], num_chunks: int) -> dict[int, RowDamage]:
    """Chunk index -> the earliest damage over all incidents (rows outside the plan ignored)."""
    out: dict[int, RowDamage] = {}
    for incident in incidents:
        for row in incident.rows:
            if not 0 <= row.view_row < num_chunks:
                continue
            old = out.get(row.view_row)
            pos, bad = row.first_position, row.bad_input_token
            if old is not None:
                if old.first_position < pos:
                    pos, bad = old.first_position, old.bad_input_token
                elif old.first_position == pos:
                    bad = bad or old.bad_input_token
            bits = row.fail_reason_bits | (old.reasons_bits if old is not None else 0)
            slots = frozenset(row.slots) | (old.slots if old is not None else frozenset())
            out[row.view_row] = RowDamage(pos, bad, bits, slots)
    return out


def failing_slots(incidents: Iterable[Incident]) -> list[int]:
    """Every failing slot the incidents name, ascending."""
    return sorted({s for incident in incidents for s in incident.slots if s > 0})


def recovery_point(
    *, prompt_len: int, seq_len: int, num_computed: int, position: int, bad_input_token: bool
) -> RecoveryPoint:
    """The restart point of a request damaged from `position` on (see the module table).

    Always leaves at least one token to compute, so the recompute ends in a sample."""
    position = max(0, position)
    sampled_again = bad_input_token and position >= prompt_len
    keep = min(seq_len, max(prompt_len, position if sampled_again else position + 1))
    computed = min(position - 1 if sampled_again else position, num_computed, keep - 1)
    return RecoveryPoint(keep_tokens=keep, keep_computed=max(0, computed))
