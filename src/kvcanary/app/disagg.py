"""`kvcanary run --disaggregate`: a prefill engine and a decode engine in two OS processes.

Each process builds its own stack (pool, radix cache, canary). KV crosses between them over a
real transport on this machine:

- **pages**: a `multiprocessing.shared_memory` segment of staging pages (`engine.kv_staging`),
  mapped by both processes: the prefill side writes the pages the decode side lacks into pages
  the decode side reserved, like a one-sided RDMA/NIXL write into a registered buffer;
- **control**: a `multiprocessing.Pipe` (a local socket pair) carrying small pickled messages
  (`PrefillOrder`, `PrefillDone` with the sidecar bytes, aborts), ordered and framed for free.

The decode process drives the workload (arrivals, aborts at any point, including while a
transfer is in flight) and returns its figures, outputs and fault journal to the parent, which
checks the outputs against the no-cache reference. Both children are joined (or terminated) and
the segment unlinked before `run_disaggregated` returns, whatever happened. The decode process
is `app.disagg_decode`; what both sides share is `app.disagg_link`.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

from kvcanary.app.disagg_decode import decode_main, receiver_settings
from kvcanary.app.disagg_link import DisaggOptions, DisaggResult, recv, staging_of
from kvcanary.app.host_tier import sidecars_of
from kvcanary.app.reference import ReferenceOutputs
from kvcanary.app.session import RunSettings, RunSummary, build_stack
from kvcanary.app.workload import build_workload
from kvcanary.engine.kv_staging import staging_bytes
from kvcanary.engine.transfer_faults import TransferFaults

__all__ = [
    "DisaggOptions",
    "DisaggResult",
    "receiver_settings",
    "run_disaggregated",
    "serve_disaggregated",
]


def _prefill_main(
    conn: Connection, shm_name: str, settings: RunSettings, opts: DisaggOptions
) -> None:
    """The prefill process: compute prompts, stage their pages, answer each order."""
    logging.disable(opts.log_disable)
    from kvcanary.engine.disagg import stage_prefilled

    shm = SharedMemory(name=shm_name)
    staging = staging_of(shm, settings, opts.staging_pages)
    try:
        stack = build_stack(settings)
        engine, sidecars = stack.engine, sidecars_of(stack)
        step = [0]
        faults = TransferFaults(frozenset(opts.faults) & {"contiguous_block_ids"}, seed=opts.fault_seed,
                                warmup_steps=opts.fault_warmup_steps, step_of=lambda: step[0])  # fmt: skip
        while True:
            msg = recv(conn, "decode process")
            if isinstance(msg, tuple) and msg[0] == "shutdown":
                conn.send(
                    (
                        "prefill_done",
                        tuple(stack.hooks.violations),
                        engine.stats().requests_finished,
                    )
                )
                return
            # one order at a time, to completion: the prefill side's slot layout (and so every
            # fault choice) depends only on the order sequence, which the decode side fixes
            engine.add_request(msg.request_id, msg.prompt, 1, msg.sampling)
            step[0] = msg.decode_step
            finished = None
            while finished is None:
                done = engine.step().finished
                finished = next((f for f in done if f.request_id == msg.request_id), None)
                if finished is None and not engine.has_work():
                    raise RuntimeError(f"prefill of {msg.request_id!r} ended without a token")
            slots, _ = engine.scheduler.prefix_cache.match_prefix(msg.prompt)
            assert len(slots) == len(msg.prompt), "a finished prompt is cached whole"
            conn.send(stage_prefilled(stack.pool, sidecars, staging, msg, slots,
                                      finished.output[0], faults))  # fmt: skip
    finally:
        staging.release()
        shm.close()


def serve_disaggregated(settings: RunSettings, opts: DisaggOptions) -> DisaggResult:
    """Run the two processes to completion; always joins them and unlinks the segment."""
    m = settings.model
    size = staging_bytes(
        opts.staging_pages, m.num_layers, m.num_kv_heads, m.head_dim, m.torch_dtype
    )
    opts = replace(opts, log_disable=max(opts.log_disable, logging.root.manager.disable))
    ctx = mp.get_context("spawn")
    shm = SharedMemory(create=True, size=size)
    to_prefill, from_decode = ctx.Pipe()
    result_recv, result_send = ctx.Pipe(duplex=False)
    prefill_settings = replace(
        settings, engine=replace(settings.engine, speculative_num_draft_tokens=0)
    )
    procs = [
        ctx.Process(target=_prefill_main, args=(from_decode, shm.name, prefill_settings, opts),
                    name="kvcanary-prefill", daemon=True),
        ctx.Process(target=decode_main, args=(to_prefill, result_send, shm.name, settings, opts),
                    name="kvcanary-decode", daemon=True),
    ]  # fmt: skip
    try:
        for proc in procs:
            proc.start()
        while not result_recv.poll(1.0):
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead or all(p.exitcode is not None for p in procs):
                raise RuntimeError(
                    "kvcanary disaggregate: "
                    + ", ".join(f"{p.name} exited with {p.exitcode}" for p in procs)
                )
        result: DisaggResult = result_recv.recv()
        return result
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
        shm.close()
        shm.unlink()


def run_disaggregated(
    settings: RunSettings,
    progress: Callable[[int, int], None] | None = None,
    *,
    host_tier_pages: int = 0,
    opts: DisaggOptions | None = None,
) -> RunSummary:
    """`kvcanary run --disaggregate`: serve, check outputs, summarise like `run_session`."""
    opts = opts or DisaggOptions(host_tier_pages=host_tier_pages)
    result = serve_disaggregated(settings, opts)
    planned = build_workload(settings.workload)
    check = ReferenceOutputs(settings).check(planned, result.outputs)
    if progress is not None:
        progress(len(planned), len(planned))
    figures = {**result.figures, "outputs_compared": check.compared,
               "outputs_identical": check.identical}  # fmt: skip
    return RunSummary(
        figures, result.violations + result.prefill_violations, result.stopped_by_raise
    )
