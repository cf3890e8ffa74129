"""The driver's line into the canary wherever vLLM runs it: a worker extension for
`collective_rpc`.

vLLM builds the canary inside its worker (the engine-core child process by default, one worker
process per rank with tensor parallelism), so a driver cannot hold it. `LLM(...,
worker_extension_cls=RPC_EXTENSION)` mixes `CanaryRpc` into vLLM's worker class (vLLM's
sanctioned way to add `collective_rpc` methods); `LLM.collective_rpc("kvcanary_...")` then runs
them in every worker process, in-process engine core or not, and returns one result per rank.
Results are plain ints, strings, lists and dicts (vLLM's msgpack carries them across processes
without insecure serialization). The fault injector lives with the canary it arms; on a
single-rank engine that is also the scheduler's process, where `stale_prefix_hit` patches the
block pool.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvcanary.adapters.vllm.state import STATE
from kvcanary.app.selftest.correlate import Fault
from kvcanary.contract import Violation

__all__ = ["RPC_EXTENSION", "CanaryRpc", "fault_from_wire", "violation_from_wire"]

#: `worker_extension_cls` value naming `CanaryRpc`
RPC_EXTENSION = "kvcanary.app.vllm.rpc.CanaryRpc"


def _workers() -> list[Any]:
    return [c.worker for c in STATE.live_connectors() if c.worker is not None
            and c.worker.canary is not None]  # fmt: skip


def _worker() -> Any:
    workers = _workers()
    if not workers:
        raise RuntimeError("kv-canary: no canary installed in this vLLM worker (see its log)")
    return workers[-1]


def violation_to_wire(v: Violation) -> dict[str, Any]:
    """A violation as plain fields."""
    return dataclasses.asdict(v)


def violation_from_wire(d: dict[str, Any]) -> Violation:
    """The inverse of `violation_to_wire`."""
    return Violation(**d)


def fault_to_wire(f: Fault) -> dict[str, Any]:
    """A fault as plain fields (sets as sorted lists)."""
    d = dataclasses.asdict(f)
    d["slots"], d["positions"] = sorted(f.slots), sorted(f.positions)
    d["follow_steps"] = list(f.follow_steps)
    return d


def fault_from_wire(d: dict[str, Any]) -> Fault:
    """The inverse of `fault_to_wire`."""
    return Fault(**{**d, "slots": frozenset(d["slots"]), "positions": frozenset(d["positions"]),
                    "follow_steps": tuple(d["follow_steps"])})  # fmt: skip


class CanaryRpc:
    """`collective_rpc` methods mixed into vLLM's worker (names start with `kvcanary_` so they
    never clash with the worker's own)."""

    def kvcanary_attach_injector(self) -> int:
        """Give this process's canary a `VllmFaultInjector` (and the driver-only
        `_prepare_inputs` hook it needs); the canary's current step."""
        from kvcanary.app.vllm.faults import VllmFaultInjector, install_prepare_inputs_hook

        w = _worker()
        if not isinstance(w.hooks, VllmFaultInjector):
            install_prepare_inputs_hook()
            w.attach_hooks(VllmFaultInjector())
        return int(w.canary.step)

    def kvcanary_arm(self, mode: str, seed: int, steps_ahead: int) -> int:
        """Arm `mode` to fire once at or after `steps_ahead` canary steps from now; that step."""
        w = _worker()
        first = int(w.canary.step) + steps_ahead
        w.hooks.arm(mode, seed=seed, first_step=first)
        return first

    def kvcanary_disarm(self, sweep_interval: int) -> list[dict[str, Any]]:
        """Stop injecting; the run's faults, ready for correlation."""
        w = _worker()
        w.hooks.disarm()
        return [fault_to_wire(f) for f in w.hooks.faults(sweep_interval=sweep_interval)]

    def kvcanary_drain(self) -> dict[str, Any]:
        """Violations since the previous drain, with this worker's counters."""
        w = _worker()
        return {
            "violations": [violation_to_wire(v) for v in w.drain_violations()],
            "step": int(w.canary.step),
            "canary_seconds": float(w.canary_seconds),
            "split_forwards": int(w.split_forwards),
            "chunked_prefill_rows": int(w.chunked_prefill_rows),
            "recorded": int(w.canary.total_violations),
        }
