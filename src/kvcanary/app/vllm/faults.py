"""Faults injected into a live vLLM engine, each journaled as a `PerturbRecord` and turned into a
`Fault` for 1:1 correlation (the self-test's `correlate`).

- `block_table_swap`: one entry of a running request's block table (a block fully inside its
  computed prefix, not the block its next token chains from) points at another request's live
  block for one forward; attention really reads the wrong block (the table is edited before vLLM
  copies it to the kernels' buffers) and it is restored after the forward.
- `kv_flip_used`: one bit of layer-0 V (inside the bytes the canary folds) of a token in the
  computed prefix of a request scheduled in this forward.
- `kv_flip_cached`: the same in a block of vLLM's prefix cache that no request holds
  (`ref_cnt == 0`), just before a sweep.
- `stale_prefix_hit` (a planted vLLM bug, monkeypatched into `BlockPool`): eviction forgets to
  drop the block's hash, so a later lookup of that hash returns the block after it was handed
  out and re-filled with another sequence. The firing counts once a forward reads the block.

One firing per armed run, at or after `first_step`; draws come from `random.Random(seed)`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvcanary.adapters.vllm.state import STATE, RunnerHooks
from kvcanary.app.selftest.correlate import Fault
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
    """Canary perturber (`PerturbHooks` + `BindsCanary`) and adapter `RunnerHooks` in one: set as
    `STATE.hooks` before the engine is built, then `arm` / `disarm` around each run."""

    def __init__(self) -> None:
        self.canary: CanaryState | None = None
        self.runner: Any = None
        self.records: list[PerturbRecord] = []
        self._armed: _Armed | None = None
        self._restore: tuple[int, int, int] | None = None
        self._unpatch: Callable[[], None] | None = None
        self._pending: dict[int, tuple[int, int]] = {}  # ghost block id -> (index, block size)
        self._ghost_key: Any = None  # the one stale hash this run's plant answers
        self._written: npt.NDArray[np.int64] | None = None  # slot -> (token, position) fed

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
            self._unpatch = _plant_stale_prefix_hit(self)

    def disarm(self) -> list[PerturbRecord]:
        """Stop injecting (and unpatch the planted bug); the run's journal."""
        if self._unpatch is not None:
            self._unpatch()
            self._unpatch = None
        self._armed, self._pending, self._ghost_key = None, {}, None
        return list(self.records)

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
        pool = STATE.pools[-1]() if STATE.pools else None
        if a is None or not sweep_due or pool is None or self.runner is None:
            return
        entries = STATE.ledger.entries
        idle = [
            b for b in pool.blocks
            if b.block_hash is not None and b.ref_cnt == 0 and not b.is_null
            and b.block_id in entries and entries[b.block_id].block_hash == b.block_hash
        ]  # fmt: skip
        if not idle:
            return
        blk = a.rng.choice(idle)
        size = int(self.runner.input_batch.block_table[0].block_size)
        t = a.rng.randrange(size)
        slot = blk.block_id * size + t
        byte = self._flip(slot, a.rng)
        self._record(a, step, slot, entries[blk.block_id].index * size + t, byte=byte,
                     block=blk.block_id)  # fmt: skip

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
        return byte

    def _note_writes(self, view: ForwardView) -> None:
        """Remember the token and position vLLM feeds into every slot (ground truth for the
        planted bug, taken from vLLM's inputs rather than from the canary's stamps)."""
        if self._written is None:
            assert self.canary is not None
            self._written = np.full((self.canary.groups[0].num_slots, 2), -1, dtype=np.int64)
        slots = view.out_slots.numpy()
        ok = slots > 0
        self._written[slots[ok], 0] = view.input_ids.numpy()[ok]
        self._written[slots[ok], 1] = view.positions.numpy()[ok]

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
                    self._ghost_key = None
                    continue
                slots = [block * b + t for t in range(b)]
                self._record(a, step, slots[0], index * b, block=block, index=index,
                             slots=slots, block_size=b, req_row=row)  # fmt: skip
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


