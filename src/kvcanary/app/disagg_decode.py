"""The decode process of `kvcanary run --disaggregate`: it drives the workload (arrivals,
aborts at any point, including while a transfer is in flight), reserves, receives, verifies and
decodes, and sends its figures, outputs and fault journal back to the parent."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

from kvcanary.app.disagg_link import DisaggOptions, DisaggResult, recv, staging_of
from kvcanary.app.host_tier import attach_host_tier, sidecars_of
from kvcanary.app.session import RunSettings, build_stack
from kvcanary.app.workload import build_workload
from kvcanary.canary import CanaryViolationError
from kvcanary.engine.disagg import DecodeTransfers, PrefillDone
from kvcanary.engine.kv_staging import KvStaging
from kvcanary.engine.request import RequestStatus
from kvcanary.engine.transfer_faults import TransferFaults

__all__ = ["decode_main", "receiver_settings"]


def decode_main(conn: Connection, out: Connection, shm_name: str, settings: RunSettings,
                 opts: DisaggOptions) -> None:  # fmt: skip
    """The decode process: drive the workload, reserve, receive, verify, decode."""
    logging.disable(opts.log_disable)
    shm = SharedMemory(name=shm_name)
    staging = staging_of(shm, settings, opts.staging_pages)
    try:
        out.send(_decode_loop(conn, staging, settings, opts))
    finally:
        staging.release()
        shm.close()


def receiver_settings(settings: RunSettings) -> RunSettings:
    """The decode side's settings: with a canary on, its verify-token assert is on too.

    The receiver knows every token it holds (its engine publishes truth tokens, SPEC §14.4), and
    only the tokens tell a foreign chain from the holder's own: a late landing of an aborted
    transfer into slots reallocated, in the same order, to a request at the same positions
    brings a complete, self-consistent chain (HEAD_HASH at position 0, every link, position and
    real-KV fingerprint matching the bytes that landed), which chain, position and real-KV
    checks pass by design (SPEC §1.2 item 2). `verify_token` catches it at the holder's first
    read.
    """
    if not settings.canary.enabled or settings.canary.enable_verify_token_assert:
        return settings
    return replace(settings, canary=replace(settings.canary, enable_verify_token_assert=True))


def _decode_loop(
    conn: Connection, staging: KvStaging, settings: RunSettings, opts: DisaggOptions
) -> DisaggResult:
    settings = receiver_settings(settings)
    stack = build_stack(settings)
    engine, canary = stack.engine, stack.canary
    host = attach_host_tier(stack, opts.host_tier_pages) if opts.host_tier_pages else None
    steps = 0
    faults = TransferFaults(frozenset(opts.faults) - {"contiguous_block_ids"}, seed=opts.fault_seed,
                            warmup_steps=opts.fault_warmup_steps,
                            step_of=lambda: canary.step if canary is not None else steps)  # fmt: skip
    transfers = DecodeTransfers(engine.scheduler, stack.pool, sidecars_of(stack), staging, faults)
    workload = build_workload(settings.workload)
    planned = deque(workload)
    incoming: deque[Any] = deque()
    aborts: dict[int, list[str]] = {}
    # when an abort's delay starts: from arrival for half of the aborted requests (under load
    # these mostly catch requests still queued), from admission for the other half (a delay of
    # 1-2 steps is then within the transfer, longer ones catch the request decoding)
    delays = {
        p.request_id: p.abort_after_steps for p in workload if p.abort_after_steps is not None
    }
    from_admission = {p.request_id for k, p in enumerate(workload)
                      if p.abort_after_steps is not None and k % 2 == 1}  # fmt: skip
    for rid in opts.abort_in_flight:
        delays[rid] = 1
        from_admission.add(rid)
    will_abort = set(delays)
    abort_points = {"queued": 0, "in_flight": 0, "running": 0, "after_finish": 0}
    stopped, outcomes = False, {"landed": 0, "finished": 0, "rejected": 0, "discarded": 0}
    due: dict[str, int] = {}
    arrived: dict[str, PrefillDone] = {}
    aborted_before = 0
    start = time.perf_counter()
    ran: set[str] = set()  # requests whose chunk the last forward ran
    while planned or incoming or engine.has_work() or due:
        while planned and planned[0].arrival_step <= steps:
            p = planned.popleft()
            incoming.append(p)
            if p.request_id in delays and p.request_id not in from_admission:
                aborts.setdefault(steps + delays[p.request_id], []).append(p.request_id)
        for rid in aborts.pop(steps, []):
            if transfers.abort(rid):
                abort_points["in_flight"] += 1
                continue  # its completion is still due; it will be discarded
            if engine.abort(rid):
                abort_points["running"] += 1
                continue
            waiting = [p for p in incoming if p.request_id == rid]
            if waiting:
                incoming.remove(waiting[0])
                aborted_before += 1
                abort_points["queued"] += 1
            else:
                abort_points["after_finish"] += 1
        while incoming:
            p = incoming[0]
            if p.request_id in from_admission:
                aborts.setdefault(steps + delays[p.request_id], []).append(p.request_id)
            order = transfers.begin(p.request_id, p.prompt, p.max_new_tokens,
                                    stack.sampling(p.request_id), steps,
                                    may_fault=p.request_id not in will_abort)  # fmt: skip
            if order is None:
                if p.request_id in from_admission:  # not admitted after all
                    aborts[steps + delays[p.request_id]].remove(p.request_id)
                if not engine.has_work() and not due:  # nothing will free room
                    engine.add_request(p.request_id, p.prompt, p.max_new_tokens,
                                       stack.sampling(p.request_id))  # fmt: skip
                    incoming.popleft()
                    if p.request_id in from_admission:
                        aborts.setdefault(steps + delays[p.request_id], []).append(p.request_id)
                    continue
                break
            conn.send(order)
            due[p.request_id] = steps + opts.transfer_steps
            incoming.popleft()
        # a transfer lands exactly `transfer_steps` steps after it began (deterministic replay),
        # before the forward of that step: the first forward that can read its pages
        for rid in sorted((r for r, d in due.items() if d <= steps), key=lambda r: due[r]):
            del due[rid]
            while rid not in arrived:
                msg = recv(conn, "prefill process")
                arrived[msg.request_id] = msg
            outcomes[transfers.complete(arrived.pop(rid))] += 1
        transfers.tick(ran)
        ran = set()
        try:
            plan = engine.step().plan
            ran = {c.request_id for c in plan.chunks} if plan is not None else set()
        except CanaryViolationError:
            stopped = True
        steps += 1
        if stopped:
            break
    conn.send(("shutdown",))
    reply = recv(conn, "prefill process")
    while isinstance(reply, PrefillDone):  # answers to orders never due (raise mode stopped)
        reply = recv(conn, "prefill process")
    stats = engine.stats()
    outputs = {
        p.request_id: tuple(engine.request(p.request_id).output)
        for p in workload
        if _finished(engine, p.request_id)
    }
    t = transfers.stats
    figures: dict[str, Any] = {
        "requests_finished": stats.requests_finished,
        "requests_aborted": stats.requests_aborted + aborted_before,
        "aborted_in_flight": t.aborted_in_flight,
        "aborted_queued": abort_points["queued"],
        "aborted_running": abort_points["running"],
        "aborts_after_finish": abort_points["after_finish"],
        "transfers": t.transfers,
        "transferred_tokens": t.landed_tokens,
        "decode_cached_tokens": t.cached_tokens,
        "rejected_landings": t.rejected,
        "late_completions_discarded": t.late_completions,
        "late_landings_unread": t.late_landings_unread,
        "prefill_requests_finished": reply[2],
        "tokens_generated": stats.tokens_generated,
        "engine_steps": steps,
        "retractions": stats.retractions,
        "incidents": stats.incidents,
        "recoveries": stats.recoveries,
        "requests_failed": stats.requests_failed,
        "recomputed_requests": sorted(
            p.request_id for p in workload if _recoveries(engine, p.request_id)
        ),
        "failed_requests": sorted(
            p.request_id for p in workload if _status(engine, p.request_id) is RequestStatus.FAILED
        ),
        "rejected_landing_requests": list(t.rejected_requests),
        "evictions": stats.evictions,
        "radix_hit_tokens": stats.radix_hit_tokens,
        "sweep_passes": canary.sweep_passes if canary else 0,
        "violations": canary.total_violations if canary else 0,
        "prefill_violations": len(reply[1]),
        "host_restores": host.stats.restores if host else 0,
        "wall_seconds": round(time.perf_counter() - start, 3),
        "canary_mode": settings.canary.mode.value,
        "decode_verify_token_assert": settings.canary.enable_verify_token_assert,
        "seed": settings.workload.seed,
    }
    return DisaggResult(figures, outputs, tuple(stack.hooks.violations), tuple(reply[1]),
                        tuple(faults.journal), stopped)  # fmt: skip


def _recoveries(engine: Any, request_id: str) -> int:
    try:
        return int(engine.request(request_id).recoveries)
    except KeyError:
        return 0


def _status(engine: Any, request_id: str) -> RequestStatus | None:
    try:
        status: RequestStatus = engine.request(request_id).status
    except KeyError:
        return None
    return status


def _finished(engine: Any, request_id: str) -> bool:
    return _status(engine, request_id) is RequestStatus.FINISHED
