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
        incidents: canary incidents (mode `recover`, SPEC §14.3) the scheduler acted on.
        recoveries: recomputes started for requests an incident affected.
        requests_recovered: requests that needed a recompute and then finished normally.
        requests_failed: requests ended with `finish_reason="kv_corruption"` (retry budget spent).
        recompute_tokens: positions whose KV had to be computed again.
        incident_evicted_slots: prefix-cache slots evicted because an incident named them.
        recoveries_completed: recomputes that caught up with where the request had been.
        recovery_latency_steps_total: steps those recomputes took, summed.
        recovery_latency_steps_max: the longest of them.
    """

    retractions: int = 0
    evictions: int = 0
    radix_hit_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_draft_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    tokens_generated: int = 0
    incidents: int = 0
    recoveries: int = 0
    requests_recovered: int = 0
    requests_failed: int = 0
    recompute_tokens: int = 0
    incident_evicted_slots: int = 0
    recoveries_completed: int = 0
    recovery_latency_steps_total: int = 0
    recovery_latency_steps_max: int = 0


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
    incidents: int = 0
    recoveries: int = 0
    requests_recovered: int = 0
    requests_failed: int = 0
    recompute_tokens: int = 0
    incident_evicted_slots: int = 0
    recoveries_completed: int = 0
    recovery_latency_steps_total: int = 0
    recovery_latency_steps_max: int = 0

    def snapshot(self) -> SchedulerStats:
        """The current values as a frozen `SchedulerStats`."""
        return SchedulerStats(**{f.name: getattr(self, f.name) for f in fields(self)})
