"""The worker half of the canary inside vLLM: install over the real caches, HEAD before / TAIL
after each forward, sweeps of the scheduler's snapshot, per-step figures.

Driven by `KVCanaryConnector` (worker role): `install` from `register_kv_caches`, `before_forward`
from `start_load_kv` (inputs are prepared, the forward context holds attention's slot mapping),
`after_forward` from `wait_for_save` (after the model, before sampling). vLLM is imported only
inside functions.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvcanary.adapters.vllm.host_views import HostViews, RunnerArrays
from kvcanary.adapters.vllm.layout import (
    LayerSources,
    LayoutError,
    TokenByteMap,
    build_sources,
)
from kvcanary.adapters.vllm.layout import calibrate as calibrate_layout
from kvcanary.adapters.vllm.mirror import KvMirror
from kvcanary.adapters.vllm.prep import StepPrep
from kvcanary.adapters.vllm.state import STATE, RunnerHooks
from kvcanary.adapters.vllm.sweep import BlockSnapshot, SnapshotWalker
from kvcanary.adapters.vllm.view import split_waves
from kvcanary.contract import BufferGroupSpec, ForwardView, GroupKind, TruthTable, Violation

if TYPE_CHECKING:
    from kvcanary.canary import Canary, CanaryConfig

__all__ = ["CanaryWorker", "StepFigures"]

logger = logging.getLogger("kvcanary")
#: keep at most this many drained violations for drivers that read them (oldest dropped)
KEPT_VIOLATIONS = 1_000_000


@dataclass
class StepFigures:
    """Figures since the last `drain` or `CanaryWorker.take_figures` (they cross to the scheduler
    and /metrics)."""

    forwards: int = 0
    checks: int = 0
    sweeps: int = 0
    # "TAG|reason" -> count; a plain dict: a Counter's Python-level __init__ cost every step
    # for a map that is empty on a clean step
    violations: dict[str, int] = field(default_factory=dict)

    def is_empty(self) -> bool:
        """Nothing happened."""
        return not (self.forwards or self.checks or self.sweeps or self.violations)

    def drain(self) -> dict[str, Any]:
        """The figures as `KVCanaryStats` data, then zero (in place: a new object per step was
        most of a clean step's stats work). The violations map goes out as it is, never to be
        written again: a fresh one takes its place."""
        counts = self.violations
        data = {"forwards": self.forwards, "checks": self.checks, "sweeps": self.sweeps,
                "violations": counts if counts else {}}  # fmt: skip
        self.forwards = self.checks = self.sweeps = 0
        if counts:
            self.violations = {}
        return data


def _layer_writer(static_ctx: Mapping[str, Any], name: str) -> Any:
    layer = static_ctx[name]
    impl = layer.impl

    def write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
              slots: torch.Tensor) -> None:  # fmt: skip
        impl.do_kv_cache_update(layer, key, value, cache, slots)

    return write


def _keep_openmp_to_torch() -> None:
    """Run the canary's numba kernels on numba's own `workqueue` threads unless the user chose a
    threading layer (`NUMBA_THREADING_LAYER`). With numba's default pick (OpenMP, the libgomp
    torch uses) the canary's `numba.set_num_threads` changes the OpenMP thread count of vLLM's
    forward thread, and the CPU attention kernel then aborts (`cpu_attn_impl.hpp: Check failed:
    input->metadata->thread_num == thread_num (2 vs. 1)`, seen in a multiprocess worker)."""
    if "NUMBA_THREADING_LAYER" in os.environ:
        return
    import numba

    try:
        chosen = numba.threading_layer()
    except ValueError:  # no parallel kernel ran yet in this process: the layer is still open
        numba.config.THREADING_LAYER = "workqueue"
        return
    if chosen == "omp":
        logger.warning("kv-canary: numba already runs on OpenMP in this process; set "
                       "NUMBA_THREADING_LAYER=workqueue before starting vLLM")  # fmt: skip


class CanaryWorker:
    """One canary over layer 0 of one model runner's KV cache."""

    def __init__(self, runner: Any, config: CanaryConfig, hooks: Any = None) -> None:
        self.runner = runner
        self.config = config
        self._hooks: Any = None
        self._runner_hooks: RunnerHooks | None = None
        self.hooks = hooks
        self.canary: Canary | None = None
        self.layout: TokenByteMap | None = None
        self.sources: LayerSources | None = None
        self.walker = SnapshotWalker()
        self.block_size = 0
        self.figures = StepFigures()
        self.kept: list[Violation] = []
        self.canary_seconds = 0.0
        self.split_forwards = 0
        self.chunked_prefill_rows = 0
        self._waves: list[ForwardView] = []
        self._prep: StepPrep | None = None  # req_to_token kept across steps, wave test
        self._host = HostViews()  # NumPy views of the runner's input buffers, made once
        self._truth: TruthTable | None = None  # the runner's token table, as the last view read it
        self._arrays: RunnerArrays | None = None  # the runner's arrays, found once per batch
        self.num_blocks = 0
        self._mirror: KvMirror | None = None  # the sources' mirror, if a layout needs one
        self._tail_blocks: np.ndarray | None = None  # blocks TAIL reads (set with a mirror)
        self._last_checks = 0
        self._ring_changes = 0  # `ViolationRing.changes` as `_collect` last read it
        self._dropped_seen: Counter[tuple[str, str]] = Counter()
        self.last_request_ids: list[str] = []
        self._layer0 = ""  # the KV cache layer the canary covers (its slot mapping is read)
        self._stride = config.verify_stride

    @property
    def hooks(self) -> Any:
        """The driver's fault injector (None in production)."""
        return self._hooks

    @hooks.setter
    def hooks(self, hooks: Any) -> None:
        self._hooks = hooks
        # decided once: a runtime Protocol check costs tens of microseconds per forward
        self._runner_hooks = hooks if isinstance(hooks, RunnerHooks) else None

    # ------------------------------------------------------------------ install
    def install(self, kv_caches: Mapping[str, torch.Tensor]) -> Canary | None:
        """Calibrate layer 0's layout through its backend's write op and install the canary (None
        with one WARNING when the configuration is out of scope)."""
        _keep_openmp_to_torch()
        from kvcanary.canary import CanaryLaunchCapacities, install

        runner = self.runner
        groups = runner.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            logger.warning("kv-canary: vLLM adapter supports one KV cache group, got %d; "
                           "canary off", len(groups))  # fmt: skip
            return None
        if getattr(runner, "speculative_config", None) is not None:
            logger.warning("kv-canary: vLLM adapter does not support speculative decoding; off")
            return None
        name = groups[0].layer_names[0]
        kv = kv_caches.get(name)
        if not isinstance(kv, torch.Tensor) or kv.device.type != "cpu" or kv.dim() != 4:
            logger.warning("kv-canary: KV cache of %s is not a 4-D CPU tensor; canary off", name)
            return None
        self._layer0 = name
        self.block_size = int(runner.input_batch.block_table[0].block_size)
        if kv.shape[2] != self.block_size:
            logger.warning("kv-canary: KV block dim %d != block size %d; canary off",
                           kv.shape[2], self.block_size)  # fmt: skip
            return None
        self.num_blocks = int(kv.shape[0])
        num_slots = self.num_blocks * self.block_size
        mode = self.config.real_data.value
        k_sources: tuple[Any, ...] = ()
        v_sources: tuple[Any, ...] = ()
        isa = getattr(runner.compilation_config.static_forward_context.get(name), "isa", "?")
        if mode != "none":
            static = runner.compilation_config.static_forward_context
            try:
                self.layout = calibrate_layout(kv, _layer_writer(static, name))
            except (LayoutError, AttributeError, RuntimeError, TypeError) as exc:
                logger.warning(
                    "kv-canary: cannot read the KV layout of %s (dtype %s, ISA %s): %s; real-KV "
                    "checks off for this cache", name, kv.dtype, isa, exc,
                )  # fmt: skip
            else:
                read = 16 if mode == "partial" else self.layout.k.shape[2] * kv.element_size()
                self.sources = build_sources(kv, self.layout, read)
                k_sources, v_sources = self.sources.k_half(), self.sources.v_half()
                self._mirror = self.sources.mirror
        group = BufferGroupSpec(kind=GroupKind.FULL, num_slots=num_slots,
                                k_sources=k_sources, v_sources=v_sources)  # fmt: skip
        sched = runner.vllm_config.scheduler_config
        caps = CanaryLaunchCapacities.from_args(
            req_to_token_pool_size=int(sched.max_num_seqs) + 1,
            max_seq_len_per_req=int(runner.max_model_len), pool_slot_count=num_slots,
            cuda_graph_max_bs=None, speculative_num_draft_tokens=None,
            max_prefill_tokens=int(sched.max_num_batched_tokens), chunked_prefill_size=None,
        )  # fmt: skip
        if self.hooks is not None and hasattr(self.hooks, "runner"):
            self.hooks.runner = runner
        # every launch on this thread: vLLM's OpenMP threads spin on the other cores after each
        # forward, so numba's pool would wait for them (a sweep measured 1.5-2x slower)
        canary = install(self.config, [group], caps, perturb=self.hooks, parallel_launches=False)
        if canary is None:
            return None
        canary.mark_init_finished()
        if self.config.sweep_interval > 0:
            canary.attach_prefix_cache(walker=self.walker)
        self.canary = canary
        logger.info(
            "kv-canary: installed on vLLM (mode=%s real_data=%s sweep_interval=%d "
            "verify_token=%s slots=%d block_size=%d kv=%s %s isa=%s mirrored=%s)",
            self.config.mode.value, mode, self.config.sweep_interval,
            self.config.enable_verify_token_assert, num_slots, self.block_size,
            tuple(kv.shape), kv.dtype, isa, ",".join(self.sources.mirrored) if self.sources
            else "-",
        )  # fmt: skip
        return canary

    def attach_hooks(self, hooks: Any) -> None:
        """Use `hooks` (a driver's fault injector: canary `PerturbHooks` and/or `RunnerHooks`)
        from the next forward on; a driver reaches the worker's process only after install
        (vLLM's `collective_rpc`, `kvcanary.app.vllm.rpc`)."""
        self.hooks = hooks
        if hooks is not None and hasattr(hooks, "runner"):
            hooks.runner = self.runner
        if hooks is not None and hasattr(hooks, "walker"):
            hooks.walker = self.walker  # the scheduler's snapshot of this step (sweep steps)
        if hooks is not None and hasattr(hooks, "mirror"):
            hooks.mirror = self._mirror
        if self.canary is not None:
            self.canary.set_perturber(hooks if hasattr(hooks, "before_plan") else None)

    # ------------------------------------------------------------------ per forward
    def before_forward(self, slot_mapping: Any) -> None:
        """Build this forward's view(s) from the runner and run HEAD for the first wave."""
        canary = self.canary
        if canary is None or STATE.bypass:
            return
        t0 = time.perf_counter()
        try:
            view = self._view(slot_mapping)
            if view is None:
                return
            assert self._prep is not None
            if self._prep.cross:
                self._waves = split_waves(view)
                self.split_forwards += len(self._waves) > 1
            else:
                self._waves = [view]
            if self._mirror is not None and canary.perturbed:  # HEAD folds no real KV: no re-gather
                self._with_flips(self._tail_blocks, canary.pre_forward, view=self._waves[0])
            else:
                canary.pre_forward(view=self._waves[0])
        except Exception:
            self._waves = []
            raise
        finally:
            self.canary_seconds += time.perf_counter() - t0

    def after_forward(self, snapshot: BlockSnapshot | None) -> None:
        """TAIL (and later waves), then the end of the canary's step: sweep when due."""
        canary = self.canary
        if canary is None or not self._waves:
            return
        t0 = time.perf_counter()
        waves, self._waves = self._waves, []
        try:
            mirror = self._mirror
            flips = mirror is not None and canary.perturbed  # see `_with_flips`
            tail = self._tail_blocks  # set only when there is a mirror
            swept = None
            if tail is not None and snapshot is not None and canary.sweep_due:
                swept = snapshot.rows[:, 0]  # a snapshot names each block once
            # Without an injector or runner hooks nothing writes KV between TAIL and the sweep,
            # so the sweep's blocks are gathered with TAIL's, in the same call
            early = swept is not None and not flips and self._runner_hooks is None
            if tail is not None:
                mirror.refresh(tail, swept if early else None)  # what TAIL reads, at check time
            if flips:
                self._with_flips(tail, self._tail_waves, waves=waves)
            elif len(waves) == 1:  # the common forward: one wave
                canary.post_forward(view=waves[0])
            else:
                self._tail_waves(waves)
            if self._runner_hooks is not None:
                self._runner_hooks.after_forward(runner=self.runner, step=canary.step)
            if snapshot is None:  # no walk to count (a sweep due now walks nothing)
                canary.end_step()
            else:
                self._end_step_walking(snapshot, swept, early, flips)
        finally:
            self.figures.forwards += 1
            self._collect()
            self.canary_seconds += time.perf_counter() - t0

    def _end_step_walking(self, snapshot: BlockSnapshot, swept: np.ndarray | None, early: bool,
                          flips: bool) -> None:  # fmt: skip
        """The canary's end of step with `snapshot` bound to the walker; counts a sweep that
        walked it. `swept`: the sweep's blocks when a mirror needs them, gathered with TAIL's
        (`early`) or here, after the runner hooks (the bytes the sweep reads)."""
        canary = self.canary
        assert canary is not None
        walker = self.walker
        walker.snapshot = snapshot
        if swept is not None and not early:
            assert self._mirror is not None
            self._mirror.refresh(swept)
        sweeps, walks = canary.sweep_passes, walker.walks
        try:
            if flips:
                self._with_flips(swept, canary.end_step)
            else:
                canary.end_step()
        finally:
            walker.snapshot = None
            self.figures.sweeps += int(walker.walks > walks and canary.sweep_passes > sweeps)

    def _tail_waves(self, waves: list[ForwardView]) -> None:
        """TAIL of the first wave, then HEAD and TAIL of each later wave."""
        canary = self.canary
        assert canary is not None
        canary.post_forward(view=waves[0])
        for later in waves[1:]:  # rows that hit prefix blocks written by this forward
            canary.pre_forward(view=later)
            canary.post_forward(view=later)

    def _with_flips(self, blocks: np.ndarray | None, fn: Any, **kwargs: Any) -> None:
        """`fn(**kwargs)` (a canary call) while a fault injector is attached and the sources are
        mirrored: inside `KvMirror.flips_written_back` over `blocks`, so an injector's flips of
        mirrored bytes reach the cache instead of being erased by the next re-gather. The hooks
        call the canary directly otherwise (production)."""
        mirror = self._mirror
        if mirror is None or blocks is None:
            fn(**kwargs)
            return
        with mirror.flips_written_back(blocks):
            fn(**kwargs)

    def _view(self, slot_mapping: Any) -> ForwardView | None:
        runner = self.runner
        ib = runner.input_batch
        arrays = self._arrays
        if arrays is None or arrays.batch is not ib:
            arrays = self._arrays = RunnerArrays.of(runner)
            if self._prep is None:
                self._prep = StepPrep(arrays.table, self.block_size, self.num_blocks)
        num_reqs = ib.num_reqs  # a len()
        if num_reqs == 0:
            return None
        qsl = arrays.query_start_loc
        total = int(qsl[num_reqs])
        if total == 0:
            return None
        mapping = slot_mapping.get(self._layer0) if isinstance(slot_mapping, dict) else None
        if not isinstance(mapping, torch.Tensor):
            mapping = arrays.block_table.slot_mapping.cpu
        truth = None
        if self.config.enable_verify_token_assert:
            # the persistent token table, read in place (the canary copies what it checks);
            # the same object while the batch keeps its size, so the view is reused too
            truth = self._truth
            if (truth is None or len(truth.lens) != num_reqs
                    or truth.tokens is not arrays.token_ids):  # fmt: skip
                truth = self._truth = TruthTable(arrays.token_ids, arrays.num_tokens[:num_reqs])
        self.last_request_ids = ib.req_ids[:num_reqs]
        prep = self._prep
        assert prep is not None
        # one compiled call: batch shape, the view's int64 arrays, req_to_token, the wave test
        # (what `view.build_forward_view` builds, tests/adapters/test_vllm_incremental.py)
        # under a verify stride TAIL reads this step's phase only (docs/spec.md §5.5): the
        # mirror re-gathers those blocks and the written ones
        stride = self._stride
        phase = 0 if stride == 1 or self.canary is None else self.canary.step % stride
        view = prep.forward(
            arrays.table, num_reqs, qsl, arrays.num_computed, arrays.num_prompt,
            arrays.input_ids, arrays.positions, self._host.prefix(mapping, total), truth, total,
            stride, phase,
        )  # fmt: skip
        self.chunked_prefill_rows += prep.chunked
        if self._mirror is not None:
            self._tail_blocks = prep.tail_blocks
        return view

    # ------------------------------------------------------------------ figures
    def _collect(self) -> None:
        """Move new violations out of the canary's ring, count them (rows the full ring dropped
        too, by tag and reason, so the metrics never stall), and log at most one line for the
        step naming the vLLM requests whose slots they hit."""
        canary = self.canary
        assert canary is not None
        checks = sum(canary.slot_run_counter.values())
        self.figures.checks += checks - self._last_checks
        self._last_checks = checks
        if canary.ring.changes == self._ring_changes:
            return  # nothing pumped, nothing dropped since the last call: the clean step
        self._ring_changes = canary.ring.changes
        new = canary.drain_violations()
        dropped = canary.ring.dropped_totals
        beyond = {k: n - self._dropped_seen.get(k, 0) for k, n in dropped.items()
                  if n != self._dropped_seen.get(k, 0)}  # fmt: skip
        if not new and not beyond:
            return
        from kvcanary.contract import fail_reason_labels, tag_name

        counts = self.figures.violations
        for v in new:
            for reason in fail_reason_labels(v.fail_reason_bits) or ["none"]:
                key = f"{tag_name(v.kernel_kind)}|{reason}"
                counts[key] = counts.get(key, 0) + 1
        for (tag, reason), n in beyond.items():
            key = f"{tag}|{reason}"
            counts[key] = counts.get(key, 0) + n
        self._dropped_seen = Counter(dropped)
        self.kept.extend(new)
        if len(self.kept) > KEPT_VIOLATIONS:
            del self.kept[: len(self.kept) - KEPT_VIOLATIONS]
        reqs = self._requests_of({v.slot_idx for v in new})
        extra = ""
        if beyond:
            counts = ", ".join(f"{t}/{r}={n}" for (t, r), n in sorted(beyond.items()))
            extra = f" (+ beyond the full ring, by tag/reason: {counts})"
        logger.warning("kv-canary: step %d: %d violation(s)%s; vLLM request(s): %s",
                       canary.step - 1, len(new), extra,
                       ", ".join(reqs) if reqs else "unknown")  # fmt: skip

    def _requests_of(self, slots: set[int]) -> list[str]:
        """Running requests of the last forward whose block table covers one of `slots`."""
        ib = self.runner.input_batch
        bt = ib.block_table[0]
        b = int(bt.block_size)
        blocks = {s // b for s in slots if s >= b}  # block 0 is the null block
        out = []
        for i, rid in enumerate(self.last_request_ids):
            if i < ib.num_reqs and blocks.intersection(bt.block_table.np[i].tolist()):
                out.append(str(rid))
        return out

    def running_requests(self) -> list[str]:
        """The vLLM request ids of the forward the canary checked last."""
        return [str(r) for r in self.last_request_ids]

    def take_figures(self) -> StepFigures:
        """The figures since the previous call (then reset)."""
        out, self.figures = self.figures, StepFigures()
        return out

    def drain_violations(self) -> list[Violation]:
        """Violations collected since the previous drain."""
        out, self.kept = self.kept, []
        return out
