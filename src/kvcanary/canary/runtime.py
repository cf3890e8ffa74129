"""The Canary: HEAD before each forward, TAIL after it, sweeps at end of step (SPEC §2.1, §5, §8)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcanary.canary.buffers import GroupBuffers
from kvcanary.canary.capacities import CanaryLaunchCapacities
from kvcanary.canary.config import CanaryConfig, CanaryMode
from kvcanary.canary.errors import CanaryHealthError, CanaryViolationError
from kvcanary.canary.fused import FusedForward, PackedForward
from kvcanary.canary.incidents import IncidentCollector, PassRows
from kvcanary.canary.kernels import KERNEL_IMPLEMENTATIONS
from kvcanary.canary.monitors import (
    HEALTH_PERIOD,
    HealthChecker,
    stats_line,
    warn_verify_overflow,
)
from kvcanary.canary.perturb_seam import BindsCanary, PerturbHooks, PerturbRecord
from kvcanary.canary.plan import GroupPlan, ViewSnapshot, build_group_plan, snapshot_view
from kvcanary.canary.ring import ViolationRing
from kvcanary.canary.sources import FoldSources
from kvcanary.canary.view_checks import runs_entries, walker_entries, walker_runs
from kvcanary.contract.errors import CanaryContractError
from kvcanary.contract.groups import BufferGroupSpec, GroupKind
from kvcanary.contract.incident import Incident
from kvcanary.contract.oracle import TokenOracle
from kvcanary.contract.tags import FailReason, LaunchTag
from kvcanary.contract.view import ForwardView
from kvcanary.contract.violation import Violation
from kvcanary.contract.walker import PrefixCacheWalker

__all__ = ["Canary"]

logger = logging.getLogger("kvcanary")
#: the per-sweep INFO line (SPEC §8) on a child of `kvcanary`, so a deployment can keep it quiet
#: while the canary's other lines print: a sweep every few steps is dozens of lines a second,
#: and each line's write cost ~90 us of a vLLM step (docs/performance.md, sixth session)
sweep_logger = logging.getLogger("kvcanary.sweep")
_NO_TOKENS = np.full(0, -1, dtype=np.int64)
_NEVER = 1 << 62  # a step no run reaches

#: A stage with fewer verify + write entries than this runs the kernels' one-thread twins
#: (`verify_serial`, `write_serial`): waking numba's thread pool costs more than such a launch's
#: work, and a pool thread may wait a scheduler time slice for a core (another process, or an
#: engine's OpenMP threads spinning after its forward: milliseconds per launch in vLLM).
SERIAL_LAUNCH_ENTRIES = 4096


@dataclass(frozen=True, slots=True)
class _Kernels:
    """The verify and write kernels one launch uses: the parallel ones or their serial twins,
    and (serial only) `stage`, the two in one call (`kernels.fast.stage_serial`)."""

    verify: Callable[..., None]
    write: Callable[..., None]
    stage: Callable[..., int] | None = None


@dataclass(frozen=True, slots=True)
class _OpenForward:
    """A forward between HEAD and TAIL on the general path: its snapshot and plans. (A forward
    whose HEAD ran fused is open as its `PackedForward`, and its TAIL runs fused too.)"""

    snapshot: ViewSnapshot
    plans: dict[str, GroupPlan]


class Canary:
    """The installed detector for one KV pool; implements `kvcanary.contract.CanaryHooks`.

    Build it with `kvcanary.canary.install`. Single-threaded: the engine calls it from the thread
    that runs the forwards. Launches of `SERIAL_LAUNCH_ENTRIES` or more entries use numba's
    thread pool unless `parallel_launches` is False.
    """

    def __init__(
        self,
        config: CanaryConfig,
        groups: Sequence[BufferGroupSpec],
        capacities: CanaryLaunchCapacities,
        *,
        token_oracle: TokenOracle | None = None,
        kernels: str = "fast",
        perturb: PerturbHooks | None = None,
        parallel_launches: bool = True,
    ) -> None:
        kinds = [g.kind for g in groups]
        if kinds.count(GroupKind.FULL) != 1 or kinds.count(GroupKind.SWA) > 1:
            raise ValueError(
                f"kv-canary: install needs exactly one FULL group and at most one SWA group, "
                f"got {[k.value for k in kinds]}"
            )
        if config.enable_write_input_assert and token_oracle is None:
            raise ValueError(
                "kv-canary: enable_write_input_assert=True requires a token oracle; pass "
                "token_oracle=... to install(...)"
            )
        if kernels not in KERNEL_IMPLEMENTATIONS:
            raise ValueError(
                f"kv-canary: kernels must be one of {sorted(KERNEL_IMPLEMENTATIONS)}, got {kernels!r}"
            )
        self.config = config
        self.capacities = capacities
        self.token_oracle = token_oracle
        self._kernels: ModuleType = KERNEL_IMPLEMENTATIONS[kernels]
        self._perturb = perturb
        self._serial = _Kernels(
            self._kernels.verify_serial, self._kernels.write_serial, self._kernels.stage_serial
        )
        # Without parallel launches every launch runs on the calling thread: for an engine
        # whose own threads hold the other cores between forwards (vLLM's OpenMP threads spin
        # after each one), where a pool thread waits for a core. Measured in vLLM on 2 cores: a
        # sweep of ~6.6k entries 205 us on the calling thread, 308-448 us on numba's pool.
        self._threaded = (
            _Kernels(self._kernels.verify, self._kernels.write)
            if parallel_launches
            else self._serial
        )
        ordered = sorted(groups, key=lambda g: g.kind is GroupKind.SWA)
        self.groups = tuple(
            GroupBuffers(g, real_data=config.real_data, enable_v=config.enable_v) for g in ordered
        )
        self.ring = ViolationRing(config.ring_capacity)
        self._pass_rows = PassRows()  # every pass records here first, then into the ring
        self._incidents = IncidentCollector()
        self.kernel_run_counter = dict.fromkeys(LaunchTag, 0)
        self.slot_run_counter = dict.fromkeys(LaunchTag, 0)
        self.step = 0
        self.sweep_passes = 0
        self.chain_position_assert_enabled = False
        self._walker: PrefixCacheWalker | None = None
        self._last_sweep_step: int | None = None
        # the first step `end_step` sweeps at (`sweep_due`, read twice a step by adapters too):
        # never until a walker is attached, then at once, then every `sweep_interval` steps
        self._sweep_at = _NEVER
        self._open: _OpenForward | PackedForward | None = None
        self._tripped = False
        self._health = HealthChecker()
        self._stats_every = config.stats_print_every_n_steps
        # the verify stride: step `s` verifies the position units of phase `s % stride`
        self._stride = config.verify_stride
        # Built once: the config and groups are frozen, and these are read every forward.
        self._tags = {
            (stage, half, g.name): LaunchTag.of(stage, half, g.name)
            for g in self.groups
            for half in ("k", "v")
            for stage in ("head", "tail", "sweep")
        }
        # Per stage, each endpoint's (group, tag, record words, sources) in launch order (SPEC
        # §5: groups FULL then SWA, halves K then V), so a forward looks nothing up.
        self._launches = {
            stage: tuple(
                (g, self._tags[stage, half, g.name], g.words(stage, half),
                 g.stage_sources(stage, half))
                for g in self.groups
                for half in g.halves
            )
            for stage in ("head", "tail")
        }  # fmt: skip
        # The fused path (`canary.fused`) where it applies to every forward of this install
        # (one FULL group with one half, so one launch per stage); a fault injector, attached
        # later, turns it off per forward.
        only = self.groups[0]
        fused_launches = {
            **{stage: launch[0][1:] for stage, launch in self._launches.items()},
            "sweep": (self._tags["sweep", "k", only.name], only.words("sweep", "k"),
                      only.stage_sources("sweep", "k")),
        }  # fmt: skip
        self._fused = (
            FusedForward(
                self._kernels, only, fused_launches, capacities,
                serial_limit=SERIAL_LAUNCH_ENTRIES if parallel_launches else 1 << 62,
                token_check=config.verify_token_check, scratch=self._pass_rows,
                stride=config.verify_stride,
            )
            if hasattr(self._kernels, "forward_head") and len(self._launches["head"]) == 1
            and not config.recover and not config.enable_write_input_assert
            else None
        )  # fmt: skip
        stages = ("head", "tail", "sweep") if config.sweep_interval > 0 else ("head", "tail")
        self._active_tags = tuple(
            sorted(self._tags[stage, half, g.name] for g in self.groups for half in g.halves
                   for stage in stages)
        )  # fmt: skip

    # ----------------------------------------------------------------- lifecycle (CanaryHooks)
    def mark_init_finished(self) -> None:
        """Warm-up is over: turn on the chain-position assert."""
        self.chain_position_assert_enabled = True

    def set_perturber(self, perturb: PerturbHooks | None) -> None:
        """Attach (or, with None, detach) a fault injector after install (an engine that builds
        the canary itself, e.g. inside vLLM's engine core, gets its driver's injector later);
        a `BindsCanary` one is bound here. Between forwards only."""
        if self._open is not None:
            raise CanaryContractError("kv-canary: set_perturber while a forward is open")
        self._perturb = perturb
        if isinstance(perturb, BindsCanary):
            perturb.bind(self)

    def attach_prefix_cache(self, *, walker: PrefixCacheWalker) -> None:
        """Enable sweeps over `walker`."""
        self._walker = walker
        if self.config.sweep_interval > 0 and self._last_sweep_step is None:
            self._sweep_at = self.step

    def pre_forward(self, *, view: ForwardView) -> None:
        """Perturb hooks, plan, HEAD verify + write, pump."""
        if self._open is not None:
            raise CanaryContractError("kv-canary: pre_forward called twice without post_forward")
        if self._perturb is not None:
            self._perturb.before_plan(view=view, step=self.step)
        elif self._fused is not None:
            fwd = self._fused.head(view, self.chain_position_assert_enabled,
                                   self.step % self._stride)  # fmt: skip
            if fwd is not None:
                self._open_fused(fwd)
                return
        snap = snapshot_view(
            view,
            capacities=self.capacities,
            write_assert=self.config.enable_write_input_assert and self.token_oracle is not None,
            token_check=self.config.verify_token_check,
        )
        plans = {g.name: self._plan_group(g, snap) for g in self.groups}
        self._open = _OpenForward(snap, plans)
        self._health.note_forward()
        try:
            self._run_stage("head", snap, plans)
            self._pump()
        except CanaryViolationError:
            self._open = None  # the forward will not run
            raise

    def post_forward(self, *, view: ForwardView) -> None:
        """TAIL verify + write over the snapshot taken in `pre_forward`, pump, perturb hooks."""
        if self._open is None:
            raise CanaryContractError(
                "kv-canary: post_forward called without a matching pre_forward"
            )
        opened, self._open = self._open, None
        if isinstance(opened, PackedForward):
            assert self._fused is not None
            recorded = self._fused.tail(opened)
            if self._fused_stage_done(self._fused.tail_tag, opened, recorded):
                self._pump()
        else:
            self._run_stage("tail", opened.snapshot, opened.plans)
            self._pump()
        if self._perturb is not None:
            self._perturb.after_tail(view=view, step=self.step)

    def end_step(self) -> None:
        """Cache perturb, sweep if due, pump, health, stats; then advance the step."""
        if self._open is not None:
            raise CanaryContractError("kv-canary: end_step called while a forward is open")
        step = self.step
        try:
            due = step >= self._sweep_at
            perturb = self._perturb
            perturbed = perturb is not None
            if perturb is not None:
                perturb.at_end_step(step=step, sweep_due=due)
            if due:
                self._sweep()
            if due or perturbed:  # every other entry point pumps what it records itself
                self._pump()
            if step % HEALTH_PERIOD == 0:
                self._check_health()
            if self._stats_every > 0 and step % self._stats_every == 0:
                self._log_stats()
        finally:
            self.step = step + 1

    def maybe_swap_next_tokens(self, *, tokens: list[int]) -> list[int]:
        """Sampler exit: the perturber may swap two rows' tokens (SPEC §11.2 next_token_swap)."""
        if self._perturb is None:
            return tokens
        return self._perturb.maybe_swap_next_tokens(tokens=tokens, step=self.step)

    def drain_violations(self) -> list[Violation]:
        """Violations reported since the previous drain, in ring order (every mode)."""
        return self.ring.drain()

    def take_incidents(self) -> list[Incident]:
        """Incidents since the previous call (mode `recover` only; SPEC §14.3). Every violation
        counts, whether or not the fill-once ring still had room for its details."""
        return self._incidents.take()

    def verify_entries(
        self,
        *,
        group: str,
        slots: npt.NDArray[np.int64],
        prevs: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
        tokens: npt.NDArray[np.int64],
    ) -> None:
        """Verify entries no forward planned (landed transfers, SPEC §14.4) in the HEAD buffer
        (HEAD tags, no sources) and the TAIL buffer (TAIL tags and sources), then pump. The
        caller range-checks the slots (`canary.transfer`); no forward may be open."""
        if self._open is not None:
            raise CanaryContractError("kv-canary: verify of landed slots while a forward is open")
        g = self.group(group)
        kernels = self._kernels_for(len(slots))
        for stage in ("head", "tail"):
            for half in g.halves:
                tag = self._tags[stage, half, g.name]
                rows = self._verify(
                    kernels, tag, g.words(stage, half), g.stage_sources(stage, half), slots,
                    prevs, positions, tokens,
                )  # fmt: skip
                if len(rows) and self.config.recover:
                    # a landed slot belongs to no view row: a slot-only incident, like SWEEP
                    self._incidents.sweep_pass(
                        tag=int(tag), step=self.step, rows=rows,
                        walked=np.stack([slots, positions, prevs], axis=1), group_slots=slots,
                        stage=stage,
                    )  # fmt: skip
        self._pump()

    def record_landed_bytes(
        self,
        *,
        group: str,
        slots: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
        tokens: npt.NDArray[np.int64],
        landed: npt.NDArray[np.int64],
        expected: npt.NDArray[np.int64],
    ) -> int:
        """Landed slots whose transfer checksum (`landed[j]`, over the bytes that arrived)
        differs from the sender's (`expected[j]`): one TAIL row each (the group's K half,
        reason `verify_real_kv_hash`, the two checksums in the hash columns), then pump.
        Returns the rows recorded. The caller range-checks the slots (`canary.transfer`)."""
        if self._open is not None:
            raise CanaryContractError("kv-canary: report of landed bytes while a forward is open")
        g = self.group(group)
        bad = landed != expected
        if not bad.any():
            return 0
        tag = self._tags["tail", "k", g.name]
        rows = np.stack(
            [np.full(int(bad.sum()), int(tag), dtype=np.int64), slots[bad], positions[bad],
             tokens[bad], tokens[bad], landed[bad], expected[bad],
             np.full(int(bad.sum()), int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH), np.int64)],
            axis=1,
        )  # fmt: skip
        self.ring.absorb(rows)
        if self.config.recover:
            walked = np.stack([slots, positions, np.full_like(slots, -1)], axis=1)
            self._incidents.sweep_pass(tag=int(tag), step=self.step, rows=rows, walked=walked,
                                       group_slots=slots, stage="tail")  # fmt: skip
        self._pump()
        return len(rows)

    # ----------------------------------------------------------------- introspection
    @property
    def sweep_due(self) -> bool:
        """True when `end_step` at the current step will sweep."""
        return self.step >= self._sweep_at

    @property
    def perturbed(self) -> bool:
        """True while a fault injector is attached (`install(perturb=...)`, `set_perturber`)."""
        return self._perturb is not None

    @property
    def walker(self) -> PrefixCacheWalker | None:
        """The prefix-cache walker attached with `attach_prefix_cache`, if any."""
        return self._walker

    @property
    def total_violations(self) -> int:
        """The ring's write index: every violation recorded, dropped rows included."""
        return self.ring.write_index

    @property
    def active_tags(self) -> list[LaunchTag]:
        """Tags whose endpoints run: HEAD/TAIL per group and half; SWEEP when interval > 0."""
        return list(self._active_tags)

    def group(self, name: str) -> GroupBuffers:
        """The group named `full` or `swa`."""
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"kv-canary: no {name!r} group installed")

    def injections(self) -> list[PerturbRecord]:
        """The fault-injection journal (empty without a perturber)."""
        return [] if self._perturb is None else self._perturb.injections()

    # ----------------------------------------------------------------- internals
    def _open_fused(self, fwd: PackedForward) -> None:
        """`pre_forward` after `FusedForward.head` planned `fwd` (and ran HEAD when staged)."""
        if fwd.overflow:
            warn_verify_overflow(fwd.total_v, self.capacities.verify_capacity)
        if fwd.staged:
            self._open = fwd
        else:  # too large for one thread: the general stages over the same plan
            snap, plans = fwd.snapshot(), {self.groups[0].name: fwd.plan()}
            self._open = _OpenForward(snap, plans)
        self._health.note_forward()
        try:
            if not fwd.staged:
                self._run_stage("head", snap, plans)
                self._pump()
            else:
                assert self._fused is not None
                if self._fused_stage_done(self._fused.head_tag, fwd, fwd.recorded):
                    self._pump()
        except CanaryViolationError:
            self._open = None  # the forward will not run
            raise

    def _fused_stage_done(self, tag: LaunchTag, fwd: PackedForward, recorded: int) -> bool:
        """A fused stage's bookkeeping, as `_run_stage` keeps it for a fused serial launch.
        True when the pass recorded rows (`recorded`, the kernel's count): only then has the
        ring anything to pump (every other entry point pumps what it records before it
        returns)."""
        self.kernel_run_counter[tag] += 2  # a verify (or its overflow skip) and a write
        self.slot_run_counter[tag] += fwd.nv + fwd.writes
        if not recorded:
            return False  # a clean pass: nothing to take
        self.ring.absorb(self._pass_rows.take())
        return True

    def _plan_group(self, g: GroupBuffers, snap: ViewSnapshot) -> GroupPlan:
        plan = build_group_plan(
            self._kernels,
            snap,
            group_name=g.name,
            num_slots=g.num_slots,
            lut=g.lut,
            window=g.window,
            offset=g.offset,
            verify_capacity=self.capacities.verify_capacity,
            marks=g.write_marks,
            stride=self._stride,
            phase=self.step % self._stride,
        )
        if plan.overflow:
            warn_verify_overflow(plan.verify_total, self.capacities.verify_capacity)
        return plan

    def _run_stage(self, stage: str, snap: ViewSnapshot, plans: dict[str, GroupPlan]) -> None:
        entries = 0
        for p in plans.values():
            entries += len(p.v_slot) + len(p.w_slots)
        kernels = self._kernels_for(entries)
        chain_position = self.chain_position_assert_enabled and snap.linear_chain
        recover = self.config.recover
        scratch = self._pass_rows
        for g, tag, words, src in self._launches[stage]:
            plan = plans[g.name]
            if kernels.stage is not None and not recover:
                # one call; recover mode attributes the verify rows before the write runs
                scratch.prepare(len(plan.v_slot) + 2 * len(plan.w_slots))
                kernels.stage(
                    words, plan.v_slot, plan.v_prev, plan.v_pos, plan.v_tok, not plan.overflow,
                    *self._write_args(plan, snap, chain_position, src, tag),
                )  # fmt: skip
                rows = scratch.take()
                if len(rows):
                    self.ring.absorb(rows)
                self.kernel_run_counter[tag] += 2  # a verify (or its overflow skip) and a write
                self.slot_run_counter[tag] += len(plan.v_slot) + plan.num_writes
                continue
            if not plan.overflow:
                rows = self._verify(
                    kernels, tag, words, src, plan.v_slot, plan.v_prev, plan.v_pos, plan.v_tok
                )
                if recover and len(rows):
                    self._incidents.verify_pass(
                        stage=stage, tag=int(tag), step=self.step, rows=rows, snap=snap,
                        plan=plan, words=words, src=src, window=g.window,
                    )  # fmt: skip
            else:
                self.kernel_run_counter[tag] += 1
            scratch.prepare(2 * len(plan.w_slots))  # write-input + chain-position per entry
            kernels.write(words, *self._write_args(plan, snap, chain_position, src, tag))
            rows = scratch.take()
            if len(rows):
                self.ring.absorb(rows)
                if recover:
                    self._incidents.write_pass(
                        stage=stage, tag=int(tag), step=self.step, rows=rows, snap=snap, plan=plan
                    )
            self.kernel_run_counter[tag] += 1
            self.slot_run_counter[tag] += plan.num_writes

    def _write_args(
        self,
        plan: GroupPlan,
        snap: ViewSnapshot,
        chain_position: bool,
        src: FoldSources,
        tag: LaunchTag,
    ) -> tuple[Any, ...]:
        """The write kernel's arguments after the record buffer (also `stage`'s tail), into the
        scratch ring as last prepared."""
        scratch = self._pass_rows
        return (
            plan.seeds, plan.req_offsets, plan.w_slots, plan.shadowed, snap.input_ids,
            snap.positions, snap.write_assert, snap.expected_tokens, snap.expected_positions,
            chain_position, *src.words, src.params, src.count, int(tag), scratch.words,
            scratch.state,
        )  # fmt: skip

    def _kernels_for(self, entries: int) -> _Kernels:
        """The kernels for a launch of `entries` verify + write entries."""
        return self._serial if entries < SERIAL_LAUNCH_ENTRIES else self._threaded

    def _verify(
        self,
        kernels: _Kernels,
        tag: LaunchTag,
        words: npt.NDArray[np.uint64],
        src: FoldSources,
        slots: npt.NDArray[np.int64],
        prevs: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
        tokens: npt.NDArray[np.int64],
    ) -> npt.NDArray[np.int64]:
        """One verify pass; returns its rows (also appended to the ring)."""
        scratch = self._pass_rows
        scratch.prepare(len(slots))  # at most one row per entry
        kernels.verify(
            words, slots, prevs, positions, tokens, *src.words, src.params, src.count,
            int(tag), scratch.words, scratch.state,
        )  # fmt: skip
        rows = scratch.take()
        if len(rows):
            self.ring.absorb(rows)
        self.kernel_run_counter[tag] += 1
        self.slot_run_counter[tag] += len(slots)
        return rows

    def _sweep(self) -> None:
        assert self._walker is not None
        fused = self._fused
        # a walker's runs are verified as runs where the fused sweep takes them (no [n, 3]
        # walk is built); everything else expands them, range-checked per group by translate
        runs = walker_runs(self._walker)
        entries = -1 if runs is None or fused is None else fused.sweep_runs(runs)
        in_scratch = entries >= 0  # a fused sweep ran: its rows are in the scratch
        if not in_scratch:
            walked = walker_entries(self._walker) if runs is None else runs_entries(runs)
            entries = len(walked)
            in_scratch = fused is not None and fused.sweep(walked)
            if not in_scratch:
                self._sweep_groups(walked)
        if in_scratch:
            rows = self._pass_rows.take()
            if len(rows):
                self.ring.absorb(rows)
            tag = self._tags["sweep", "k", self.groups[0].name]
            self.kernel_run_counter[tag] += 1
            self.slot_run_counter[tag] += entries
        self.sweep_passes += 1
        self._last_sweep_step = self.step
        self._sweep_at = self.step + self.config.sweep_interval
        sweep_logger.info(
            "[canary] sweep pass=%d step=%d entries=%d", self.sweep_passes, self.step, entries
        )

    def _sweep_groups(self, walked: npt.NDArray[np.int64]) -> None:
        kernels = self._kernels_for(len(walked))
        for g in self.groups:
            slots = g.translate(walked[:, 0].copy(), allow_none=False)
            prevs = g.translate(walked[:, 2].copy())
            # An evicted SWA slot translates to 0 and is skipped by verify.
            tokens = np.full(len(slots), -1, dtype=np.int64)
            for half in g.halves:
                tag = self._tags["sweep", half, g.name]
                rows = self._verify(
                    kernels, tag, g.words("sweep", half), g.stage_sources("sweep", half),
                    slots, prevs, walked[:, 1].copy(), tokens,
                )  # fmt: skip
                if len(rows) and self.config.recover:
                    self._incidents.sweep_pass(
                        tag=int(tag), step=self.step, rows=rows, walked=walked, group_slots=slots
                    )

    def _pump(self) -> None:
        new = self.ring.pump(self.step)
        if not new:
            return
        if self.config.mode is CanaryMode.RAISE and not self._tripped:
            self._tripped = True
            raise CanaryViolationError("\n".join(v.message for v in new))
        for v in new:
            logger.warning("%s", v.message)

    def _check_health(self) -> None:
        if not self._health.due(self.step):
            return
        expected = [
            t
            for t in self._active_tags
            if not t.is_sweep
            or (self._walker is not None and 0 < self.config.sweep_interval <= 100)
        ]
        message = self._health.check(self.step, expected, self.kernel_run_counter)
        if message is None:
            return
        if self.config.mode is CanaryMode.RAISE:
            raise CanaryHealthError(message)
        logger.error("%s", message)

    def _log_stats(self) -> None:
        every = self.config.stats_print_every_n_steps
        if every <= 0 or self.step <= 0 or self.step % every:
            return
        logger.info(
            "%s",
            stats_line(
                step=self.step,
                protected_tokens=sum(self.slot_run_counter.values()),
                sweep_passes=self.sweep_passes,
                violations=self.total_violations,
                active_tags=len(self._active_tags),
            ),
        )
