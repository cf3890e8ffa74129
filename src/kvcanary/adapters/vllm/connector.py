"""`KVCanaryConnector`: the canary as a vLLM 0.32 KV connector (v1 API, both halves).

Enable it with::

    --kv-transfer-config '{"kv_connector":"KVCanaryConnector",
                           "kv_connector_module_path":"kvcanary.adapters.vllm",
                           "kv_role":"kv_both",
                           "kv_connector_extra_config":{"mode":"log"}}'

(or `KVCANARY_MODE=log|raise`, which makes the plugin add exactly that). vLLM builds one connector
per process role, in every process layout (in-process engine core, the default multiprocess
engine core, one worker per rank):

- worker: `register_kv_caches` installs the canary over the real caches (layout calibrated
  through the backend's own write op); `start_load_kv` runs HEAD before the forward (the scheduler
  half marks every step `has_sync_kv_loads`, so vLLM calls it before the model, not after);
  `wait_for_save` runs TAIL after the model and before sampling, then the end of the canary step
  (sweep when due); `build_connector_worker_meta` and `get_kv_connector_stats` carry figures back.
- scheduler: `bind_gpu_block_pool` keeps the scheduler's `BlockPool` (and records block
  provenance as blocks are cached); `build_connector_meta` ships a snapshot of the cached blocks on
  the steps the worker sweeps; `update_connector_output` receives the workers' summaries.
- `build_prom_metrics`: `kvcanary_*` counters on vLLM's `/metrics` (API-server process).
- `get_block_ids_with_load_errors` (mode `recover`): the blocks of requests whose HEAD or TAIL
  failed, so vLLM drops their tokens of this step; `bind_kv_cache_manager` wraps the scheduler so
  the damaged requests resume into fresh blocks (`kvcanary.adapters.vllm.recover`).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvcanary.adapters.vllm.callers import calling_instance
from kvcanary.adapters.vllm.install import config_from
from kvcanary.adapters.vllm.pd_sidecar import ExampleSidecars, find_example_sibling
from kvcanary.adapters.vllm.recover import (
    Damage,
    SchedulerRecovery,
    calling_scheduler,
    worker_damage,
)
from kvcanary.adapters.vllm.state import STATE
from kvcanary.adapters.vllm.sweep import BlockSnapshot, ParentLedger, snapshot_pool

if TYPE_CHECKING:
    import torch

    from kvcanary.adapters.vllm.worker import CanaryWorker

__all__ = ["VIOLATION_REASONS", "DriverMessage", "KVCanaryConnector", "KVCanaryStats"]

logger = logging.getLogger("kvcanary")

VIOLATION_TAGS = ("HEAD_K_FULL", "HEAD_V_FULL", "TAIL_K_FULL", "TAIL_V_FULL", "SWEEP_K_FULL",
                  "SWEEP_V_FULL")  # fmt: skip
#: scheduler-side counters of mode `recover` (`kvcanary_<name>_total` on /metrics)
RECOVER_COUNTERS = ("incidents", "recoveries", "recompute_tokens", "requests_failed")
VIOLATION_REASONS = ("verify_chain_hash", "verify_position", "verify_real_kv_hash",
                     "write_token", "write_position", "verify_token")  # fmt: skip


@dataclass
class CanaryStepMeta(KVConnectorMetadata):
    """Scheduler -> worker, one per step: the cached blocks to sweep (on sweep steps), and the
    scheduler-side driver agents' messages for the worker's hooks (`driver`)."""

    snapshot: BlockSnapshot | None = None
    driver: list[Any] = field(default_factory=list)


@dataclass
class CanaryWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, one per step (summed over ranks): this step's violation counts, and
    the worker hooks' messages for the scheduler's process (`driver`, see `DriverMessage`)."""

    violations: dict[str, int] = field(default_factory=dict)
    forwards: int = 0
    driver: list[Any] = field(default_factory=list)
    damage: tuple[tuple[str, int, int], ...] = ()  # mode recover: (req id, position, block index)
    sweep_blocks: tuple[int, ...] = ()  # mode recover: cached blocks a SWEEP found bad
    landed: tuple[str, ...] = ()  # mode recover: requests whose landed KV failed its verify

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Sum the ranks' counts (each rank checks its own KV shard); keep every message."""
        assert isinstance(other, CanaryWorkerMeta)
        merged = Counter(self.violations)
        merged.update(other.violations)
        return CanaryWorkerMeta(dict(merged), self.forwards + other.forwards,
                                [*self.driver, *other.driver], (*self.damage, *other.damage),
                                tuple(sorted({*self.sweep_blocks, *other.sweep_blocks})),
                                tuple(sorted({*self.landed, *other.landed})))  # fmt: skip


