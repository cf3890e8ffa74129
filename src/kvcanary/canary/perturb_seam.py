"""The seam fault injection plugs into (SPEC §11): when the canary calls a perturber, and the
journal record it keeps. The modes themselves live with the self-test."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from kvcanary.contract.view import ForwardView

__all__ = ["PerturbHooks", "PerturbRecord"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PerturbRecord:
    """One injection: `slot` is group-local (-1 if unknown), `group` is `full` or `swa`."""

    mode: str
    step: int
    slot: int
    position: int
    group: str
    seed: int
    extras: Mapping[str, object] = field(default_factory=dict)


class PerturbHooks(Protocol):
    """Called by the canary at the points SPEC §2.1 names; each may edit engine or canary state."""

    def before_plan(self, *, view: ForwardView, step: int) -> None:
        """In `pre_forward`, before the plan is built."""
        ...

    def after_tail(self, *, view: ForwardView, step: int) -> None:
        """In `post_forward`, after the TAIL write."""
        ...

    def at_end_step(self, *, step: int, sweep_due: bool) -> None:
        """In `end_step`, before the sweep."""
        ...

    def maybe_swap_next_tokens(self, *, tokens: list[int], step: int) -> list[int]:
        """At sampler exit; returns the tokens to publish."""
        ...

    def injections(self) -> list[PerturbRecord]:
        """The journal, in injection order."""
        ...
