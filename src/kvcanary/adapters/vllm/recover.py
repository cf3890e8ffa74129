"""Mode `recover` inside vLLM 0.32 (SPEC §14.3, last item): incidents become vLLM's own recompute.

Worker half (`damage_of`): after HEAD and TAIL of a forward, each canary incident row names a
batch row (`req_row - 1`) and its first failing position `p`. The request's own last block (the
one this forward wrote into; from the runner's per-request block list, never from the persistent
batch's table, which a fault may have pointed elsewhere) goes to vLLM through
`get_block_ids_with_load_errors`, so vLLM drops the request's tokens of this step without
touching other holders of the bad block; the precise damage (request id, first failing position,
its block index) and the blocks a SWEEP found bad ride `build_connector_worker_meta` to the
scheduler.

Scheduler half (`SchedulerRecovery`), on the scheduler instance the connector is bound to:

| step of `Scheduler.update_from_output` | what happens |
|---|---|
| before vLLM's own code | the damage of this step is taken from the worker meta |
| `_handle_invalid_blocks` (vLLM) | drops the step's tokens of every request holding a reported block in its computed prefix and truncates (`recompute`) or fails (`fail`) them |
| our wrapper around it | every damaged request joins the skip set (also one vLLM's prefix rule misses: a TAIL failure in a block written this step, or a first prefill chunk); its blocks from the first bad one on leave the prefix cache; it is preempted, so it resumes into freshly allocated blocks (vLLM's recompute would rewrite the block in place, and in the stale-prefix class that block belongs to another request); past the retry budget (or under `fail`) it ends with `finish_reason` `error` |
| SWEEP blocks | evicted with every ledger descendant |
| an async load vLLM's own rule marks failed (a host-tier restore the canary rejected) | the request retries with `skip_reading_prefix_cache`: it recomputes instead of loading the same pages again |

So no token sampled in a forward whose HEAD or TAIL failed for a request reaches the client,
the request never writes into a block it was wrongly handed, and a bug that keeps corrupting ends
in a per-request error after `retries` recomputes. The wrapped names are pinned by a signature
test (tests/adapters/test_vllm_hooks.py) and listed in docs/architecture.md.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcanary.adapters.vllm.callers import calling_instance
from kvcanary.contract import Incident

__all__ = [
    "DEFAULT_RETRIES",
    "Damage",
    "RecoveryFigures",
    "SchedulerRecovery",
    "calling_scheduler",
    "damage_of",
    "worker_damage",
]

logger = logging.getLogger("kvcanary")

#: recomputes a request may take before it fails (SPEC §14.3 default)
DEFAULT_RETRIES = 2


@dataclass(frozen=True, slots=True)
class Damage:
    """One request a forward's incidents name: recompute from block `block_index` on."""

    req_id: str
    first_position: int
    block_index: int


@dataclass
class WorkerDamage:
    """What one forward's incidents say, in vLLM's terms."""

    damage: list[Damage] = field(default_factory=list)
    report_blocks: set[int] = field(default_factory=set)  # for get_block_ids_with_load_errors
    sweep_blocks: set[int] = field(default_factory=set)  # bad cached blocks, no request
    #: requests whose landed (transferred) KV failed its verify: they resume reading nothing
    #: cached, neither the connector's store nor the prefix cache (the landing is suspect)
    landed: set[str] = field(default_factory=set)