@runtime_checkable
class DriverMessage(Protocol):
    """A message a driver's worker-side hooks (`outbox()`) send to the scheduler's process, which
    may be another process (picklable). The scheduler half calls `deliver(connector)`; an agent
    it leaves in `connector.agents` (name -> object) is asked for `outbox()` each step (its
    messages reach the worker's hooks through `inbox(messages)` before that step's HEAD) and
    `reset()` on vLLM's `reset_prefix_cache(reset_connector=True)`. Drivers (fault campaigns)
    use it to plant scheduler bugs; the plugin itself sends none."""

    def deliver(self, connector: Any) -> None:
        """Act in the scheduler's process."""
        ...


@dataclass
class KVCanaryStats(KVConnectorStats):
    """`data = {"forwards", "checks", "sweeps": int, "violations": {"TAG|reason": int}}`,
    deltas since the previous report."""

    def reset(self) -> None:
        """Start a new interval."""
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Sum two intervals (or two ranks)."""
        out: dict[str, Any] = {k: int(self.data.get(k, 0)) + int(other.data.get(k, 0))
                               for k in ("forwards", "checks", "sweeps", *RECOVER_COUNTERS)}  # fmt: skip
        v: Counter[str] = Counter(self.data.get("violations", {}))
        v.update(other.data.get("violations", {}))
        out["violations"] = dict(v)
        return KVCanaryStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        """Totals for vLLM's periodic "KV Transfer metrics" log line."""
        v = self.data.get("violations", {})
        return {"kvcanary_forwards": int(self.data.get("forwards", 0)),
                "kvcanary_checks": int(self.data.get("checks", 0)),
                "kvcanary_sweeps": int(self.data.get("sweeps", 0)),
                "kvcanary_violations": int(sum(v.values()))}  # fmt: skip

    def is_empty(self) -> bool:
        """No figures in this interval."""
        return not any(self.data.get(k) for k in ("forwards", "checks", "sweeps", "violations",
                                                  *RECOVER_COUNTERS))  # fmt: skip


class KVCanaryPromMetrics(KVConnectorPromMetrics):
    """`kvcanary_forwards_total`, `kvcanary_checks_total` (protected-slot checks),
    `kvcanary_sweeps_total`, `kvcanary_violations_total{tag,reason}`; every series exists (at 0)
    from the start."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:  # fmt: skip
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = list(labelnames)
        c = self._counter_cls
        self._plain = {
            key: c(name=f"kvcanary_{key}", documentation=doc, labelnames=names)
            for key, doc in (
                ("forwards", "Forwards the kvcanary checked (HEAD and TAIL)."),
                ("checks", "KV slot checks the kvcanary ran (HEAD, TAIL, sweep)."),
                ("sweeps", "Sweeps of vLLM's prefix cache by the kvcanary."),
                ("incidents", "Damaged requests the kvcanary recover mode acted on."),
                ("recoveries", "Recomputes into fresh blocks (kvcanary recover mode)."),
                ("recompute_tokens", "Positions recomputed after kvcanary incidents."),
                ("requests_failed", "Requests ended with an error by kvcanary recover mode."),
            )
        }
        self._violations = c(name="kvcanary_violations",
                             documentation="KV-cache violations the kvcanary reported.",
                             labelnames=[*names, "tag", "reason"])  # fmt: skip
        # The labelled children, looked up once (`labels()` takes a lock and builds a key: tens
        # of microseconds per step when done for every counter on every engine step).
        self._children: dict[int, dict[str, Any]] = {}
        self._violation_children: dict[int, dict[tuple[str, str], Any]] = {}
        for idx, values in per_engine_labelvalues.items():
            self._children[idx] = {k: ctr.labels(*values) for k, ctr in self._plain.items()}
            self._violation_children[idx] = {
                (tag, reason): self._violations.labels(*values, tag, reason)
                for tag in VIOLATION_TAGS
                for reason in VIOLATION_REASONS
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one interval's deltas."""
        children = self._children.get(engine_idx)
        if children is None:
            return
        for key, child in children.items():
            n = transfer_stats_data.get(key)
            if n:
                child.inc(int(n))
        violations = transfer_stats_data.get("violations")
        if not violations:
            return
        known = self._violation_children[engine_idx]
        values = self.per_engine_labelvalues[engine_idx]
        for key, n in violations.items():
            tag, _, reason = str(key).partition("|")
            child = known.get((tag, reason))
            if child is None:  # a label pair outside the pre-created set: still counted
                child = known[tag, reason] = self._violations.labels(*values, tag, reason)
            child.inc(int(n))


