"""Engine: the serving loop. `step()` is schedule -> run -> postprocess -> `hooks.end_step()`.

The engine holds a `CanaryHooks` and knows nothing else about the canary; `NullHooks` is the
default. The runner calls `pre_forward` / `post_forward` itself; the engine calls `end_step`
exactly once per completed step, after the prefix cache reflects the step's inserts and
evictions and before the step's tokens are returned (SPEC §2.7, obligation 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcanary.contract import CanaryHooks, NullHooks
from kvcanary.engine.config import EngineConfig
from kvcanary.engine.plan import Runner, SamplingSpec, StepOutput, StepPlan
from kvcanary.engine.plants import PlantRecord
from kvcanary.engine.request import Request, RequestStatus
from kvcanary.engine.scheduler import Scheduler
from kvcanary.engine.stats import SchedulerStats
from kvcanary.engine.table import ListReqToTokenTable, ReqToTokenTable

__all__ = ["Engine", "FinishedRequest", "StepResult"]


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """A request that ended during a step: reached `max_new_tokens` (`finish_reason="length"`),
    or failed on KV corruption (`"kv_corruption"`, SPEC §14.3) with no output and an `error`."""

    request_id: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    finish_reason: str = "length"
    error: str | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step did: the plan (None when idle), the runner's output and finished requests."""

    plan: StepPlan | None
    output: StepOutput | None
    finished: tuple[FinishedRequest, ...] = ()


class Engine:
    """A small continuous-batching engine over a `Runner`.

    `table` is the `req_to_token` table the runner's attention reads (the runner's own tensor
    table in production); by default a pure-Python table, for runners that do not read it.
    """

    __slots__ = ("_config", "_hooks", "_runner", "_scheduler")

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        hooks: CanaryHooks | None = None,
        *,
        table: ReqToTokenTable | None = None,
    ) -> None:
        """Build the scheduler and attach its prefix cache to `hooks` (when enabled)."""
        self._config = config
        self._runner = runner
        self._hooks: CanaryHooks = hooks if hooks is not None else NullHooks()
        if table is None:
            table = ListReqToTokenTable(config.max_running_requests + 1, config.max_context_len)
        self._scheduler = Scheduler(config, table)
        if config.enable_prefix_cache:
            self._hooks.attach_prefix_cache(walker=self._scheduler.prefix_cache)

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration."""
        return self._config

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler (for inspection and integrity checks)."""
        return self._scheduler

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingSpec | None = None,
    ) -> None:
        """Queue a request (ValueError for a duplicate id or one that can never fit)."""
        self._scheduler.add_request(request_id, prompt, max_new_tokens, sampling)

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; False when it is unknown or already done."""
        return self._scheduler.abort(request_id)

    def request(self, request_id: str) -> Request:
        """Any request ever added, by id (KeyError when unknown)."""
        return self._scheduler.get(request_id)

    def has_work(self) -> bool:
        """Whether a request is waiting or running."""
        return self._scheduler.has_work()

    def stats(self) -> SchedulerStats:
        """A frozen snapshot of the scheduler counters."""
        return self._scheduler.stats()

    def plant_journal(self) -> list[PlantRecord]:
        """What the planted bugs of `config.plants` did, in order (empty without plants)."""
        return list(self._scheduler.plants.journal)

    def step(self) -> StepResult:
        """Run one iteration. If the runner raises, the plan's slots are released, no token is
        applied, `end_step` is not called and the exception propagates."""
        plan = self._scheduler.schedule()
        if plan is None:
            self._hooks.end_step()
            failed = self._scheduler.on_incidents(self._hooks.take_incidents())
            return StepResult(None, None, tuple(_ended(r) for r in failed))
        try:
            output = self._runner.run(plan)
        except BaseException:
            self._scheduler.discard(plan)
            raise
        finished = self._scheduler.postprocess(plan, output)
        self._hooks.end_step()
        finished += self._scheduler.on_incidents(self._hooks.take_incidents())  # sweeps
        return StepResult(plan, output, tuple(_ended(r) for r in finished))

    def run_until_idle(self, max_steps: int = 100_000) -> list[FinishedRequest]:
        """Step until no request is waiting or running; RuntimeError after `max_steps`."""
        finished: list[FinishedRequest] = []
        for _ in range(max_steps):
            if not self.has_work():
                return finished
            finished.extend(self.step().finished)
        raise RuntimeError(f"engine still busy after max_steps={max_steps}; raise the limit")


def _ended(req: Request) -> FinishedRequest:
    if req.status is RequestStatus.FAILED:
        return FinishedRequest(req.request_id, req.prompt, (), "kv_corruption", req.error)
    return FinishedRequest(req.request_id, req.prompt, tuple(req.output))
