"""The fused forward: HEAD's snapshot, plan and stage in one compiled call, TAIL in another.

`Canary` takes this path for the common forward (one group with one launch per stage, no fault
injector, not `recover`, no write-input assert, a view of plain int64 NumPy arrays) and the
general path (`plan.snapshot_view`, `plan.build_group_plan`, `Canary._run_stage`) for everything
else. The two are the same function of the view: the same records, the same ring rows, the same
errors (tests/canary/test_fused.py checks it on random views, good and bad). Anything the
compiled checks do not pass falls back to the general path before any record is written, and
that path raises the SPEC's error for a bad view.

Why: in vLLM the canary's per-step cost was mostly interpreter time around small kernels (six
calls, their scratch passes and the objects between them), and after a model forward that
Python runs with cold caches at two to three times its warm cost.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from kvcanary.canary.buffers import GroupBuffers
from kvcanary.canary.capacities import CanaryLaunchCapacities
from kvcanary.canary.incidents import PassRows
from kvcanary.canary.kernels.fast_forward import FALLBACK_SWEEP
from kvcanary.canary.plan import GroupPlan, ViewSnapshot
from kvcanary.canary.sources import FoldSources
from kvcanary.contract.tags import LaunchTag
from kvcanary.contract.view import ForwardView, TruthTable

__all__ = ["FusedForward", "PackedForward"]

I64 = npt.NDArray[np.int64]
_INT64 = np.dtype(np.int64)
_TABLE_DTYPES = (np.dtype(np.int32), _INT64)
_NO_WINDOW = 1 << 62
# `kernels.fast_forward` statuses (3: fall back)
_DONE, _PLAN_ONLY, _GROW_SCRATCH, _GROW_PACKED = 0, 1, 2, 4


class PackedForward(NamedTuple):
    """A forward `FusedForward.head` planned: the packed buffer of `kernels.fast_forward` and its
    sizes, the live tables it read, and whether its HEAD stage already ran."""

    packed: I64
    nr: int  # view rows
    nt: int  # flat entries
    nw: int  # write entries
    nv: int  # verify entries
    total_v: int
    overflow: bool
    shadowed: bool
    writes: int  # write entries that store a record
    linear_chain: bool  # the view's
    chain_position: bool  # the chain-position assert runs (enabled, and a linear chain)
    staged: bool  # HEAD ran inside the call (else: too large for one thread)
    recorded: int  # the ring rows HEAD recorded in the scratch (staged only)
    req_to_token: npt.NDArray[np.integer[Any]]
    truth: npt.NDArray[np.integer[Any]]

    def snapshot(self) -> ViewSnapshot:
        """The `ViewSnapshot` the general path would have taken (for a stage it launches)."""
        p, nr, nt = self.packed, self.nr, self.nt
        empty = np.zeros(0, dtype=np.int64)
        return ViewSnapshot(
            rows=p[:nr], prefix_lens=p[nr : 2 * nr], extend_lens=p[2 * nr : 3 * nr],
            input_ids=p[4 * nr : 4 * nr + nt], positions=p[4 * nr + nt : 4 * nr + 2 * nt],
            out_slots=p[4 * nr + 2 * nt : 4 * nr + 3 * nt], req_to_token=self.req_to_token,
            expected_tokens=empty, expected_positions=empty, write_assert=False,
            truth=self.truth, truth_lens=p[3 * nr : 4 * nr],
            linear_chain=self.linear_chain,
        )  # fmt: skip

    def plan(self) -> GroupPlan:
        """The group's `GroupPlan` (slices of the packed buffer)."""
        p, nr, nw, nv = self.packed, self.nr, self.nw, self.nv
        k = 4 * nr + 3 * self.nt
        w0 = k + 2 * nr + 1
        v0 = w0 + nw
        return GroupPlan(
            p[k : k + nr + 1], p[k + nr + 1 : w0], p[w0:v0], p[v0 : v0 + nv],
            p[v0 + nv : v0 + 2 * nv], p[v0 + 2 * nv : v0 + 3 * nv], p[v0 + 3 * nv : v0 + 4 * nv],
            self.total_v, self.overflow, self.shadowed, self.writes,
        )  # fmt: skip


class _Checked(NamedTuple):
    """What `FusedForward._check` made of a view, and the objects it was made from (a later
    view with the same `view`, `given`, `tokens` and `lens` needs no new check)."""

    view: ForwardView
    given: Any  # the view's truth_tokens
    tokens: Any  # a TruthTable's arrays at check time (None for any other truth)
    lens: Any
    args: tuple[Any, ...]  # `forward_head`'s arguments from `rows` to `serial_limit`
    r2t: npt.NDArray[np.integer[Any]]
    truth: npt.NDArray[np.integer[Any]]
    has_truth: bool


