"""Scheduler counters: a mutable tally inside the scheduler, frozen snapshots outside."""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["SchedulerCounters", "SchedulerStats"]


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot of the scheduler's counters (all cumulative since construction).

    Attributes:
        retractions: running requests preempted back to the waiting queue.
        evictions: slots freed by evicting radix-cache leaves.
        radix_hit_tokens: prompt tokens whose KV came from the prefix cache on admission.
        spec_accepted_tokens: speculative drafts accepted.
        spec_draft_tokens: speculative drafts verified.
        requests_finished: requests that reached `max_new_tokens`.
        requests_aborted: requests aborted while waiting or running.
        tokens_generated: output tokens appended (accepted drafts and bonus tokens included).
    """

    retractions: int = 0
    evictions: int = 0
    radix_hit_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_draft_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    tokens_generated: int = 0


@dataclass(slots=True)
class SchedulerCounters:
    """The live tally one scheduler owns; `snapshot()` freezes it."""

    retractions: int = 0
    evictions: int = 0
    radix_hit_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_draft_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    tokens_generated: int = 0

    def snapshot(self) -> SchedulerStats:
        """The current values as a frozen `SchedulerStats`."""
        return SchedulerStats(**{f.name: getattr(self, f.name) for f in fields(self)})
