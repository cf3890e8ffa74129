"""One `kvcanary run`: build the engine and the canary, serve the workload, summarise."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcanary.app.observability import StepObserver
from kvcanary.app.workload import WorkloadSpec, build_workload
from kvcanary.canary import (
    Canary,
    CanaryConfig,
    CanaryLaunchCapacities,
    CanaryViolationError,
    PerturbConfig,
    PerturbHooks,
    install,
)
from kvcanary.canary.kernels.precompile import precompile
from kvcanary.contract import (
    CanaryHooks,
    ForwardView,
    Incident,
    NullHooks,
    PrefixCacheWalker,
    TokenOracle,
    Violation,
    fail_reason_labels,
    request_key,
)
from kvcanary.engine.config import EngineConfig
from kvcanary.engine.engine import Engine
from kvcanary.engine.kv_pool import KvPool
from kvcanary.engine.model import ModelConfig, TinyLlama
from kvcanary.engine.oracle_model import OracleModel
from kvcanary.engine.plan import SamplingSpec
from kvcanary.engine.req_to_token import TorchReqToTokenTable
from kvcanary.engine.runner import ModelRunner

__all__ = [
    "RunSettings",
    "RunSummary",
    "Stack",
    "Terminated",
    "TimedHooks",
    "build_stack",
    "interrupt_behind",
    "run_session",
    "warm_up_kernels",
]


class Terminated(KeyboardInterrupt):
    """SIGTERM as an exception (the CLI's handler raises it), so a run stops like on Ctrl-C."""


def interrupt_behind(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C / SIGTERM that `exc` wraps, if any.

    A signal handler raises between any two bytecodes, including Python code that compiled code
    calls back into (numba unpickles its constants there). The compiled caller then reports a
    `SystemError` whose `__cause__`/`__context__` chain holds the interrupt; it is still the
    user's signal, not a bug.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, KeyboardInterrupt):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSettings:
    """Everything `kvcanary run` needs, validated at the edge."""

    canary: CanaryConfig
    engine: EngineConfig
    model: ModelConfig
    model_kind: str = "tiny"  # tiny | oracle
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)

    def __post_init__(self) -> None:
        if self.model_kind not in ("tiny", "oracle"):
            raise ValueError(f"--model must be tiny or oracle, got {self.model_kind!r}")


@dataclass(frozen=True, slots=True)
class RunSummary:
    """The run's figures (the `--json` schema) plus the violations it saw."""

    figures: dict[str, Any]
    violations: tuple[Violation, ...]
    stopped_by_raise: bool
    #: the first line of the raise-mode error that stopped the run
    stop_message: str | None = None
    #: `SIGINT` or `SIGTERM` when a signal cut the run short (the figures are partial)
    interrupted: str | None = None


class TimedHooks:
    """Forwards every hook to the canary and adds up the time spent in it."""

    def __init__(self, inner: CanaryHooks) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.violations: list[Violation] = []
        self.incidents: list[Incident] = []  # every incident the engine took (mode recover)

    def _timed(self, fn: Callable[..., None], **kwargs: Any) -> None:
        start = time.perf_counter()
        try:
            fn(**kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.violations.extend(self.inner.drain_violations())

    def mark_init_finished(self) -> None:
        """Forwarded."""
        self.inner.mark_init_finished()

    def attach_prefix_cache(self, *, walker: PrefixCacheWalker) -> None:
        """Forwarded."""
        self.inner.attach_prefix_cache(walker=walker)

    def pre_forward(self, *, view: ForwardView) -> None:
        """Forwarded and timed."""
        self._timed(self.inner.pre_forward, view=view)

    def post_forward(self, *, view: ForwardView) -> None:
        """Forwarded and timed."""
        self._timed(self.inner.post_forward, view=view)

    def end_step(self) -> None:
        """Forwarded and timed."""
        self._timed(self.inner.end_step)

    def maybe_swap_next_tokens(self, *, tokens: list[int]) -> list[int]:
        """Forwarded."""
        return self.inner.maybe_swap_next_tokens(tokens=tokens)

    def drain_violations(self) -> list[Violation]:
        """Everything collected so far."""
        return list(self.violations)

    def take_incidents(self) -> list[Incident]:
        """Forwarded (and kept in `incidents` for the events and the summary)."""
        new = self.inner.take_incidents()
        self.incidents.extend(new)
        return new


def build_canary(
    settings: RunSettings,
    pool: KvPool,
    oracle: TokenOracle | None,
    *,
    perturb: PerturbHooks | None = None,
    kernels: str = "fast",
) -> Canary | None:
    """Install the canary over the pool with capacities derived from the engine sizes."""
    eng = settings.engine
    caps = CanaryLaunchCapacities.from_args(
        req_to_token_pool_size=eng.max_running_requests + 1,
        max_seq_len_per_req=eng.max_context_len,
        pool_slot_count=eng.num_slots,
        cuda_graph_max_bs=eng.max_batch_size,
        speculative_num_draft_tokens=eng.speculative_num_draft_tokens + 1,
        max_prefill_tokens=eng.max_prefill_tokens,
        # this engine's chunk size bounds one request's chunk; max_prefill_tokens bounds a step
        chunked_prefill_size=None,
    )
    group = pool.buffer_group(settings.canary.real_data.value)
    return install(settings.canary, [group], caps, oracle, kernels=kernels, perturb=perturb)


@dataclass(frozen=True, slots=True)
class Stack:
    """An engine with the canary installed over its pool, wired and ready to serve."""

    engine: Engine
    canary: Canary | None
    hooks: TimedHooks
    pool: KvPool
    table: TorchReqToTokenTable
    runner: ModelRunner
    oracle: TokenOracle | None

    def sampling(self, request_id: str) -> SamplingSpec:
        """The sampling spec for a request: the oracle with the oracle model, greedy otherwise."""
        if self.oracle is None:
            return SamplingSpec()
        return SamplingSpec(oracle=True, oracle_key=request_key(request_id))


def build_stack(
    settings: RunSettings, *, perturb: PerturbHooks | None = None, kernels: str = "fast"
) -> Stack:
    """Pool, table, canary (None in mode `none`), model, runner and engine, wired together."""
    m, eng = settings.model, settings.engine
    if settings.canary.recover:  # SPEC §14.3: every delivered token is written and checked first
        eng = dataclasses.replace(eng, write_final_token=True)
    pool = KvPool(num_slots=eng.num_slots, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                  head_dim=m.head_dim, dtype=m.torch_dtype)  # fmt: skip
    table = TorchReqToTokenTable(
        max_rows=eng.max_running_requests, max_context_len=eng.max_context_len
    )
    use_oracle = settings.model_kind == "oracle"
    oracle = TokenOracle(m.vocab_size) if use_oracle else None
    canary = build_canary(settings, pool, oracle, perturb=perturb, kernels=kernels)
    hooks = TimedHooks(canary if canary is not None else NullHooks())
    model = OracleModel(m) if use_oracle else TinyLlama(m)
    runner = ModelRunner(model, pool, table, hooks, oracle=oracle)
    engine = Engine(eng, runner, hooks, table=table)
    hooks.mark_init_finished()  # this engine runs no synthetic warm-up forwards
    return Stack(engine, canary, hooks, pool, table, runner, oracle)


def run_session(
    settings: RunSettings,
    progress: Callable[[int, int], None] | None = None,
    *,
    stack: Stack | None = None,
    observer: StepObserver | None = None,
) -> RunSummary:
    """Serve the workload to completion (or until raise mode stops it)."""
    stack = stack or build_stack(settings)
    engine, canary, hooks = stack.engine, stack.canary, stack.hooks
    planned = build_workload(settings.workload)
    pending = list(planned)
    aborts: dict[int, list[str]] = {}
    steps, stopped, aborted, reported, injected = 0, False, 0, 0, 0
    incidents_reported = 0
    stop_message: str | None = None
    interrupted: str | None = None
    start = time.perf_counter()
    try:
        while pending or engine.has_work():
            while pending and pending[0].arrival_step <= steps:
                req = pending.pop(0)
                engine.add_request(
                    req.request_id, req.prompt, req.max_new_tokens, stack.sampling(req.request_id)
                )
                if req.abort_after_steps is not None:
                    aborts.setdefault(steps + req.abort_after_steps, []).append(req.request_id)
            for request_id in aborts.pop(steps, []):
                aborted += engine.abort(request_id)
            try:
                engine.step()
            except CanaryViolationError as exc:
                stopped = True  # fail closed: that step's tokens were never applied
                stop_message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            steps += 1
            if observer is not None:
                new = hooks.violations[reported:]
                reported = len(hooks.violations)
                journal = canary.injections() if canary is not None else []
                injected, new_faults = len(journal), journal[injected:]
                new_incidents = hooks.incidents[incidents_reported:]
                incidents_reported = len(hooks.incidents)
                observer.on_step(
                    incidents=new_incidents,
                    step=steps - 1,
                    stats=asdict(engine.stats()),
                    protected=sum(canary.slot_run_counter.values()) if canary else 0,
                    sweeps=canary.sweep_passes if canary else 0,
                    violations=new,
                    injections=new_faults,
                )
            if stopped:
                break
            if progress is not None:
                progress(
                    engine.stats().requests_finished + engine.stats().requests_aborted, len(planned)
                )
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM via Terminated: summarise what ran
        interrupted = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
    except SystemError as exc:  # the signal landed inside a compiled kernel's callback
        signal_exc = interrupt_behind(exc)
        if signal_exc is None:
            raise
        interrupted = "SIGTERM" if isinstance(signal_exc, Terminated) else "SIGINT"
    wall = time.perf_counter() - start
    stats = engine.stats()
    by_reason: Counter[str] = Counter()
    for v in hooks.violations:
        for label in fail_reason_labels(v.fail_reason_bits):
            by_reason[label] += 1
    figures = {
        "requests_finished": stats.requests_finished,
        "requests_aborted": stats.requests_aborted,
        "tokens_generated": stats.tokens_generated,
        "forward_steps": canary.kernel_run_counter[0] // 2 if canary else steps,
        "engine_steps": steps,
        "protected_slot_checks": sum(canary.slot_run_counter.values()) if canary else 0,
        "sweep_passes": canary.sweep_passes if canary else 0,
        "violations": canary.total_violations if canary else 0,
        "violations_by_reason": dict(sorted(by_reason.items())),
        "retractions": stats.retractions,
        "evictions": stats.evictions,
        "radix_hit_tokens": stats.radix_hit_tokens,
        "spec_accepted_tokens": stats.spec_accepted_tokens,
        "wall_seconds": round(wall, 3),
        "canary_seconds": round(hooks.seconds, 3),
        "canary_mode": settings.canary.mode.value,
        "seed": settings.workload.seed,
    }
    if settings.canary.recover:  # SPEC §14.3: what recover mode did
        figures |= {
            "incidents": len(hooks.incidents),
            "requests_recovered": stats.requests_recovered,
            "requests_failed": stats.requests_failed,
            "recoveries": stats.recoveries,
            "recompute_tokens": stats.recompute_tokens,
        }
    if interrupted is not None:
        figures["interrupted"] = interrupted
    return RunSummary(figures, tuple(hooks.violations), stopped, stop_message, interrupted)


def warm_up_kernels(settings: RunSettings) -> float:
    """Compile the kernels `settings` uses; the seconds it took. Called before the timed run on
    a cold cache, so the canary time of the summary excludes compilation.

    First `precompile()` compiles the kernels for the runtime's signatures, in parallel on the
    machine's cores; then a two-request run with no faults, no plants and a sweep every step
    (same dtypes and options as `settings`) loads them and compiles whatever else it calls."""
    canary = dataclasses.replace(
        settings.canary, perturb=PerturbConfig(), stats_print_every_n_steps=0,
        sweep_interval=1 if settings.canary.enabled else 0,
    )  # fmt: skip
    tiny = dataclasses.replace(
        settings, canary=canary, engine=dataclasses.replace(settings.engine, plants=()),
        workload=WorkloadSpec(num_requests=2, seed=settings.workload.seed, vocab_size=256),
    )  # fmt: skip
    start = time.perf_counter()
    if settings.canary.enabled:  # run_session uses the fast kernels
        precompile()
    run_session(tiny)
    return time.perf_counter() - start
