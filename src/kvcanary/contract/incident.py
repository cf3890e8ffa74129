"""Incidents: what mode `recover` hands the engine after each reporting call (SPEC §14.3).

An incident is one launch tag's violations from one reporting call (`pre_forward`,
`post_forward` or `end_step`), already attributed to the view rows (requests) they concern. It
is engine-neutral: view rows index the `ForwardView` of the forward that produced it, slots are
full-pool slots (the indices the engine allocates), positions are sequence positions.

Attribution rules:

| violation row | belongs to |
|---|---|
| verify (HEAD/TAIL) | the view row whose verify plan produced the failing entry |
| write-input, chain-position | the view row of the write entry |
| SWEEP | no view row; only its cached slots |

An engine acting on an incident (SPEC §14.3 obligations): discard the affected rows' samples of
that forward, recompute each affected request from `first_position` into freshly allocated slots
(or fail it), and evict `slots` and every prefix-cache node at or below them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvcanary.contract.tags import FailReason, fail_reason_labels, tag_name

__all__ = ["Incident", "IncidentRow", "IncidentSource"]


@dataclass(frozen=True, slots=True, kw_only=True)
class IncidentRow:
    """One affected request of an incident.

    Attributes:
        view_row: index of the request in the forward's `ForwardView` (its batch row).
        req_row: its `req_to_token` row.
        first_position: the first sequence position whose KV (or, for a `write_token` row, whose
            input token) failed; the request must be recomputed from here. For write rows this
            is `prefix_len + entry index`, not the (possibly corrupted) written position.
        slots: the full-pool slots of this row's failing entries, ascending.
        fail_reason_bits: OR of this row's violation bits.
    """

    view_row: int
    req_row: int
    first_position: int
    slots: tuple[int, ...]
    fail_reason_bits: int

    @property
    def bad_input_token(self) -> bool:
        """True when a written input token itself was wrong (`write_token`): the token at
        `first_position` must be sampled again, not only its KV recomputed."""
        return bool(self.fail_reason_bits & FailReason.WRITE_TOKEN_MISMATCH)

    def as_json(self) -> dict[str, object]:
        """A JSON-ready dict."""
        return {
            "view_row": self.view_row,
            "req_row": self.req_row,
            "first_position": self.first_position,
            "slots": list(self.slots),
            "reasons": fail_reason_labels(self.fail_reason_bits),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Incident:
    """One tag's violations from one reporting call, attributed to requests.

    Attributes:
        stage: `head`, `tail` or `sweep`.
        tag: the launch tag value (SPEC §5.4).
        step: the canary step of the reporting call (`step_when_pumped` of its rows).
        violations: how many violation rows it covers (every one, whether or not the ring had
            room for its details).
        fail_reason_bits: OR of the rows' bits.
        slots: every failing full-pool slot, ascending.
        rows: the affected requests, in view order (empty for SWEEP).
    """

    stage: str
    tag: int
    step: int
    violations: int
    fail_reason_bits: int
    slots: tuple[int, ...]
    rows: tuple[IncidentRow, ...] = ()

    @property
    def tag_name(self) -> str:
        """`HEAD_K_FULL` etc."""
        return tag_name(self.tag)

    @property
    def reasons(self) -> list[str]:
        """Fail-reason labels in ascending bit order."""
        return fail_reason_labels(self.fail_reason_bits)

    def as_json(self) -> dict[str, object]:
        """The structured record written as one JSON object per incident (SPEC §14.3)."""
        return {
            "stage": self.stage,
            "launch_tag": self.tag_name,
            "step": self.step,
            "violations": self.violations,
            "reasons": self.reasons,
            "slots": list(self.slots),
            "rows": [r.as_json() for r in self.rows],
        }


@runtime_checkable
class IncidentSource(Protocol):
    """What a canary in mode `recover` offers besides `CanaryHooks`."""

    def take_incidents(self) -> list[Incident]:
        """Incidents reported since the previous call, oldest first (empty outside `recover`)."""
        ...
