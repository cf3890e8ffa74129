"""The lifecycle an engine drives (SPEC §2.1). Engines hold a `CanaryHooks`; `NullHooks` is the
default, so an engine never checks whether a canary is installed."""

from __future__ import annotations

from typing import Protocol, final

from kvcanary.contract.incident import Incident
from kvcanary.contract.view import ForwardView
from kvcanary.contract.violation import Violation
from kvcanary.contract.walker import PrefixCacheWalker

__all__ = ["CanaryHooks", "NullHooks"]


class CanaryHooks(Protocol):
    """Calls an engine makes, keyword-only where they take arguments, in this order:

    `mark_init_finished()` once after warm-up; `attach_prefix_cache(walker=...)` once the prefix
    cache exists; then per engine iteration any number of `pre_forward(view=...)` /
    `post_forward(view=...)` pairs followed by exactly one `end_step()`.

    In raise mode `pre_forward`, `post_forward` and `end_step` raise `CanaryViolationError` (a
    RuntimeError) from the call that detected the problem; the engine must not publish that
    forward's tokens. Engine obligations: slot 0 is never allocated, `req_to_token` is
    zero-initialised, and the view exposes the live tables attention uses.
    """

    def mark_init_finished(self) -> None:
        """Warm-up is over: synthetic positions end, the chain-position assert turns on."""
        ...

    def attach_prefix_cache(self, *, walker: PrefixCacheWalker) -> None:
        """Enable sweeps of the prefix cache (and cache-targeted fault injection)."""
        ...

    def pre_forward(self, *, view: ForwardView) -> None:
        """Before the model forward: the engine has allocated `out_slots`, filled `req_to_token`
        for every written position, and no KV of this forward has been written yet."""
        ...

    def post_forward(self, *, view: ForwardView) -> None:
        """After the model forward wrote KV for `out_slots`, before any sampled token is
        published. `view` is the same object passed to `pre_forward`."""
        ...

    def end_step(self) -> None:
        """Once per engine iteration, after its forwards, with no forward open. The prefix cache
        reflects this iteration's inserts and evictions."""
        ...

    def maybe_swap_next_tokens(self, *, tokens: list[int]) -> list[int]:
        """At sampler exit of a non-verify forward: the next token of each sampling row, in
        batch order. Returns the tokens to publish (fault injection may swap two)."""
        ...

    def drain_violations(self) -> list[Violation]:
        """Violations reported since the previous drain, in ring order."""
        ...

    def take_incidents(self) -> list[Incident]:
        """Incidents (mode `recover`, SPEC §14.3) reported since the previous call; the engine
        calls it after `post_forward` and after `end_step` and acts on each."""
        ...


@final
class NullHooks:
    """The no-canary hooks: every call is a no-op."""

    def mark_init_finished(self) -> None:
        """No-op."""

    def attach_prefix_cache(self, *, walker: PrefixCacheWalker) -> None:
        """No-op."""

    def pre_forward(self, *, view: ForwardView) -> None:
        """No-op."""

    def post_forward(self, *, view: ForwardView) -> None:
        """No-op."""

    def end_step(self) -> None:
        """No-op."""

    def maybe_swap_next_tokens(self, *, tokens: list[int]) -> list[int]:
        """Returns `tokens` unchanged."""
        return tokens

    def drain_violations(self) -> list[Violation]:
        """Always empty."""
        return []

    def take_incidents(self) -> list[Incident]:
        """Always empty."""
        return []