def _plain(a: Any) -> bool:
    """A 1-D int64 NumPy array (what the compiled checks take; anything else falls back)."""
    return type(a) is np.ndarray and a.ndim == 1 and a.dtype == _INT64


def _table(a: Any, ndim: int) -> npt.NDArray[np.integer[Any]] | None:
    """`a` as an int32/int64 NumPy array of `ndim` dimensions sharing its memory, or None."""
    if type(a) is torch.Tensor and a.is_cpu and not a.requires_grad:
        a = a.numpy()
    if type(a) is np.ndarray and a.ndim == ndim and a.dtype in _TABLE_DTYPES:
        return a
    return None


class FusedForward:
    """The fused path of one canary: its group's constant kernel arguments, bound once.

    `head(view)` returns None when the general path must run (nothing was written then), else a
    `PackedForward` whose HEAD stage ran in the call (`staged`) or whose stages the runtime
    launches itself (too large for one thread). `tail(fwd)` runs a staged forward's TAIL,
    `sweep(walked)` or `sweep_runs(runs)` a small sweep. Each leaves its ring rows in
    `scratch` (the runtime absorbs them).
    """

    def __init__(
        self,
        kernels: ModuleType,
        group: GroupBuffers,
        launches: dict[str, tuple[LaunchTag, npt.NDArray[np.uint64], FoldSources]],
        capacities: CanaryLaunchCapacities,
        *,
        serial_limit: int,
        token_check: bool,
        scratch: PassRows,
        stride: int = 1,
    ) -> None:
        self._head_kernel = kernels.forward_head
        self._tail_kernel = kernels.forward_tail
        self._sweep_kernel = kernels.sweep_serial
        self._sweep_runs_kernel = kernels.sweep_runs_serial
        self._group = group
        self._serial_limit = serial_limit
        self._token_check = token_check
        self._scratch = scratch
        self._stride = stride
        head_tag, head_words, head_src = launches["head"]
        self.head_tag, self.tail_tag = head_tag, launches["tail"][0]
        tail_tag, tail_words, tail_src = launches["tail"]
        sweep_tag, sweep_words, sweep_src = launches["sweep"]
        self._head = (head_words, *head_src.words, head_src.params, head_src.count, int(head_tag))
        self._tail = (tail_words, *tail_src.words, tail_src.params, tail_src.count, int(tail_tag))
        self._sweep = (sweep_words, *sweep_src.words, sweep_src.params, sweep_src.count,
                       int(sweep_tag))  # fmt: skip
        self._no_truth = np.zeros((0, 0), dtype=np.int64)
        self._no_lens = np.zeros(0, dtype=np.int64)
        # the last view `head` checked and what `_check` made of it
        self._kept: _Checked | None = None
        # the packed plan of the open forward (overwritten by the next `head`; a forward's
        # TAIL runs before the next forward's HEAD)
        self._packed: I64 = np.zeros(1024, dtype=np.int64)
        # `forward_head`'s arguments between the view's and the chain-position flag, bound once
        # (the group, its buffers and the capacities are fixed for the install)
        self._head_plan = (
            capacities.write_req_capacity, capacities.write_entry_capacity,
            group.lut if group.lut is not None else np.zeros(0, dtype=np.int64),
            group.lut is not None, _NO_WINDOW if group.window is None else group.window,
            group.num_slots, group.offset, capacities.verify_capacity, group.write_marks,
            serial_limit,
        )  # fmt: skip

    def head(self, view: ForwardView, chain_position_enabled: bool,
             phase: int = 0) -> PackedForward | None:  # fmt: skip
        """Check, snapshot and plan `view` (verifying `phase` of the verify stride); run its
        HEAD stage when it is small. None: take the general path (a view these checks do not
        pass, or in a form they do not read)."""
        given = view.truth_tokens
        kept = self._kept
        # the same frozen view (an adapter refills one while the batch keeps its shape) over the
        # same NumPy arrays and truth table was checked by an earlier call: nothing to check again
        if (kept is None or kept.view is not view or kept.given is not given
                or (type(given) is TruthTable
                    and (kept.tokens is not given.tokens or kept.lens is not given.lens))):  # fmt: skip
            kept = self._check(view)
            if kept is None:
                return None
        linear_chain = bool(view.linear_chain)
        chain_position = chain_position_enabled and linear_chain
        scratch = self._scratch
        while True:
            out = self._head_kernel(self._packed, *kept.args, chain_position, self._stride,
                                    phase, *self._head, scratch.words, scratch.state)  # fmt: skip
            status = out[0]
            # on a grow status nothing was written: plan again (a pure function of the view)
            if status == _GROW_SCRATCH:
                scratch.prepare(out[1])
            elif status == _GROW_PACKED:
                self._packed = np.empty(max(out[1], 2 * len(self._packed)), dtype=np.int64)
            else:
                break
        if status > _GROW_SCRATCH:
            return None
        _, _, nr, nt, nw, nv, total_v, overflow, shadowed, writes, recorded = out
        packed = self._packed
        return PackedForward(
            packed, nr, nt, nw, nv, total_v, overflow, shadowed, writes, linear_chain,
            chain_position, status == _DONE, recorded, kept.r2t,
            kept.truth if kept.has_truth else np.zeros((nr, 0), dtype=np.int64),
        )  # fmt: skip

    def _check(self, view: ForwardView) -> _Checked | None:
        """`view`'s arrays and tables in the form the compiled checks take (None: the general
        path). Kept for the next call when every table is a NumPy array (a tensor's NumPy view
        is taken again each call: a tensor can be resized under it)."""
        arrays = (view.rows, view.prefix_lens, view.extend_lens, view.input_ids, view.positions,
                  view.out_slots)  # fmt: skip
        r2t = _table(view.req_to_token, 2)
        if r2t is None or not all(map(_plain, arrays)):
            return None
        truth: npt.NDArray[np.integer[Any]] = self._no_truth
        lens: npt.NDArray[np.integer[Any]] = self._no_lens
        given = view.truth_tokens
        has_truth = self._token_check and given is not None
        tables: list[Any] = [view.req_to_token]
        if has_truth:
            if type(given) is not TruthTable:
                return None
            table, lengths = _table(given.tokens, 2), _table(given.lens, 1)
            if table is None or lengths is None:
                return None
            truth, lens = table, lengths
            tables += (given.tokens, given.lens)
        kept_table = given if isinstance(given, TruthTable) else None
        checked = _Checked(
            view, given, None if kept_table is None else kept_table.tokens,
            None if kept_table is None else kept_table.lens,
            (*arrays, r2t, truth, lens, has_truth, *self._head_plan), r2t, truth, has_truth,
        )  # fmt: skip
        if all(type(t) is np.ndarray for t in tables):
            self._kept = checked
        return checked

    def tail(self, fwd: PackedForward) -> int:
        """The TAIL stage of a staged forward (its rows in the scratch); returns how many."""
        scratch = self._scratch
        recorded: int = self._tail_kernel(
            fwd.packed, fwd.nr, fwd.nt, fwd.nw, fwd.nv, fwd.overflow, fwd.shadowed,
            fwd.chain_position, *self._tail, scratch.words, scratch.state,
        )  # fmt: skip
        return recorded

    def sweep(self, walked: I64) -> bool:
        """Verify a walk (`[n, 3]` int64, from `view_checks.walker_entries`) in the TAIL buffer
        (rows in the scratch). False: take the general path (nothing was verified): a slot out
        of the group's range, or a walk too large for one thread."""
        if len(walked) >= self._serial_limit or not walked.flags.c_contiguous:
            return False
        scratch = self._scratch
        n_slots = self._group.num_slots
        done = self._sweep_kernel(walked, n_slots, *self._sweep, scratch.words, scratch.state)
        if -len(walked) <= done < 0:  # the scratch ring needs room for one row per entry
            scratch.prepare(-done)
            done = self._sweep_kernel(walked, n_slots, *self._sweep, scratch.words, scratch.state)
        return bool(done >= 0)

    def sweep_runs(self, runs: I64) -> int:
        """`sweep` of a walk given as runs (`[m, 4]`, from `view_checks.walker_runs`), expanded
        inside the compiled call; returns the entries verified, or -1: take the general path
        (nothing was verified): a run out of the group's range or malformed, or a walk too
        large for one thread."""
        scratch = self._scratch
        n_slots, limit = self._group.num_slots, self._serial_limit
        done: int = self._sweep_runs_kernel(runs, n_slots, limit, *self._sweep, scratch.words,
                                            scratch.state)  # fmt: skip
        if FALLBACK_SWEEP < done < 0:  # the scratch ring needs room for one row per entry
            scratch.prepare(-done)
            done = self._sweep_runs_kernel(runs, n_slots, limit, *self._sweep, scratch.words,
                                           scratch.state)  # fmt: skip
        return done if done >= 0 else -1
