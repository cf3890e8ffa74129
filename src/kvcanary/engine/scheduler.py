"""Continuous batching with chunked prefill, prefix sharing, retraction and speculative verify.

The scheduler works on Python ints only. `schedule()` builds one `StepPlan` per step: it
allocates the slots every chunk writes and records them in the request's `req_to_token` row
before the runner sees the plan. `postprocess()` applies the sampled tokens. State changes
happen only in those two calls, `add_request`, `abort`, `retract` and `discard`.

One step, in order (rows capped by `max_batch_size`, tokens by `max_prefill_tokens`):

| pass | who | tokens |
|---|---|---|
| decode | running requests with one token left to compute | 1, or 1 + k drafts (VERIFY) |
| continue | running requests mid-prefill | up to `chunked_prefill_size` |
| admit | waiting requests, FIFO, after a radix match | up to `chunked_prefill_size` |

When slots run out, unlocked radix leaves are evicted first; then the most recently admitted
running request is retracted (its computed prefix goes to the radix cache and it returns to the
front of the waiting queue). Admission never retracts, and a step that retracted admits nobody.
A VERIFY step (k > 0, nothing to prefill, nobody admissible) holds verify chunks only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvcanary.contract.incident import Incident
from kvcanary.contract.tags import fail_reason_labels
from kvcanary.engine.config import EngineConfig
from kvcanary.engine.drafter import Drafter, count_accepted
from kvcanary.engine.kv_manager import KvManager
from kvcanary.engine.plan import ForwardKind, SamplingSpec, ScheduledChunk, StepOutput, StepPlan
from kvcanary.engine.plants import PlantSet
from kvcanary.engine.radix_cache import RadixCache
from kvcanary.engine.recovery import RowDamage, damage_by_chunk, failing_slots, recovery_point
from kvcanary.engine.request import Request, RequestStatus
from kvcanary.engine.stats import SchedulerCounters, SchedulerStats
from kvcanary.engine.table import ReqToTokenTable

__all__ = ["Scheduler"]


class Scheduler:
    """Owns requests, slots, rows and the prefix cache; writes `req_to_token` through `table`."""

    __slots__ = (
        "_admissions",
        "_budget",
        "_config",
        "_counters",
        "_drafter",
        "_kv",
        "_pending",
        "_plants",
        "_requests",
        "_running",
        "_step",
        "_waiting",
    )

    def __init__(self, config: EngineConfig, table: ReqToTokenTable) -> None:
        """A scheduler for `config`; `table` has `max_running_requests + 1` rows of
        `max_context_len` positions, zero-initialised."""
        self._config = config
        self._plants = PlantSet(
            config.plants,
            seed=config.seed,
            warmup_steps=config.plant_warmup_steps,
            max_fires=config.plant_max_fires,
        )
        self._kv = KvManager(
            num_slots=config.num_slots,
            num_rows=config.max_running_requests + 1,
            table=table,
            enable_prefix_cache=config.enable_prefix_cache,
            seed=config.seed,
            plants=self._plants,
        )
        self._drafter = Drafter(config.vocab_size)
        self._counters = SchedulerCounters()
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._pending: dict[str, ScheduledChunk] = {}  # chunks of the step being built
        self._budget = 0
        self._step = 0
        self._admissions = 0

    # ---- read-only views -------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The configuration the scheduler was built with."""
        return self._config

    @property
    def kv(self) -> KvManager:
        """Slots, rows, prefix cache and table (read them; do not allocate from outside)."""
        return self._kv

    @property
    def prefix_cache(self) -> RadixCache:
        """The radix cache; it is the `PrefixCacheWalker` the canary sweeps."""
        return self._kv.prefix_cache

    @property
    def plants(self) -> PlantSet:
        """The planted bugs of `config.plants` and their journal (empty for a correct engine)."""
        return self._plants

    @property
    def step(self) -> int:
        """Steps scheduled so far (the step a request's `last_scheduled` names)."""
        return self._step

    @property
    def running(self) -> tuple[Request, ...]:
        """Running requests in admission order."""
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Request, ...]:
        """Waiting requests, next to admit first."""
        return tuple(self._waiting)

    def get(self, request_id: str) -> Request:
        """Any request ever added, by id (KeyError when unknown)."""
        return self._requests[request_id]

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._waiting or self._running)

    def stats(self) -> SchedulerStats:
        """A frozen snapshot of the counters."""
        return self._counters.snapshot()

    def check_integrity(self) -> None:
        """Raise AssertionError on any inconsistency between requests, slots, rows, the prefix
        cache and the table (see `KvManager`). Call between steps; costs O(pool + table)."""
        for req in self._running:
            assert req.status is RequestStatus.RUNNING and req.row != 0
            assert len(req.slots) == req.num_computed < req.seq_len, f"{req.request_id}: slots"
        for req in self._waiting:
            assert req.status is RequestStatus.WAITING and req.row == 0 and not req.slots
            assert req.handle is None
        assert len(self._running) <= self._config.max_running_requests
        self._kv.check_integrity(self._running, self._config.max_context_len)

    # ---- request lifecycle -----------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingSpec | None = None,
    ) -> Request:
        """Queue a request; raises ValueError for a duplicate id or one that can never fit."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use; pick a unique id")
        if not prompt:
            raise ValueError(f"request {request_id!r} has an empty prompt; give at least one token")
        if max_new_tokens < 1:
            raise ValueError(
                f"request {request_id!r} max_new_tokens must be >= 1, got {max_new_tokens}"
            )
        limit = self._config.max_request_tokens
        if len(prompt) + max_new_tokens > limit:
            raise ValueError(
                f"request {request_id!r} needs prompt {len(prompt)} + max_new_tokens "
                f"{max_new_tokens} <= {limit} (max_context_len / num_slots); shorten it"
            )
        req = Request(
            request_id, tuple(int(t) for t in prompt), max_new_tokens, sampling or SamplingSpec()
        )
        self._requests[request_id] = req
        self._waiting.append(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request, releasing everything it holds; False when it is
        unknown or already finished/aborted. Call between steps."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        if req.status is RequestStatus.WAITING:
            self._waiting.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self._kv.release(req, cache=False)
            self._running.remove(req)
        else:
            return False
        req.status = RequestStatus.ABORTED
        self._counters.requests_aborted += 1
        return True

    def retract(self, request_id: str) -> bool:
        """Preempt a running request: cache its computed prefix, free its row and queue it first.
        Returns False when it is not running. Call between steps."""
        req = self._requests.get(request_id)
        if req is None or req.status is not RequestStatus.RUNNING:
            return False
        self._retract(req)
        return True

    # ---- disaggregation (engine.disagg): prompt KV computed by a prefill engine elsewhere ----

    def begin_transfer(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingSpec | None = None,
    ) -> tuple[Request, int] | None:
        """Reserve what a request whose prompt KV will arrive from a prefill engine needs: a
        row, its cached prefix (locked) and fresh slots for the rest of the prompt, all in its
        row. Returns `(request, cached length)`; None, with nothing changed, when no row or
        slots are free now. The request is neither waiting nor running until
        `finish_transfer` or `cancel_transfer`. Call between steps."""
        req = self.add_request(request_id, prompt, max_new_tokens, sampling)
        self._waiting.remove(req)
        if self._kv.rows.num_free == 0:
            del self._requests[request_id]
            return None
        matched = self._kv.attach(req)
        slots = self._alloc_evicting(len(req.prompt) - req.num_computed)
        if slots is None:
            self._kv.release(req, cache=False)
            del self._requests[request_id]
            return None
        self._kv.extend(req, slots)
        self._counters.radix_hit_tokens += matched
        return req, matched

    def finish_transfer(self, req: Request, first_token: int) -> bool:
        """The prompt KV of `req` landed and verified: it runs from its first sampled token.
        Returns True when that token already finished it."""
        req.num_computed = len(req.slots)
        req.output.append(int(first_token))
        self._counters.tokens_generated += 1
        req.status = RequestStatus.RUNNING
        req.admit_seq = self._admissions
        self._admissions += 1
        self._running.append(req)
        if req.is_done:
            self._finish(req)
            return True
        return False

    def cancel_transfer(self, req: Request, *, aborted: bool) -> None:
        """Give back what `begin_transfer` reserved. `aborted`: the client aborted; otherwise
        the landing failed and the request is prefilled here instead (queued first)."""
        self._kv.release(req, cache=False)
        if aborted:
            req.status = RequestStatus.ABORTED
            self._counters.requests_aborted += 1
        else:
            req.status = RequestStatus.WAITING
            self._waiting.appendleft(req)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Build the next forward, or None when nothing can be scheduled."""
        cfg = self._config
        self._step += 1
        self._plants.step = self._step - 1  # 0-based, like the canary's step counter
        self._pending = {}
        self._budget = cfg.max_prefill_tokens
        retractions = self._counters.retractions
        order = sorted(self._running, key=lambda r: (r.last_scheduled, r.admit_seq))
        chosen = sorted(order[: cfg.max_batch_size], key=lambda r: r.admit_seq)
        # a decode feeds back a sampled token; a 1-token prompt tail is still a prefill chunk
        decoding = [r for r in chosen if r.num_to_compute == 1 and r.output]
        prefilling = [r for r in chosen if r not in decoding]
        could_admit = bool(self._waiting) and len(self._running) < cfg.max_running_requests
        speculate = (
            cfg.speculative_num_draft_tokens > 0
            and not prefilling
            and not (could_admit and len(chosen) < cfg.max_batch_size)
        )
        for req in decoding:
            if req.status is RequestStatus.RUNNING:
                self._schedule_decode(req, speculate)
        decode_ids = set(self._pending)
        for req in prefilling:
            if req.status is RequestStatus.RUNNING and self._budget > 0:
                self._schedule_prefill(req)
        if not speculate and self._counters.retractions == retractions:
            self._admit()  # a VERIFY forward holds verify chunks only
        chunks = tuple(self._pending.values())
        self._pending = {}
        if not chunks:
            return None
        if speculate:
            kind = ForwardKind.VERIFY
        elif any(c.request_id not in decode_ids for c in chunks):
            kind = ForwardKind.EXTEND
        else:
            kind = ForwardKind.DECODE
        return StepPlan(kind, chunks)

    def postprocess(self, plan: StepPlan, output: StepOutput) -> list[Request]:
        """Apply the runner's samples to `plan`'s requests; returns the requests finished now.

        Raises ValueError when `output` does not answer `plan` chunk for chunk."""
        if len(output.chunks) != len(plan.chunks):
            raise ValueError(
                f"StepOutput has {len(output.chunks)} chunks for a {len(plan.chunks)}-chunk plan"
            )
        finished: list[Request] = []
        damage = damage_by_chunk(output.incidents, len(plan.chunks))
        self._evict_failing(output.incidents)
        for index, (chunk, out) in enumerate(zip(plan.chunks, output.chunks, strict=True)):
            if out.request_id != chunk.request_id or len(out.sampled) != chunk.num_samples:
                raise ValueError(
                    f"StepOutput chunk {out.request_id!r} with {len(out.sampled)} samples does not "
                    f"answer chunk {chunk.request_id!r} with num_samples={chunk.num_samples}"
                )
            req = self._requests.get(chunk.request_id)
            if req is None or req.status is not RequestStatus.RUNNING or req.row != chunk.row:
                continue  # aborted or retracted since the plan was built
            if req.num_computed != chunk.prefix_len:
                raise RuntimeError(f"request {req.request_id!r} moved since its chunk was planned")
            self._kv.plant_note_read(req)
            if index in damage:  # SPEC §14.3: this forward's samples never reach the client
                if self._recover(req, damage[index]):
                    finished.append(req)
                continue
            self._apply(req, chunk, out.sampled, verify=plan.kind is ForwardKind.VERIFY)
            self._note_caught_up(req)
            if req.is_done and self._final_token_checked(req):
                self._finish(req)
                finished.append(req)
        return finished

    def _final_token_checked(self, req: Request) -> bool:
        """False while `write_final_token` still owes the last sampled token one forward."""
        if not self._config.write_final_token or req.num_computed >= req.seq_len:
            return True
        return req.seq_len > self._config.max_context_len  # no column left to write it into

    def on_incidents(self, incidents: Sequence[Incident]) -> list[Request]:
        """Act on incidents outside a forward (SWEEP, landed transfers): evict the failing slots
        from the prefix cache and recompute every running request whose computed KV holds one,
        from its first such position. Returns the requests that failed instead."""
        if not incidents:
            return []
        self._evict_failing(incidents)
        bad = set(failing_slots(incidents))
        bits = 0
        for incident in incidents:
            bits |= incident.fail_reason_bits
        failed: list[Request] = []
        for req in list(self._running):
            hit = next((p for p, s in enumerate(req.slots[: req.num_computed]) if s in bad), None)
            if hit is not None and self._recover(req, RowDamage(hit, False, bits, frozenset(bad))):
                failed.append(req)
        return failed

    def discard(self, plan: StepPlan) -> None:
        """Forget a plan whose forward failed: release the slots it allocated, apply nothing."""
        for chunk in plan.chunks:
            req = self._requests.get(chunk.request_id)
            if req is not None and req.status is RequestStatus.RUNNING and req.row == chunk.row:
                self._kv.drop_uncomputed(req)

    # ---- scheduling passes -----------------------------------------------------------------

    def _schedule_decode(self, req: Request, speculate: bool) -> None:
        k = 0
        if speculate:
            k = min(
                self._config.speculative_num_draft_tokens,
                max(0, req.remaining_new_tokens - 1),
                self._config.max_context_len - req.seq_len,
            )
        if self._budget < k + 1:
            return
        reuse: list[int] = []
        if (
            self._plants.enabled("spec_rollback_stale")
            and req.request_id in self._plants.stale_drafts
        ):
            reuse = self._kv.plant_take_stale_drafts(req, k + 1)
        slots = self._alloc_or_retract(req, k + 1 - len(reuse))
        if slots is None:
            return
        slots = [*reuse, *slots]
        tokens = req.tokens
        drafts = self._drafter.propose(tokens, k, req.sampling) if speculate else []
        inputs = (tokens[-1], *drafts)
        self._add_chunk(req, inputs, slots, len(inputs) if speculate else 1)

    def _schedule_prefill(self, req: Request) -> None:
        n = self._chunk_len(req)
        slots = self._alloc_or_retract(req, n)
        if slots is not None:
            start = req.num_computed
            final = start + n == req.seq_len
            self._add_chunk(req, tuple(req.tokens[start : start + n]), slots, int(final))
            if start > 0 and self._plants.armed("chunk_boundary_off_by_one"):
                self._kv.plant_shift_chunk(req, start, slots, self._config.max_context_len)

    def _admit(self) -> None:
        cfg = self._config
        while (
            self._waiting
            and len(self._running) < cfg.max_running_requests
            and self._kv.rows.num_free > 0  # requests receiving KV (disaggregation) hold rows too
            and len(self._pending) < cfg.max_batch_size
            and self._budget > 0
        ):
            req = self._waiting[0]
            matched = self._kv.attach(req)
            n = self._chunk_len(req)
            slots = self._alloc_evicting(n)
            if slots is None:
                self._kv.release(req, cache=False)
                return
            self._waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.admit_seq = self._admissions
            self._admissions += 1
            self._running.append(req)
            self._counters.radix_hit_tokens += matched
            start = req.num_computed
            final = start + n == req.seq_len
            self._add_chunk(req, tuple(req.tokens[start : start + n]), slots, int(final))

    # ---- slots -----------------------------------------------------------------------------

    def _chunk_len(self, req: Request) -> int:
        limit = self._config.chunk_limit
        n = min(req.num_to_compute, self._budget)
        return n if limit is None else min(n, limit)

    def _alloc_evicting(self, n: int) -> list[int] | None:
        slots, evicted = self._kv.alloc(n)
        self._counters.evictions += evicted
        return slots

    def _alloc_or_retract(self, req: Request, n: int) -> list[int] | None:
        """`n` slots for `req`, retracting the newest running request until they fit; None when
        `req` itself was retracted."""
        while True:
            slots = self._alloc_evicting(n)
            if slots is not None:
                return slots
            victim = max(self._running, key=lambda r: r.admit_seq)
            planted = victim is not req and self._plants.armed("retract_stale_row")
            self._retract(victim, planted=planted)
            if victim is req:
                return None

    def _add_chunk(
        self, req: Request, inputs: tuple[int, ...], slots: list[int], num_samples: int
    ) -> None:
        start = req.num_computed
        assert len(req.slots) == start, "a request has at most one chunk in flight"
        self._kv.extend(req, slots)
        req.last_scheduled = self._step
        self._budget -= len(inputs)
        self._pending[req.request_id] = ScheduledChunk(
            request_id=req.request_id,
            row=req.row,
            prefix_len=start,
            input_ids=inputs,
            out_slots=tuple(slots),
            num_samples=num_samples,
            sampling=req.sampling,
            prompt_len=len(req.prompt),
            truth_tokens=tuple(req.tokens),
        )

    # ---- applying results and releasing ----------------------------------------------------

    def _apply(
        self, req: Request, chunk: ScheduledChunk, sampled: Sequence[int], *, verify: bool
    ) -> None:
        if verify:
            drafts = chunk.input_ids[1:]
            accepted = count_accepted(drafts, sampled)
            req.num_computed += accepted + 1
            new = [*drafts[:accepted], sampled[accepted]]
            self._counters.spec_draft_tokens += len(drafts)
            self._counters.spec_accepted_tokens += accepted
        else:
            req.num_computed += len(chunk.input_ids)
            new = list(sampled[-1:])
        if verify and accepted < len(drafts) and self._plants.armed("spec_rollback_stale"):
            self._kv.plant_free_rejected_drafts(req)
        else:
            self._kv.drop_uncomputed(req)
        new = new[: req.remaining_new_tokens]
        req.output.extend(new)
        self._counters.tokens_generated += len(new)

    # ---- recovery after canary incidents (SPEC §14.3) --------------------------------------

    def _evict_failing(self, incidents: Sequence[Incident]) -> None:
        if not incidents:
            return
        self._counters.incidents += len(incidents)
        slots = failing_slots(incidents)
        self._counters.incident_evicted_slots += self._kv.prefix_cache.evict_containing(slots)

    def _recover(self, req: Request, damage: RowDamage) -> bool:
        """Restart `req` before its damage, into fresh slots; or fail it when its retry budget
        is spent. Returns True when it failed."""
        if req.recoveries >= self._config.recovery_retries:
            self._fail(req, damage)
            return True
        before = len(req.slots)
        damage = self._include_table_damage(req, damage)
        point = recovery_point(
            prompt_len=len(req.prompt), seq_len=req.seq_len, num_computed=req.num_computed,
            position=damage.first_position, bad_input_token=damage.bad_input_token,
        )  # fmt: skip
        self._kv.truncate(
            req, point.keep_computed, self._phantom_refs(req, point.keep_computed, damage)
        )
        del req.output[max(0, point.keep_tokens - len(req.prompt)) :]
        req.recoveries += 1
        req.recover_target = max(req.recover_target, before)
        req.recover_step = self._step
        self._counters.recoveries += 1
        self._counters.recompute_tokens += before - point.keep_computed
        return False

    def _include_table_damage(self, req: Request, damage: RowDamage) -> RowDamage:
        """Move the restart back to the first computed position whose `req_to_token` entry no
        longer holds the request's own slot: the canary skips entries mapped to slot 0 (and a
        shifted window made attention read wrong KV there), but the engine knows its slots."""
        n = min(req.num_computed, damage.first_position)
        cells = self._kv.table.read(req.row, n) if n > 0 else []
        bad = next((q for q in range(n) if cells[q] != req.slots[q]), None)
        if bad is None:
            return damage
        return RowDamage(bad, False, damage.reasons_bits, damage.slots)

    def _phantom_refs(self, req: Request, start: int, damage: RowDamage) -> set[int]:
        """Failing slots `req` lists from `start` on whose every reference is held by other
        running requests: `req`'s own reference was lost to a bookkeeping bug, so `req` must
        not give it back (that would free a slot another request owns; SPEC §14.3)."""
        out: set[int] = set()
        for slot in set(req.slots[start:]) & damage.slots:
            others = sum(slot in r.slots for r in self._running if r is not req)
            if self._kv.allocator.refcount(slot) <= others:
                out.add(slot)
        return out

    def _note_caught_up(self, req: Request) -> None:
        if req.recover_target and req.num_computed >= req.recover_target:
            latency = self._step - req.recover_step
            self._counters.recoveries_completed += 1
            self._counters.recovery_latency_steps_total += latency
            self._counters.recovery_latency_steps_max = max(
                self._counters.recovery_latency_steps_max, latency
            )
            req.recover_target = 0

    def _fail(self, req: Request, damage: RowDamage) -> None:
        self._kv.release(req, cache=False)
        self._running.remove(req)
        req.status = RequestStatus.FAILED
        reasons = "+".join(fail_reason_labels(damage.reasons_bits)) or "none"
        req.error = (
            f"kv-canary: request {req.request_id!r} failed: KV corruption at position "
            f"{damage.first_position} ({reasons}) persisted after {req.recoveries} recomputes "
            f"(retry budget {self._config.recovery_retries})"
        )
        self._counters.requests_failed += 1

    def _finish(self, req: Request) -> None:
        if req.recoveries:
            self._counters.requests_recovered += 1
        self._kv.release(req, cache=True)
        self._running.remove(req)
        req.status = RequestStatus.FINISHED
        self._counters.requests_finished += 1

    def _retract(self, req: Request, *, planted: bool = False) -> None:
        dropped = self._pending.pop(req.request_id, None)
        if dropped is not None:
            self._budget += len(dropped.input_ids)
        if not (planted and self._kv.plant_retract_stale(req)):
            self._kv.release(req, cache=True)
        self._running.remove(req)
        req.status = RequestStatus.WAITING
        self._waiting.appendleft(req)
        self._counters.retractions += 1
