"""Process-wide state of the vLLM adapter and the seam a driver uses to act inside a step.

One vLLM engine per process is the supported shape (the in-process engine core). The driver
(`kvcanary.app.vllm`, tests, benches) may set `STATE.hooks` before the engine is built: the hooks
object is handed to the canary as its perturber (SPEC §11 seam) and is also called at the two
vLLM-side points a canary perturber cannot reach (before vLLM prepares a forward's inputs, after
the forward). `STATE.bypass` skips the canary on live forwards (canary-off arm of benchmarks).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kvcanary.adapters.vllm.walker import ParentLedger

__all__ = ["STATE", "AdapterCounters", "AdapterState", "RunnerHooks"]


@runtime_checkable
class RunnerHooks(Protocol):
    """vLLM-side injection points (in addition to the canary's `PerturbHooks` methods, which the
    same object implements when it wants them).

    `before_prepare_inputs` runs inside `execute_model` after vLLM applied the scheduler's output
    to its persistent batch and before `_prepare_inputs` copies the block table to the kernels'
    buffers; `after_forward` runs after the canary's last TAIL of that forward.
    """

    def before_prepare_inputs(self, *, runner: Any, step: int) -> None:
        """Edit the runner's persistent batch before inputs are prepared."""
        ...

    def after_forward(self, *, runner: Any, step: int) -> None:
        """Undo or note what `before_prepare_inputs` did."""
        ...


@dataclass
class AdapterCounters:
    """What the adapter saw: forwards checked, steps ended, time spent in canary calls."""

    forwards: int = 0
    steps: int = 0
    skipped_forwards: int = 0
    split_forwards: int = 0
    chunked_prefill_rows: int = 0
    evicted_blocks: int = 0
    canary_seconds: float = 0.0


@dataclass
class AdapterState:
    """Process-wide adapter state (one engine per process)."""

    environ: Mapping[str, str] = field(default_factory=dict)
    ledger: ParentLedger = field(default_factory=ParentLedger)
    pools: list[weakref.ref[Any]] = field(default_factory=list)
    runners: list[weakref.ref[Any]] = field(default_factory=list)
    counters: AdapterCounters = field(default_factory=AdapterCounters)
    hooks: Any = None
    bypass: bool = False
    patched: bool = False
    walker_warned: bool = False

    def reset_counters(self) -> None:
        """Start a new measurement window (the canary's own counters are not touched)."""
        self.counters = AdapterCounters()


STATE = AdapterState()
