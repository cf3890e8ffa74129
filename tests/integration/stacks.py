"""Shared helpers for the integration tests: stack settings and a seeded serving driver that
records what happened to every request (retractions, aborts by phase, prefill chunking)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvcanary.app.session import RunSettings, Stack
from kvcanary.canary import CanaryConfig, CanaryMode, RealDataMode
from kvcanary.contract import TokenOracle, request_key
from kvcanary.engine.config import EngineConfig
from kvcanary.engine.model import ModelConfig
from kvcanary.engine.request import Request, RequestStatus

VOCAB = 128
PREFILL, DECODE = "prefill", "decode"


def canary_config(
    *,
    mode: CanaryMode = CanaryMode.LOG,
    real_data: RealDataMode = RealDataMode.PARTIAL,
    sweep: int = 0,
    oracle: bool = False,
    verify_stride: int = 1,
) -> CanaryConfig:
    """A canary with stats printing off; the token asserts are on wherever they can run."""
    return CanaryConfig(
        mode=mode,
        real_data=real_data,
        sweep_interval=sweep,
        stats_print_every_n_steps=0,
        enable_verify_token_assert=True,
        enable_write_input_assert=oracle,
        enable_token_oracle=oracle,
        verify_stride=verify_stride,
    )


def run_settings(
    canary: CanaryConfig,
    *,
    model_kind: str = "tiny",
    num_slots: int = 400,
    max_context_len: int = 128,
    max_running_requests: int = 6,
    max_batch_size: int = 6,
    chunked_prefill_size: int | None = None,
    max_prefill_tokens: int = 256,
    speculative_num_draft_tokens: int = 0,
    enable_prefix_cache: bool = True,
    seed: int = 0,
) -> RunSettings:
    """RunSettings over the default tiny model (hidden 64, 2 layers, vocab 128)."""
    return RunSettings(
        canary=canary,
        engine=EngineConfig(
            num_slots=num_slots,
            max_context_len=max_context_len,
            vocab_size=VOCAB,
            max_running_requests=max_running_requests,
            max_batch_size=max_batch_size,
            chunked_prefill_size=chunked_prefill_size,
            max_prefill_tokens=max_prefill_tokens,
            speculative_num_draft_tokens=speculative_num_draft_tokens,
            enable_prefix_cache=enable_prefix_cache,
            seed=seed,
        ),
        model=ModelConfig(vocab_size=VOCAB),
        model_kind=model_kind,
    )


@dataclass(frozen=True, slots=True)
class Planned:
    """One request of a seeded workload."""

    request_id: str
    arrival_step: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    abort_phase: str | None = None  # PREFILL or DECODE: abort when first seen in that phase


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadShape:
    """Seeded workload knobs: shared system prompts, random user tails, arrival rate."""

    num_requests: int = 10
    num_system_prompts: int = 2
    system_prompt_len: int = 20
    user_len: tuple[int, int] = (3, 24)
    max_new_tokens: tuple[int, int] = (4, 12)
    arrivals_per_step: int = 3
    abort_prefill: int = 0  # how many requests to abort mid-prefill
    abort_decode: int = 0  # how many requests to abort while decoding
    abort_prompt_len: int = 48  # long, unshared prompts for the mid-prefill targets


def plan_workload(shape: WorkloadShape, seed: int) -> list[Planned]:
    """The seeded request list; abort targets come first so they are admitted early."""
    rng = random.Random(seed)
    systems = [
        tuple(rng.randrange(VOCAB) for _ in range(shape.system_prompt_len))
        for _ in range(shape.num_system_prompts)
    ]
    phases = [PREFILL] * shape.abort_prefill + [DECODE] * shape.abort_decode
    out = []
    for i in range(shape.num_requests):
        phase = phases[i] if i < len(phases) else None
        if phase == PREFILL:
            # unshared, so no radix hit can shorten the prefill below several chunks
            prompt = tuple(rng.randrange(VOCAB) for _ in range(shape.abort_prompt_len))
            max_new = shape.max_new_tokens[1]
        else:
            user = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(*shape.user_len)))
            prompt = rng.choice(systems) + user
            max_new = rng.randint(*shape.max_new_tokens)
            if phase == DECODE:
                max_new = max(max_new, 6)
        out.append(Planned(f"req-{i}", i // shape.arrivals_per_step, prompt, max_new, phase))
    return out


@dataclass
class Served:
    """What one serving run did."""

    planned: dict[str, Planned]
    finished: dict[str, tuple[int, ...]] = field(default_factory=dict)
    aborted: dict[str, str] = field(default_factory=dict)  # id -> phase it was aborted in
    # id -> (num_computed, prompt length, output length) seen just before the abort
    abort_snapshots: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    retracted: set[str] = field(default_factory=set)
    partial_prefill_chunks: int = 0  # non-final prefill chunks (chunked prefill ran)
    verify_forwards: int = 0
    steps: int = 0


def in_phase(req: Request, phase: str) -> bool:
    """Whether `req` is running mid-prefill (some prompt computed, not all) or decoding."""
    if req.status is not RequestStatus.RUNNING:
        return False
    if phase == PREFILL:
        return 0 < req.num_computed < len(req.prompt) and not req.output
    return len(req.output) >= 2 and req.num_computed == req.seq_len - 1


def serve(
    stack: Stack, planned: list[Planned], *, max_steps: int = 2000, check_every_step: bool = True
) -> Served:
    """Admit `planned` by arrival step, abort each target the first time it is seen in its
    phase, step to idle, and check the scheduler's integrity after every step."""
    engine = stack.engine
    served = Served({p.request_id: p for p in planned})
    pending = list(planned)
    targets = {p.request_id: p.abort_phase for p in planned if p.abort_phase}
    added: set[str] = set()
    for step in range(max_steps):
        if not pending and not engine.has_work():
            break
        while pending and pending[0].arrival_step <= step:
            p = pending.pop(0)
            engine.add_request(
                p.request_id, p.prompt, p.max_new_tokens, stack.sampling(p.request_id)
            )
            added.add(p.request_id)
        for rid, phase in list(targets.items()):
            req = engine.request(rid) if rid in added else None
            if req is not None and in_phase(req, phase):
                served.abort_snapshots[rid] = (req.num_computed, len(req.prompt), len(req.output))
                assert engine.abort(rid)
                assert req.status is RequestStatus.ABORTED and req.row == 0 and not req.slots
                served.aborted[rid] = phase
                del targets[rid]
        running_before = {r.request_id for r in engine.scheduler.running}
        result = engine.step()
        served.steps += 1
        if result.plan is not None:
            served.partial_prefill_chunks += sum(
                1
                for c in result.plan.chunks
                if c.num_samples == 0 and c.prefix_len + len(c.input_ids) < c.prompt_len
            )
            served.verify_forwards += result.plan.kind.value == "verify"
        for f in result.finished:
            served.finished[f.request_id] = f.output
        waiting_now = {r.request_id for r in engine.scheduler.waiting}
        served.retracted |= running_before & waiting_now
        if check_every_step:
            engine.scheduler.check_integrity()
    else:
        raise AssertionError(f"engine still busy after {max_steps} steps")
    assert not targets, f"abort targets never reached their phase: {targets}"
    return served


def oracle_output(request_id: str, prompt_len: int, n: int) -> list[int]:
    """The tokens the oracle sampler must produce for a request."""
    oracle, key = TokenOracle(VOCAB), request_key(request_id)
    return [oracle.token(key, prompt_len + i) for i in range(n)]


def violation_messages(stack: Stack) -> list[str]:
    """Every violation the canary reported through the hooks (for assertion messages)."""
    return [v.message for v in stack.hooks.violations]


def assert_no_violations(stack: Stack) -> None:
    """Zero violations: nothing recorded in the ring, nothing collected by the hooks."""
    canary = stack.canary
    assert canary is not None
    assert canary.total_violations == 0, violation_messages(stack)[:5]
    assert stack.hooks.violations == [], violation_messages(stack)[:5]
    assert canary.drain_violations() == []


def assert_clean(stack: Stack) -> None:
    """No violations, and the canary did check slots (it was not silently bypassed)."""
    assert_no_violations(stack)
    assert stack.canary is not None
    assert sum(stack.canary.slot_run_counter.values()) > 0, "the canary protected no slot"