def _plant_stale_prefix_hit(injector: VllmFaultInjector) -> Callable[[], None]:
    """Monkeypatch `BlockPool` with the planted bug; returns the function that removes it.

    Ground truth for "the stale block now holds something else" comes from vLLM's scheduler:
    the token ids and sequence index each block was last cached with (`cache_full_blocks`).
    The plant answers a lookup only when those differ from what the evicted hash stood for.
    """
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    saved = {n: BlockPool.__dict__[n] for n in
             ("_maybe_evict_cached_block", "get_cached_block", "cache_full_blocks")}  # fmt: skip
    content: dict[int, tuple[int, tuple[int, ...]]] = {}  # block id -> (index, token ids)
    ghosts: dict[Any, tuple[Any, int, tuple[int, ...]]] = {}  # evicted hash -> block, what

    def cache_full_blocks(
        self: Any, request: Any, blocks: Any, num_cached_blocks: int, num_full_blocks: int,
        block_size: int, *args: Any, **kw: Any,
    ) -> Any:  # fmt: skip
        out = saved["cache_full_blocks"](self, request, blocks, num_cached_blocks,
                                         num_full_blocks, block_size, *args, **kw)  # fmt: skip
        tokens, size = request.all_token_ids, block_size
        for i in range(num_cached_blocks, num_full_blocks):
            if not blocks[i].is_null:
                content[blocks[i].block_id] = (i, tuple(tokens[i * size : (i + 1) * size]))
        return out

    def _maybe_evict_cached_block(self: Any, block: Any) -> bool:
        key, held = block.block_hash, content.get(block.block_id)
        evicted: bool = saved["_maybe_evict_cached_block"](self, block)
        if evicted and key is not None and held is not None:
            ghosts[key] = (block, *held)  # the bug: the hash still points at the block
        return evicted

    def get_cached_block(self: Any, block_hash: Any, group_ids: list[int]) -> Any:
        found = saved["get_cached_block"](self, block_hash, group_ids)
        a, canary = injector._armed, injector.canary
        if found is not None or a is None or a.fired or canary is None:
            return found
        key = make_block_hash_with_group_id(block_hash, group_ids[0])
        ghost = ghosts.get(key)
        if ghost is None or canary.step < a.first_step or injector._ghost_key not in (None, key):
            return found
        block, index, tokens = ghost
        now = content.get(block.block_id)
        # harmless while the block holds, or is being filled with, the same tokens at the same
        # index (e.g. it was handed to a request with the same prefix): no firing then
        if block.block_hash is None or now is None or now == (index, tokens):
            return found
        injector._pending[block.block_id] = (index, len(tokens))
        injector._ghost_key = key
        return [block]

    BlockPool.cache_full_blocks = cache_full_blocks
    BlockPool._maybe_evict_cached_block = _maybe_evict_cached_block
    BlockPool.get_cached_block = get_cached_block

    def unpatch() -> None:
        for name, fn in saved.items():
            setattr(BlockPool, name, fn)

    return unpatch


def install_prepare_inputs_hook() -> None:
    """Driver-only patch of `GPUModelRunner._prepare_inputs` (vllm/v1/worker/gpu_model_runner.py):
    `STATE.hooks.before_prepare_inputs` runs first, while the persistent batch is up to date and
    its block table is not yet copied to the kernels' buffers (`block_table_swap` needs that
    moment; the KV-connector API has no hook there). The plugin never installs it."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._prepare_inputs
    if getattr(original, "__kvcanary_wrapped__", False):
        return

    def _prepare_inputs(self: Any, *args: Any, **kw: Any) -> Any:
        hooks = STATE.hooks
        workers = [c.worker for c in STATE.live_connectors() if c.worker is not None]
        if isinstance(hooks, RunnerHooks) and workers and workers[-1].canary is not None:
            hooks.before_prepare_inputs(runner=self, step=workers[-1].canary.step)
        return original(self, *args, **kw)

    _prepare_inputs.__kvcanary_wrapped__ = True  # type: ignore[attr-defined]
    _prepare_inputs.__wrapped__ = original  # type: ignore[attr-defined]
    GPUModelRunner._prepare_inputs = _prepare_inputs
