"""Process-wide state of the vLLM adapter and the seam a driver uses to act inside a step.

vLLM builds the connectors itself (one per role and process), so a driver in the same process
(`kvcanary.app.vllm`, tests, benches with the in-process engine core) reaches them through
`STATE`: `STATE.hooks` (set before the engine is built) is handed to the canary as its perturber
(SPEC §11 seam) and called after each forward; `STATE.bypass` skips the canary on live forwards
(the canary-off arm of benchmarks); `STATE.connectors` lists the connectors of this process.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kvcanary.adapters.vllm.sweep import ParentLedger

__all__ = ["STATE", "AdapterState", "RunnerHooks"]


@runtime_checkable
class RunnerHooks(Protocol):
    """vLLM-side injection points (in addition to the canary's `PerturbHooks` methods, which the
    same object implements when it wants them).

    `before_prepare_inputs` runs inside `execute_model` after vLLM applied the scheduler's output
    to its persistent batch and before `_prepare_inputs` copies the block table to the kernels'
    buffers (a driver-only patch, `kvcanary.app.vllm.faults`); `after_forward` runs after the
    canary's last TAIL of that forward.
    """

    def before_prepare_inputs(self, *, runner: Any, step: int) -> None:
        """Edit the runner's persistent batch before inputs are prepared."""
        ...

    def after_forward(self, *, runner: Any, step: int) -> None:
        """Undo or note what `before_prepare_inputs` did."""
        ...


@dataclass
class AdapterState:
    """Process-wide adapter state."""

    connectors: list[weakref.ref[Any]] = field(default_factory=list)
    pools: list[weakref.ref[Any]] = field(default_factory=list)
    ledger: ParentLedger = field(default_factory=ParentLedger)
    layout: Any = None
    hooks: Any = None
    bypass: bool = False
    patched: bool = False

    def live_connectors(self) -> list[Any]:
        """The connectors of this process that are still alive."""
        return [c for c in (r() for r in self.connectors) if c is not None]


STATE = AdapterState()
