"""`Perturber`: the eleven SPEC §11.2 fault modes behind the canary's `PerturbHooks` seam."""

from __future__ import annotations

from kvcanary.canary.buffers import GroupBuffers
from kvcanary.canary.config import PERTURB_MODES, PerturbConfig
from kvcanary.canary.perturb import modes_bytes, modes_records, modes_table
from kvcanary.canary.perturb.gate import WarmupGate
from kvcanary.canary.perturb.journal import Journal
from kvcanary.canary.perturb.modes_sampler import SampledRows, next_token_swap
from kvcanary.canary.perturb.rng import ModeRng
from kvcanary.canary.perturb.runner import ModeRunner
from kvcanary.canary.perturb.targets import ViewArrays, find_group
from kvcanary.canary.perturb_seam import CanaryState, PerturbRecord
from kvcanary.contract.view import ForwardView

__all__ = ["Perturber"]


class Perturber:
    """Fault injection for one canary (implements `PerturbHooks` and `BindsCanary`).

    Build it from `config.perturb`; `install` builds one automatically when any mode has p > 0
    and binds it to the new Canary. Modes run in SPEC order at each hook; each has its own random
    stream, so enabling one mode never changes another's draws. `max_fires_per_mode` caps the
    injections per mode (None = unlimited); tests use 1 to fire each mode exactly once.
    """

    def __init__(self, config: PerturbConfig, *, max_fires_per_mode: int | None = None) -> None:
        self.config = config
        self._journal = Journal(config.seed)
        self._gate = WarmupGate(config.warmup_steps)
        self._runs = {
            mode: ModeRunner(
                mode,
                config.probability(mode),
                ModeRng(mode, config.seed),
                self._journal,
                max_fires_per_mode,
            )
            for mode in PERTURB_MODES
        }
        self._late = modes_records.LateWriteTracker()
        self._canary: CanaryState | None = None
        self._sampled: SampledRows | None = None

    # ----------------------------------------------------------------- PerturbHooks
    def bind(self, canary: CanaryState) -> None:
        """Attach to the canary whose groups, walker and step the modes read."""
        self._canary = canary

    def before_plan(self, *, view: ForwardView, step: int) -> None:
        """pre_forward modes: req_to_token, real_kv_used, canary_tamper, double_alloc,
        position_off_by_one, swa_lut_tamper."""
        canary = self._bound()
        if not self._any("req_to_token", "real_kv_used", "canary_tamper", "double_alloc",
                         "position_off_by_one", "swa_lut_tamper") or not self._gate.open(step):  # fmt: skip
            return
        arrays = ViewArrays(view)
        if self._fires("req_to_token"):
            modes_table.req_to_token(self._runs["req_to_token"], canary, arrays, step)
        if (g := self._targeted("real_kv_used", step)) is not None:
            modes_bytes.real_kv_used(self._runs["real_kv_used"], g, arrays, step)
        if (g := self._targeted("canary_tamper", step)) is not None:
            modes_records.canary_tamper(self._runs["canary_tamper"], g, arrays, step)
        if self._fires("double_alloc"):
            modes_table.double_alloc(self._runs["double_alloc"], canary, arrays, step)
        if self._fires("position_off_by_one"):
            run = self._runs["position_off_by_one"]
            modes_table.position_off_by_one(run, canary, arrays, step)
        if self._fires("swa_lut_tamper"):
            modes_table.swa_lut_tamper(self._runs["swa_lut_tamper"], canary, arrays, step)

    def after_tail(self, *, view: ForwardView, step: int) -> None:
        """post_forward modes: real_kv_post_forward, late_write, stale_prefix."""
        canary = self._bound()
        arrays = ViewArrays(view)
        if self._runs["next_token_swap"].enabled:
            self._sampled = SampledRows.of(arrays)
        late = self._runs["late_write"]
        late_group = self._target_group() if late.enabled else None
        rewrites = self._late.observe(late_group, arrays) if late_group is not None else []
        if not self._any("real_kv_post_forward", "late_write", "stale_prefix"):
            return
        if not self._gate.open(step):
            return
        if (g := self._targeted("real_kv_post_forward", step)) is not None:
            modes_bytes.real_kv_post_forward(self._runs["real_kv_post_forward"], g, arrays, step)
        if (g := self._targeted("late_write", step)) is not None:
            modes_records.LateWriteTracker.inject(late, g, rewrites, step)
        if (g := self._targeted("stale_prefix", step)) is not None:
            modes_records.stale_prefix(self._runs["stale_prefix"], canary, g, arrays, step)

    def at_end_step(self, *, step: int, sweep_due: bool) -> None:
        """real_kv_unused_cache, only when this end_step sweeps."""
        canary = self._bound()
        if not sweep_due or not self._any("real_kv_unused_cache") or not self._gate.open(step):
            return
        if (g := self._targeted("real_kv_unused_cache", step)) is not None:
            modes_bytes.real_kv_unused_cache(self._runs["real_kv_unused_cache"], canary, g, step)

    def maybe_swap_next_tokens(self, *, tokens: list[int], step: int) -> list[int]:
        """next_token_swap at sampler exit; returns the tokens to publish."""
        self._bound()
        if not self._any("next_token_swap") or not self._gate.open(step):
            return tokens
        if not self._fires("next_token_swap"):
            return tokens
        return next_token_swap(self._runs["next_token_swap"], self._sampled, tokens, step)

    def injections(self) -> list[PerturbRecord]:
        """The journal, in injection order."""
        return self._journal.records()

    # ----------------------------------------------------------------- internals
    def _bound(self) -> CanaryState:
        if self._canary is None:
            raise RuntimeError("kv-canary: Perturber used before bind(canary); use install(...)")
        return self._canary

    def _any(self, *modes: str) -> bool:
        return any(self._runs[m].enabled for m in modes)

    def _fires(self, mode: str) -> bool:
        return self._runs[mode].draw()

    def _target_group(self) -> GroupBuffers | None:
        return find_group(self._bound(), self.config.target_group or "")

    def _targeted(self, mode: str, step: int) -> GroupBuffers | None:
        """Draw for a group-targeted mode; the target group when it fired (skip if missing)."""
        if not self._fires(mode):
            return None
        group = self._target_group()
        if group is None:
            self._runs[mode].skip(step, f"no_{self.config.target_group or 'target'}_group")
        return group
