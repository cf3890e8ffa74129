"""Faults injected into a live vLLM engine, each journaled as a `PerturbRecord` and turned into a
`Fault` for 1:1 correlation (the self-test's `correlate`).

- `block_table_swap`: one entry of a running request's block table (a block fully inside its
  computed prefix, not the block its next token chains from) points at another request's live
  block for one forward; attention really reads the wrong block (the table is edited before vLLM
  copies it to the kernels' buffers) and it is restored after the forward.
- `kv_flip_used`: one bit of layer-0 V (inside the bytes the canary folds) of a token in the
  computed prefix of a request scheduled in this forward.
- `kv_flip_cached`: the same in a block of vLLM's prefix cache that no request holds
  (`ref_cnt == 0` in the scheduler's snapshot the sweep walks), just before that sweep.
- `stale_prefix_hit` (a planted vLLM bug in the scheduler's `BlockPool`,
  `kvcanary.app.vllm.stale_plant`, reached through the connector's metadata): eviction forgets
  to drop the block's hash, so a later lookup of that hash returns the block after it was handed
  out and re-filled with another sequence. The firing counts once a forward reads the block.

The injector lives in the worker's process, beside the canary (`kvcanary.app.vllm.rpc` attaches
it and arms it from the driver), so it works in every vLLM process layout.

One firing per armed run, at or after `first_step`; draws come from `random.Random(seed)`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvcanary.adapters.vllm.mirror import KvMirror
from kvcanary.adapters.vllm.state import STATE, RunnerHooks
from kvcanary.adapters.vllm.sweep import SnapshotWalker
from kvcanary.app.selftest.correlate import Fault
from kvcanary.app.vllm.stale_plant import (
    ArmStalePlant,
    ReleaseGhost,
    StalePending,
    StopStalePlant,
)
from kvcanary.canary import PerturbRecord
from kvcanary.canary.perturb_seam import CanaryState
from kvcanary.contract import ForwardView

__all__ = ["VLLM_FAULT_MODES", "VllmFaultInjector", "install_prepare_inputs_hook"]

VLLM_FAULT_MODES = ("block_table_swap", "kv_flip_used", "kv_flip_cached", "stale_prefix_hit")


@dataclass
class _Armed:
    mode: str
    seed: int
    first_step: int
    rng: random.Random
    fired: bool = False


class VllmFaultInjector:
    """Canary perturber (`PerturbHooks` + `BindsCanary`) and adapter `RunnerHooks` in one,
    attached to the worker's canary (`CanaryWorker.attach_hooks`), then `arm` / `disarm` around
    each run. `outbox` / `inbox` carry the `stale_prefix_hit` plant's messages to and from the
    scheduler's process (the connector's `DriverMessage` channel)."""

    def __init__(self) -> None:
        self.canary: CanaryState | None = None
        self.runner: Any = None
        self.walker: SnapshotWalker | None = None
        #: the worker's copy of non-token-major KV bytes (AMX layouts), refreshed after a flip
        self.mirror: KvMirror | None = None
        self.records: list[PerturbRecord] = []
        self._armed: _Armed | None = None
        self._restore: tuple[int, int, int] | None = None
        self._pending: dict[int, tuple[int, int]] = {}  # ghost block id -> (index, block size)
        self._written: npt.NDArray[np.int64] | None = None  # slot -> (token, position) fed
        self._out: list[Any] = []  # messages for the scheduler's process

    # ------------------------------------------------------------------ run control
    def arm(self, mode: str, *, seed: int, first_step: int) -> None:
        """Fire `mode` once at the first chance at or after canary step `first_step`."""
        if mode not in VLLM_FAULT_MODES:
            raise ValueError(
                f"unknown vLLM fault {mode!r}; choose from {', '.join(VLLM_FAULT_MODES)}"
            )
        self.records = []
        self._armed = _Armed(mode, seed, first_step, random.Random(seed))
        if mode == "stale_prefix_hit":
            now = self.canary.step if self.canary is not None else 0
            self._out.append(ArmStalePlant(steps_ahead=max(0, first_step - now)))

    def disarm(self) -> list[PerturbRecord]:
        """Stop injecting (the plant goes with the next message or prefix-cache reset); the
        run's journal."""
        if self._armed is not None and self._armed.mode == "stale_prefix_hit":
            self._out.append(StopStalePlant())
        self._armed, self._pending = None, {}
        return list(self.records)

    def outbox(self) -> list[Any]:
        """Messages for the scheduler's process (taken once per step by the connector)."""
        out, self._out = self._out, []
        return out

    def inbox(self, messages: list[Any]) -> None:
        """The scheduler's messages for this step (before its HEAD)."""
        for m in messages:
            if isinstance(m, StalePending) and self._armed is not None:
                self._pending[m.block] = (m.index, m.size)

    def injections(self) -> list[PerturbRecord]:
        """The journal of the current run."""
        return list(self.records)

    def _due(self, mode: str, step: int) -> _Armed | None:
        a = self._armed
        return (
            a if a is not None and a.mode == mode and not a.fired and step >= a.first_step else None
        )

    def _record(self, a: _Armed, step: int, slot: int, position: int, **extras: Any) -> None:
        a.fired = True
        self.records.append(
            PerturbRecord(mode=a.mode, step=step, slot=slot, position=position, group="full",
                          seed=a.seed, extras=extras)
        )  # fmt: skip

    # ------------------------------------------------------------------ canary seam
    def bind(self, canary: CanaryState) -> None:
        """Remember the canary (its step counter is the journal's clock)."""
        self.canary = canary

    def before_plan(self, *, view: ForwardView, step: int) -> None:
        """`kv_flip_used`, and confirmation of a pending `stale_prefix_hit`."""
        self._note_writes(view)
        if self._pending:
            self._confirm_stale_reads(view, step)
        a = self._due("kv_flip_used", step)
        if a is None or self.runner is None:
            return
        rows = [i for i, p in enumerate(view.prefix_lens.tolist()) if p > 0]
        if not rows:
            return
        i = a.rng.choice(rows)
        pos = a.rng.randrange(int(view.prefix_lens[i]))
        slot = int(view.req_to_token[int(view.rows[i]), pos])
        byte = self._flip(slot, a.rng)
        self._record(a, step, slot, pos, byte=byte, req_row=int(view.rows[i]))

    def after_tail(self, *, view: ForwardView, step: int) -> None:
        """Nothing to do after TAIL."""

    def at_end_step(self, *, step: int, sweep_due: bool) -> None:
        """`kv_flip_cached`: just before a sweep, in a cached block nobody holds."""
        a = self._due("kv_flip_cached", step)
        snap = self.walker.snapshot if self.walker is not None else None
        if a is None or not sweep_due or snap is None or self.runner is None:
            return
        idle = snap.rows[snap.rows[:, 3] == 0]  # (block, index, parent, held): nobody holds it
        if not len(idle):
            return
        block, index = (int(x) for x in idle[a.rng.randrange(len(idle))][:2])
        size = snap.block_size
        t = a.rng.randrange(size)
        slot = block * size + t
        byte = self._flip(slot, a.rng)
        self._record(a, step, slot, index * size + t, byte=byte, block=block)

    def maybe_swap_next_tokens(self, *, tokens: list[int], step: int) -> list[int]:
        """No token swaps against vLLM."""
        return tokens

    # ------------------------------------------------------------------ vLLM seam
    def before_prepare_inputs(self, *, runner: Any, step: int) -> None:
        """`block_table_swap`: point one computed-prefix block at another live block."""
        self.runner = runner
        a = self._due("block_table_swap", step)
        if a is None:
            return
        ib = runner.input_batch
        bt = ib.block_table[0]
        size, table = int(bt.block_size), bt.block_table.np
        n = ib.num_reqs
        computed = [int(c) for c in ib.num_computed_tokens_cpu[:n]]
        # (row, index) of every full computed block; a swap target must be another block at a
        # different sequence index, so its records cannot match by accident
        full = [(r, j) for r in range(n) for j in range(computed[r] // size)]
        victims = [(r, j) for r in range(n) for j in range((computed[r] - 1) // size)]
        a.rng.shuffle(victims)
        for r, j in victims:
            own = int(table[r, j])
            donors = [
                int(table[r2, j2]) for r2, j2 in full
                if j2 != j and int(table[r2, j2]) not in (own, 0)
                and int(table[r2, j2]) not in table[r, : computed[r] // size + 1]
            ]  # fmt: skip
            if donors:
                donor = a.rng.choice(donors)
                table[r, j] = donor
                self._restore = (r, j, own)
                slots = [donor * size + t for t in range(size)]
                self._record(a, step, slots[0], j * size, row=r, index=j, original_block=own,
                             donor_block=donor, slots=slots, block_size=size)  # fmt: skip
                return

    def after_forward(self, *, runner: Any, step: int) -> None:
        """Undo a `block_table_swap` (the next forward copies the restored table)."""
        if self._restore is not None:
            r, j, own = self._restore
            runner.input_batch.block_table[0].block_table.np[r, j] = own
            self._restore = None

    # ------------------------------------------------------------------ helpers
    def _flip(self, slot: int, rng: random.Random) -> int:
        """Flip one bit of a byte the canary folds (the first 16 bytes of head 0's V of `slot`,
        placed by the calibrated layout) in the live layer-0 cache; the byte's index."""
        kv = self.runner.kv_caches[0]
        layout = STATE.layout
        assert layout is not None, "the vLLM fault campaign needs real-KV checks (layout)"
        b = layout.block_size
        byte = rng.randrange(16)
        offset = int(layout.token_bytes("v", 0, slot % b)[byte])
        kv.view(torch.uint8).view(kv.shape[0], -1)[slot // b, offset] ^= 1 << rng.randrange(8)
        if self.mirror is not None:  # the canary reads these bytes through the mirror: as a
            self.mirror.refresh(np.array([slot // b]))  # real fault, the flip shows at once
        return byte

    def _note_writes(self, view: ForwardView) -> None:
        """Remember the token and position vLLM feeds into every slot (ground truth for the
        planted bug, taken from vLLM's inputs rather than from the canary's stamps)."""
        if self._written is None:
            assert self.canary is not None
            self._written = np.full((self.canary.groups[0].num_slots, 2), -1, dtype=np.int64)
        slots = np.asarray(view.out_slots)
        ok = slots > 0
        self._written[slots[ok], 0] = np.asarray(view.input_ids)[ok]
        self._written[slots[ok], 1] = np.asarray(view.positions)[ok]

    def _confirm_stale_reads(self, view: ForwardView, step: int) -> None:
        a = self._armed
        if a is None or a.fired or self._written is None or self.runner is None:
            return
        table, truth = view.req_to_token, self.runner.input_batch.token_ids_cpu
        for i, row in enumerate(view.rows.tolist()):
            prefix = int(view.prefix_lens[i])
            for block, (index, b) in list(self._pending.items()):
                if index * b >= prefix or int(table[row, index * b]) != block * b:
                    continue
                held = self._written[block * b : (block + 1) * b]
                want_tok = truth[row - 1, index * b : (index + 1) * b]
                want_pos = np.arange(index * b, (index + 1) * b)
                if np.array_equal(held[:, 0], want_tok) and np.array_equal(held[:, 1], want_pos):
                    # the block still holds exactly what the reader needs: harmless, re-arm
                    del self._pending[block]
                    self._out.append(ReleaseGhost())
                    continue
                slots = [block * b + t for t in range(b)]
                self._record(a, step, slots[0], index * b, block=block, index=index,
                             slots=slots, block_size=b, req_row=row)  # fmt: skip
                self._pending = {}
                self._out.append(StopStalePlant())
                return

    def faults(self, *, sweep_interval: int) -> list[Fault]:
        """The journal as correlatable faults: the slots each fault corrupted and the
        positions of the block it hit plus the next one (a chain that runs through the wrong
        block breaks at the next block's first token)."""
        out = []
        for r in self.records:
            slots = frozenset(r.extras.get("slots", [r.slot]))  # type: ignore[arg-type]
            size = r.extras.get("block_size")
            positions: frozenset[int] = frozenset()
            if isinstance(size, int):
                positions = frozenset(range(r.position, r.position + size + 1))
            window = max(1, sweep_interval) if r.mode == "kv_flip_cached" else 1
            out.append(Fault(r.mode, r.step, "full", slots, window, positions=positions,
                             detail=str(dict(r.extras))))  # fmt: skip
        return out


def install_prepare_inputs_hook() -> None:
    """Driver-only patch of `GPUModelRunner._prepare_inputs` (vllm/v1/worker/gpu_model_runner.py):
    the runner's canary hooks' `before_prepare_inputs` runs first, while the persistent batch is up to date and
    its block table is not yet copied to the kernels' buffers (`block_table_swap` needs that
    moment; the KV-connector API has no hook there). The plugin never installs it."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._prepare_inputs
    if getattr(original, "__kvcanary_wrapped__", False):
        return

    def _prepare_inputs(self: Any, *args: Any, **kw: Any) -> Any:
        workers = [c.worker for c in STATE.live_connectors() if c.worker is not None
                   and c.worker.runner is self and c.worker.canary is not None]  # fmt: skip
        if workers and isinstance(workers[-1].hooks, RunnerHooks):
            workers[-1].hooks.before_prepare_inputs(runner=self, step=workers[-1].canary.step)
        return original(self, *args, **kw)

    _prepare_inputs.__kvcanary_wrapped__ = True  # type: ignore[attr-defined]
    _prepare_inputs.__wrapped__ = original  # type: ignore[attr-defined]
    GPUModelRunner._prepare_inputs = _prepare_inputs
