"""The two processes of `kvcanary run --disaggregate` share these: the options, the result
the decode process sends back, the staging segment's view and a patient receive."""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

from kvcanary.app.session import RunSettings
from kvcanary.contract import Violation
from kvcanary.engine.kv_staging import KvStaging
from kvcanary.engine.transfer_faults import TransferFaultRecord

__all__ = ["WAIT_S", "DisaggOptions", "DisaggResult", "recv", "staging_of"]

WAIT_S = 600.0  # a silent peer for this long means it died (a loaded machine can take minutes to start one)


@dataclass(frozen=True, slots=True)
class DisaggOptions:
    """Knobs of a disaggregated run beyond `RunSettings` (self-test faults, host tier)."""

    staging_pages: int = 1024
    faults: tuple[str, ...] = ()
    fault_seed: int = 0
    fault_warmup_steps: int = 8
    host_tier_pages: int = 0
    transfer_steps: int = 2  # decode steps between reserving a transfer and landing it
    # request ids the client aborts one step after the decode side sent their order (while the
    # transfer is in flight), whatever the workload says: fixtures use it to guarantee the race
    abort_in_flight: tuple[str, ...] = ()
    # the parent's `logging.disable` level, applied in both children (a self-test silences the
    # violations it expects; spawned children do not inherit that)
    log_disable: int = 0


@dataclass(frozen=True, slots=True)
class DisaggResult:
    """What the decode process reports back, plus the prefill side's figures."""

    figures: dict[str, Any]
    outputs: dict[str, tuple[int, ...]]
    violations: tuple[Violation, ...]
    prefill_violations: tuple[Violation, ...]
    journal: tuple[TransferFaultRecord, ...]
    stopped_by_raise: bool


def staging_of(shm: SharedMemory, settings: RunSettings, pages: int) -> KvStaging:
    """The staging pages of the shared segment `shm`, shaped for `settings.model`."""
    m = settings.model
    return KvStaging(shm.buf, num_pages=pages, num_layers=m.num_layers, heads=m.num_kv_heads,
                     dim=m.head_dim, dtype=m.torch_dtype)  # fmt: skip


def recv(conn: Connection, what: str) -> Any:
    """The next message from the peer `what`; RuntimeError after `WAIT_S` of silence."""
    if not conn.poll(WAIT_S):
        raise RuntimeError(f"kvcanary disaggregate: no message from the {what} for {WAIT_S}s")
    return conn.recv()