def _calling_runner() -> Any:
    """The model runner whose `initialize_kv_cache` is calling `register_kv_caches` (vLLM hands
    the connector the caches but not the runner whose persistent batch describes each forward)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return calling_instance(GPUModelRunner)


class KVCanaryConnector(KVConnectorBase_V1, SupportsHMA):
    """The kvcanary inside vLLM (see the module docstring). Loads nothing, saves nothing."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config = config_from(os.environ, extra)
        self.worker: CanaryWorker | None = None
        self.sidecars: ExampleSidecars | None = None  # beside an ExampleConnector (PD)
        self.invalid_block_ids: set[int] = set()
        self.landing_failed: set[str] = set()  # mode recover: requests with a bad landing
        # scheduler half
        self._pool: Any = None
        self.ledger = ParentLedger()
        self._forward_steps = 0
        self.violations_seen: Counter[str] = Counter()
        self.agents: dict[str, Any] = {}  # scheduler-side driver agents (see DriverMessage)
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        self._block_size = int(groups[0].kv_cache_spec.block_size) if groups else 0
        self.recovery = SchedulerRecovery(ledger=self.ledger) if self.config.recover else None
        self._damage: CanaryWorkerMeta | None = None
        STATE.connectors.append(weakref.ref(self))

    # ------------------------------------------------------------------ worker half
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Install the canary over the real caches."""
        from kvcanary.adapters.vllm.worker import CanaryWorker

        if not self.config.enabled:
            return
        runner = _calling_runner()
        if runner is None:
            logger.warning("kv-canary: register_kv_caches was not called by a vLLM model "
                           "runner; canary off")  # fmt: skip
            return
        worker = CanaryWorker(runner, self.config, hooks=STATE.hooks)
        if worker.install(kv_caches) is not None:
            self.worker = worker
            STATE.layout = worker.layout
            sibling = find_example_sibling()
            if sibling is not None:  # PD over shared storage: the records ride the KV
                self.sidecars = ExampleSidecars(sibling, kv_caches)
                logger.info("kv-canary: sidecars ride ExampleConnector's storage (%s)",
                            getattr(sibling, "_storage_path", "?"))  # fmt: skip

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """HEAD for this forward (called before the model; nothing is loaded)."""
        w = self.worker
        if w is None or getattr(forward_context, "attn_metadata", None) is None:
            return
        meta = self._connector_metadata
        if isinstance(meta, CanaryStepMeta) and meta.driver and hasattr(w.hooks, "inbox"):
            w.hooks.inbox(meta.driver)
        if self.sidecars is not None:  # ExampleConnector, called before us, has landed its KV
            failed = self._raising(self.sidecars.land, w)
            if self.config.recover and failed:
                # vLLM's own load-error path: the request drops this step's tokens; our
                # scheduler half then recomputes it from its tokens (or fails it)
                self.invalid_block_ids |= failed
                self.landing_failed |= {
                    str(rid) for rid, state in w.runner.requests.items()
                    if failed.intersection(state.block_ids[0])
                }  # fmt: skip
        try:  # `_raising`, inline: a call less on every forward
            w.before_forward(getattr(forward_context, "slot_mapping", None))
        except Exception as exc:
            self._stopping(exc)
            raise

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing is loaded."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        """Nothing is saved."""

    def wait_for_save(self) -> None:
        """TAIL after the model, before sampling; then the canary's end of step."""
        w = self.worker
        if w is None:
            return
        meta = self._connector_metadata
        snapshot = meta.snapshot if isinstance(meta, CanaryStepMeta) else None
        if snapshot is not None and snapshot.block_size != w.block_size:
            snapshot = None  # scheduler and kernel block sizes differ: no sweep this step
        try:  # `_raising`, inline
            w.after_forward(snapshot)
        except Exception as exc:
            self._stopping(exc)
            raise
        if self.sidecars is not None:  # after TAIL: the records of what ExampleConnector saved
            self.sidecars.export(w)

    def _raising(self, fn: Any, arg: Any) -> Any:
        """`fn(arg)`; an exception goes on after `_stopping` saw it."""
        try:
            return fn(arg)
        except Exception as exc:
            self._stopping(exc)
            raise

    def _stopping(self, exc: Exception) -> None:
        """A hook raised `exc`: when it is raise mode's violation, log why vLLM stops (with
        the requests of the forward) and leave the stop note; anything else passes unseen."""
        # imported on a violation only: a hook's clean path runs no import machinery
        from kvcanary.adapters.vllm.plugin import write_stop_note
        from kvcanary.canary import CanaryViolationError

        if not isinstance(exc, CanaryViolationError):
            return
        first = str(exc).splitlines()[0]
        reqs = self.worker.running_requests() if self.worker is not None else []
        if reqs:
            first += "; vLLM request(s): " + ", ".join(reqs)
        logger.error("kv-canary: raise mode stops vLLM: %s", first)
        write_stop_note(first)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Mode `recover`: the blocks of the requests this forward's incidents name (vLLM then
        drops their tokens of this step); the damage itself goes with the worker meta."""
        out, self.invalid_block_ids = self.invalid_block_ids, set()
        landed, self.landing_failed = self.landing_failed, set()
        w = self.worker
        if self.config.recover and w is not None and w.canary is not None:
            found = worker_damage(w)
            # a bad landing damages its whole request, from position 0
            damage = [d for d in found.damage if d.req_id not in landed]
            damage += [Damage(rid, 0, 0) for rid in sorted(landed)]
            if damage or found.sweep_blocks:
                self._damage = CanaryWorkerMeta(
                    damage=tuple((d.req_id, d.first_position, d.block_index) for d in damage),
                    sweep_blocks=tuple(sorted(found.sweep_blocks)),
                    landed=tuple(sorted(landed)),
                )
            out |= found.report_blocks
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This step's violation counts (and, in mode `recover`, damage) for the scheduler."""
        damage, self._damage = self._damage, None
        w = self.worker
        if w is None:
            return damage
        driver = list(w.hooks.outbox()) if hasattr(w.hooks, "outbox") else []
        if not w.figures.violations and not driver and damage is None:
            return None
        meta = CanaryWorkerMeta(dict(w.figures.violations), w.figures.forwards, driver)
        if damage is not None:
            meta.damage, meta.sweep_blocks = damage.damage, damage.sweep_blocks
            meta.landed = damage.landed
        return meta

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Deltas for /metrics and vLLM's log (None when nothing happened); the scheduler half
        reports mode `recover`'s counters."""
        w = self.worker
        if w is None and self.recovery is not None:
            data = self.recovery.take_counters()
            return KVCanaryStats(data=data) if any(data.values()) else None
        if w is None or w.figures.is_empty():
            return None
        return KVCanaryStats(data=w.figures.drain())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """Rebuild stats on the logger's side."""
        return KVCanaryStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:  # fmt: skip
        """The `kvcanary_*` counters."""
        return KVCanaryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ scheduler half
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """vLLM's binding (then `bind_gpu_block_pool`); mode `recover` also wraps the
        scheduler being built so damaged requests resume into fresh blocks."""
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.recovery is not None:
            self.recovery.bind(calling_scheduler())

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Keep the scheduler's pool and record each block's provenance as it is cached."""
        self._pool = gpu_block_pool
        STATE.pools.append(weakref.ref(gpu_block_pool))
        STATE.ledger = self.ledger
        ledger = self.ledger
        pool_cls = type(gpu_block_pool)

        def cache_full_blocks(request: Any, blocks: Any, num_cached_blocks: int,
                              num_full_blocks: int, *args: Any, **kw: Any) -> Any:  # fmt: skip
            # the class attribute at call time (a driver may patch the class later)
            out = pool_cls.cache_full_blocks(gpu_block_pool, request, blocks, num_cached_blocks,
                                             num_full_blocks, *args, **kw)  # fmt: skip
            ledger.note_cached(blocks, num_cached_blocks, num_full_blocks)
            return out

        gpu_block_pool.cache_full_blocks = cache_full_blocks

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:  # fmt: skip
        """Nothing external to load."""
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:  # fmt: skip
        """Nothing to track."""

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Mark the step as having a synchronous load (so the worker runs HEAD before the
        forward) and attach the cached blocks when the worker's canary sweeps this step."""
        meta = CanaryStepMeta()
        if not self.config.enabled:
            return meta
        for agent in self.agents.values():
            meta.driver.extend(agent.outbox())
        scheduler_output.has_sync_kv_loads = True
        if int(getattr(scheduler_output, "total_num_scheduled_tokens", 0)) <= 0 or STATE.bypass:
            return meta  # no canary step this forward (no forward, or a bench's canary-off arm)
        step, self._forward_steps = self._forward_steps, self._forward_steps + 1
        interval = self.config.sweep_interval
        if interval > 0 and step % interval == 0 and self._pool is not None:
            meta.snapshot = snapshot_pool(self._pool, self.ledger, self._block_size)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Count the workers' reported violations (scheduler side)."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, CanaryWorkerMeta):
            self.violations_seen.update(meta.violations)
            for message in meta.driver:
                message.deliver(self)

    def reset_cache(self) -> bool:
        """vLLM's `reset_prefix_cache(reset_connector=True)`: reset the driver agents."""
        for agent in self.agents.values():
            agent.reset()
        self.agents.clear()
        return True

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        """Blocks are freed as usual; mode `recover` tells the client how often the request was
        recomputed (`kvcanary_recomputes` in its `kv_transfer_params`)."""
        if self.recovery is None:
            return False, None
        return False, self.recovery.finished(str(request.request_id))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        """As `request_finished` (hybrid allocator)."""
        return self.request_finished(request, [])
