"""The seam fault injection plugs into (SPEC §11): when the canary calls a perturber, and the
journal record it keeps. The modes themselves live with the self-test."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvcanary.canary.buffers import GroupBuffers
from kvcanary.contract.view import ForwardView
from kvcanary.contract.walker import PrefixCacheWalker

__all__ = ["BindsCanary", "CanaryState", "PerturbHooks", "PerturbRecord"]


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


class CanaryState(Protocol):
    """The read side of a Canary a perturber needs: step, groups (with their buffers, sources and
    SWA table), the attached prefix-cache walker and whether the chain-position assert is on."""

    @property
    def step(self) -> int:
        """The current engine step."""
        ...

    @property
    def groups(self) -> tuple[GroupBuffers, ...]:
        """Installed groups, FULL first."""
        ...

    @property
    def walker(self) -> PrefixCacheWalker | None:
        """The attached prefix-cache walker, if any."""
        ...

    @property
    def chain_position_assert_enabled(self) -> bool:
        """True after `mark_init_finished()`."""
        ...


@runtime_checkable
class BindsCanary(Protocol):
    """A perturber that needs the canary it is installed into; `install` calls `bind` once."""

    def bind(self, canary: CanaryState) -> None:
        """Remember `canary` (called by `install` right after the Canary is built)."""
        ...
