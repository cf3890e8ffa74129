"""`kvcanary run --host-tier-pages N`: the reference engine with a host tier under its pool.

Wires `engine.host_tier.HostTier` to a built `Stack`: the canary's sidecars travel with every
backup and restore (`canary.CanarySidecars`), and every restore is verified before any forward
reads it. Also the output check every transfer run ends with: each finished request must equal
the no-cache reference (tiny model) or the token oracle (oracle model).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from kvcanary.app.observability import StepObserver
from kvcanary.app.session import RunSettings, RunSummary, Stack, build_stack, run_session
from kvcanary.app.workload import PlannedRequest, build_workload
from kvcanary.canary import CanarySidecars
from kvcanary.contract import NullSidecars, SidecarTransfer, request_key
from kvcanary.engine.host_tier import HostTier
from kvcanary.engine.model import TinyLlama
from kvcanary.engine.reference import greedy_reference
from kvcanary.engine.request import RequestStatus
from kvcanary.engine.transfer_faults import TransferFaults

__all__ = [
    "OutputCheck",
    "attach_host_tier",
    "check_outputs",
    "run_host_tier_session",
    "sidecars_of",
]


def sidecars_of(stack: Stack) -> SidecarTransfer:
    """The stack's canary as a `SidecarTransfer` (nothing travels in mode `none`)."""
    return CanarySidecars(stack.canary) if stack.canary is not None else NullSidecars()


def attach_host_tier(
    stack: Stack, num_pages: int, faults: TransferFaults | None = None
) -> HostTier:
    """Put a host tier of `num_pages` token pages under the stack's pool."""
    kv = stack.engine.scheduler.kv
    host = HostTier(pool=stack.pool, allocator=kv.allocator, radix=kv.prefix_cache,
                    num_pages=num_pages, sidecars=sidecars_of(stack), faults=faults)  # fmt: skip
    kv.attach_host_tier(host)
    return host


@dataclass(frozen=True, slots=True)
class OutputCheck:
    """Finished requests compared with the no-cache reference."""

    compared: int
    mismatched: tuple[str, ...]

    @property
    def identical(self) -> bool:
        """Every finished request matched."""
        return not self.mismatched


def check_outputs(
    stack: Stack,
    planned: Iterable[PlannedRequest],
    outputs: dict[str, tuple[int, ...]] | None = None,
) -> OutputCheck:
    """Compare every finished request with the no-cache greedy reference (tiny model) or the
    token oracle (oracle model). `outputs` overrides where the outputs come from (a decode
    engine in another process); by default the stack's own engine."""
    compared, bad = 0, []
    model = stack.runner.model
    for p in planned:
        if outputs is not None:
            got = outputs.get(p.request_id)
            if got is None:
                continue
        else:
            req = stack.engine.request(p.request_id)
            if req.status is not RequestStatus.FINISHED:
                continue
            got = tuple(req.output)
        if stack.oracle is not None:
            key = request_key(p.request_id)
            start = len(p.prompt)
            want = tuple(stack.oracle.token(key, start + j) for j in range(p.max_new_tokens))
        else:
            assert isinstance(model, TinyLlama)
            want = tuple(greedy_reference(model, p.prompt, p.max_new_tokens))
        compared += 1
        if got != want:
            bad.append(p.request_id)
    return OutputCheck(compared, tuple(bad))


def run_host_tier_session(
    settings: RunSettings,
    num_pages: int,
    progress: Callable[[int, int], None] | None = None,
    *,
    observer: StepObserver | None = None,
) -> RunSummary:
    """`run_session` with a host tier of `num_pages` pages; adds the host counters and the
    output check against the no-cache reference to the figures."""
    stack = build_stack(settings)
    host = attach_host_tier(stack, num_pages)
    summary = run_session(settings, progress, stack=stack, observer=observer)
    check = check_outputs(stack, build_workload(settings.workload))
    s = host.stats
    figures = {
        **summary.figures,
        "host_tier_pages": num_pages,
        "host_backups": s.backups,
        "host_restores": s.restores,
        "host_restored_tokens": s.restored_tokens,
        "host_rejected_restores": s.rejected_restores,
        "outputs_compared": check.compared,
        "outputs_identical": check.identical,
    }
    return replace(summary, figures=figures)