def damage_of(
    incidents: Iterable[Incident],
    *,
    req_ids: Sequence[str | None],
    block_ids_of: Any,
    block_size: int,
) -> WorkerDamage:
    """Translate incidents (view rows = batch rows + 1) into vLLM requests and block ids.

    `block_ids_of(req_id)` gives the request's own block ids (group 0). A row outside the batch,
    or with no block at its position, still damages the request at its last block."""
    out = WorkerDamage()
    first: dict[str, int] = {}
    for incident in incidents:
        if not incident.rows:
            out.sweep_blocks.update(s // block_size for s in incident.slots if s >= block_size)
            continue
        for row in incident.rows:
            index = row.req_row - 1
            if not 0 <= index < len(req_ids) or req_ids[index] is None:
                continue
            rid = str(req_ids[index])
            pos = max(0, row.first_position)
            first[rid] = min(first.get(rid, pos), pos)
    for rid, pos in first.items():
        blocks = list(block_ids_of(rid) or ())
        j = min(pos // block_size, max(len(blocks) - 1, 0))
        out.damage.append(Damage(rid, pos, j))
        if blocks:
            # the block this forward wrote into: the request's own (vLLM shares only full
            # cached blocks), so vLLM's rule touches no other holder of the bad block, which
            # may legitimately own it (stale prefix) and must not be recomputed in place
            out.report_blocks.add(int(blocks[-1]))
    return out


def worker_damage(worker: Any) -> WorkerDamage:
    """The damage of the forward a `CanaryWorker` just checked (takes the canary's incidents)."""
    canary = worker.canary
    incidents = canary.take_incidents() if canary is not None else []
    if not incidents:
        return WorkerDamage()
    for incident in incidents:  # the structured record, one JSON object per incident
        logger.warning("kv-canary: incident %s", json.dumps(incident.as_json()))
    runner = worker.runner
    ib = runner.input_batch
    requests = runner.requests

    def block_ids_of(req_id: str) -> list[int]:
        state = requests.get(req_id)
        return list(state.block_ids[0]) if state is not None else []

    return damage_of(incidents, req_ids=list(ib.req_ids[: int(ib.num_reqs)]),
                     block_ids_of=block_ids_of, block_size=int(worker.block_size))  # fmt: skip


def calling_scheduler() -> Any:
    """The vLLM `Scheduler` whose constructor is binding the connector (vLLM hands the
    connector its cache manager, not the scheduler whose update it must act in)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    return calling_instance(Scheduler)


@dataclass
class RecoveryFigures:
    """Scheduler-side figures of mode `recover` (totals since start)."""

    incidents: int = 0  # damaged request-forwards acted on
    recoveries: int = 0  # recomputes started
    recompute_tokens: int = 0  # positions dropped from the first bad block on
    failed: int = 0  # requests ended with an error (retry budget or policy `fail`)
    evicted_blocks: int = 0  # blocks taken out of the prefix cache
    recovered_requests: set[str] = field(default_factory=set)
    failed_requests: set[str] = field(default_factory=set)

    def as_dict(self) -> dict[str, int]:
        """JSON-ready totals."""
        return {"incidents": self.incidents, "recoveries": self.recoveries,
                "recompute_tokens": self.recompute_tokens, "failed": self.failed,
                "evicted_blocks": self.evicted_blocks}  # fmt: skip


class SchedulerRecovery:
    """Acts on the workers' damage inside one vLLM `Scheduler` (see the module table)."""

    def __init__(self, *, retries: int = DEFAULT_RETRIES, ledger: Any = None) -> None:
        self.retries = retries
        self.ledger = ledger
        self.figures = RecoveryFigures()
        self.attempts: Counter[str] = Counter()
        self._scheduler: Any = None
        self._pending: WorkerDamage | None = None
        self._reported: dict[str, int] = {}

    def take_counters(self) -> dict[str, int]:
        """`RECOVER_COUNTERS` deltas since the previous call (for vLLM's connector stats)."""
        now = {"incidents": self.figures.incidents, "recoveries": self.figures.recoveries,
               "recompute_tokens": self.figures.recompute_tokens,
               "requests_failed": self.figures.failed}  # fmt: skip
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        return delta

    @property
    def bound(self) -> bool:
        """True once wrapped around a scheduler."""
        return self._scheduler is not None

    def bind(self, scheduler: Any) -> None:
        """Wrap `update_from_output` and `_handle_invalid_blocks` on this scheduler instance."""
        if scheduler is None or self._scheduler is not None:
            return
        self._scheduler = scheduler
        update, handle = scheduler.update_from_output, scheduler._handle_invalid_blocks

        def update_from_output(scheduler_output: Any, model_runner_output: Any) -> Any:
            kv_out = getattr(model_runner_output, "kv_connector_output", None)
            self._pending = _worker_damage(getattr(kv_out, "kv_connector_worker_meta", None))
            try:
                if self._pending is not None and self._pending.sweep_blocks:
                    self._evict(self._pending.sweep_blocks, descendants=True)
                return update(scheduler_output, model_runner_output)
            finally:
                self._pending = None

        def _handle_invalid_blocks(invalid_block_ids: set[int],
                                   num_scheduled_tokens: dict[str, int]) -> set[str]:  # fmt: skip
            before = {rid: int(r.num_computed_tokens) for rid, r in scheduler.requests.items()}
            waiting_failed = set(getattr(scheduler, "failed_recving_kv_req_ids", ()))
            skip = set(handle(invalid_block_ids, num_scheduled_tokens))
            # an async load (host tier) that failed its verify: vLLM retries the request from
            # its first bad block; it must recompute, not read the same tier again
            for rid in set(getattr(scheduler, "failed_recving_kv_req_ids", ())) - waiting_failed:
                req = scheduler.requests.get(rid)
                if req is not None:
                    req.skip_reading_prefix_cache = True
            if self._pending is not None:
                damage = self._pending.damage
                damage = damage + self._tainted(damage, before, num_scheduled_tokens)
                skip |= self._act(damage, before)
            return skip

        scheduler.update_from_output = update_from_output
        scheduler._handle_invalid_blocks = _handle_invalid_blocks

    # ------------------------------------------------------------------ acting
    def _tainted(self, damage: list[Damage], computed_before: dict[str, int],
                 num_scheduled: dict[str, int]) -> list[Damage]:  # fmt: skip
        """Other requests holding a block a damaged request wrote in this forward.

        Those blocks were computed on top of bad KV: layer 0 (what the canary stamps) is right,
        the layers above are not. vLLM caches full blocks when it allocates them, so another
        request can hit them in the same schedule (and, under async scheduling, in the next),
        read them with a clean HEAD and sample from them; it is damaged from that block on."""
        sched = self._scheduler
        size = int(sched.block_size)
        named = {d.req_id for d in damage}
        written: set[int] = set()
        for d in damage:
            if d.req_id not in sched.requests:
                continue
            (blocks,) = sched.kv_cache_manager.get_block_ids(d.req_id)
            start = computed_before.get(d.req_id, 0) - num_scheduled.get(d.req_id, 0)
            written.update(int(b) for b in blocks[max(0, start) // size :])
        out: list[Damage] = []
        if not written:
            return out
        for req in sched.running:
            if req.request_id in named:
                continue
            (blocks,) = sched.kv_cache_manager.get_block_ids(req.request_id)
            hit = next((j for j, b in enumerate(blocks) if int(b) in written), None)
            if hit is not None:
                out.append(Damage(req.request_id, hit * size, hit))
        return out

    def _act(self, damage: list[Damage], computed_before: dict[str, int]) -> set[str]:
        from vllm.v1.request import RequestStatus

        sched = self._scheduler
        fail_policy = not sched.recompute_kv_load_failures
        block_size = int(sched.block_size)
        skip: set[str] = set()
        for d in damage:
            req = sched.requests.get(d.req_id)
            if req is None or req.is_finished():
                continue
            skip.add(d.req_id)
            self.figures.incidents += 1
            (blocks,) = sched.kv_cache_manager.get_block_ids(d.req_id)
            self._evict(blocks[d.block_index :], descendants=True)
            self.attempts[d.req_id] += 1
            if fail_policy or self.attempts[d.req_id] > self.retries:
                self._fail(req, d, fail_policy)
                continue
            self.figures.recoveries += 1
            self.figures.recompute_tokens += max(
                0, computed_before.get(d.req_id, 0) - d.block_index * block_size
            )
            self.figures.recovered_requests.add(d.req_id)
            logger.warning("kv-canary: request %s: corrupted KV at position %d; recomputed from "
                           "block %d into fresh blocks (recompute %d of %d)", d.req_id,
                           d.first_position, d.block_index, self.attempts[d.req_id],
                           self.retries)  # fmt: skip
            if self._pending is not None and d.req_id in self._pending.landed:
                # a bad landing: recompute from the tokens, not from the same transfer again
                req.skip_reading_prefix_cache = True
            if req.status == RequestStatus.RUNNING and req in sched.running:
                sched.running.remove(req)
                # vLLM's own preemption: frees the request's blocks and resumes it from its
                # prefix-cache hit, which now stops before the evicted blocks, into fresh ones
                sched._preempt_request(req, time.monotonic(), drop_stale_output=True)
        return skip

    def finished(self, req_id: str) -> dict[str, Any] | None:
        """A finished request's `kv_transfer_params` entry: how often it was recomputed (None:
        never). vLLM hands it to the client with the request's output (`RequestOutput` and the
        OpenAI server's `kv_transfer_params`), in any process layout. Forgets the request's
        retry count, so a long-running server keeps none for finished requests."""
        attempts = self.attempts.pop(req_id, 0)
        return {"kvcanary_recomputes": attempts} if attempts else None

    def _fail(self, req: Any, d: Damage, fail_policy: bool) -> None:
        self.figures.failed += 1
        self.figures.failed_requests.add(d.req_id)
        self.figures.recovered_requests.discard(d.req_id)
        logger.error(
            "kv-canary: request %s failed: corrupted KV at position %d %s",
            d.req_id, d.first_position,
            "(kv_load_failure_policy=fail)" if fail_policy else
            f"persisted after {self.attempts[d.req_id] - 1} recomputes (retry budget "
            f"{self.retries})",
        )  # fmt: skip
        if not fail_policy:
            # The scheduler's per-step error set: drained later in this same
            # `update_from_output`, which finishes the request with FINISHED_ERROR and emits its
            # output (finish_reason `error`). vLLM has no public "fail this request" call.
            self._scheduler.encoder_cache_mismatch_reqs.add(d.req_id)

    def _evict(self, block_ids: Iterable[int], *, descendants: bool) -> None:
        bad = {int(b) for b in block_ids if int(b) > 0}
        if descendants and self.ledger is not None:
            bad |= _descendants(self.ledger, bad)
        pool = self._scheduler.kv_cache_manager.block_pool
        cached = {b for b in bad if b < len(pool.blocks) and pool.blocks[b].block_hash is not None}
        if cached:
            self._scheduler.kv_cache_manager.evict_blocks(cached)
            self.figures.evicted_blocks += len(cached)


def _descendants(ledger: Any, roots: set[int]) -> set[int]:
    """Blocks cached (per the ledger) below any of `roots`."""
    children: dict[int, list[int]] = {}
    for block_id, (_, _, parent_id, _) in ledger.entries.items():
        children.setdefault(int(parent_id), []).append(int(block_id))
    out: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out and child not in roots:
                out.add(child)
                todo.append(child)
    return out


def _worker_damage(meta: Any) -> WorkerDamage | None:
    """The damage in a worker meta (ours, or ours inside a `MultiConnector`'s list)."""
    if meta is not None and not hasattr(meta, "damage"):
        for value in vars(meta).values() if hasattr(meta, "__dict__") else ():
            if isinstance(value, list | tuple):
                for item in value:
                    if hasattr(item, "damage"):
                        return _worker_damage(item)
        return None
    damage = getattr(meta, "damage", None)
    sweep = getattr(meta, "sweep_blocks", None)
    if not damage and not sweep:
        return None
    return WorkerDamage(
        damage=[Damage(str(r), int(p), int(j)) for r, p, j in (damage or ())],
        sweep_blocks={int(b) for b in (sweep or ())},
        landed={str(r) for r in (getattr(meta, "landed", None) or ())},
    )
