"""The planted vLLM bug behind the `stale_prefix_hit` fault, in the scheduler's process.

vLLM's block pool lives with the scheduler (the engine-core process by default), the canary and
the fault injector with the worker (a process of its own under vLLM's default multiprocess
executor). The two talk through the canary connector's per-step metadata (`DriverMessage`):

- worker -> scheduler: `ArmStalePlant` (patch `BlockPool` now, answer stale lookups after
  `steps_ahead` scheduler steps), `ReleaseGhost` (the block handed out still held what the
  reader needed: harmless, plant another one), `StopStalePlant` (recorded: stop and unpatch);
- scheduler -> worker: `StalePending` (a lookup was answered with a stale block: confirm the
  read at the next HEAD).

The bug: eviction forgets to drop the block's hash, so a later lookup of that hash returns the
block after it was handed out and re-filled with another sequence. The plant answers only when
the tokens and sequence index the block was last cached with (vLLM's own `cache_full_blocks`)
differ from what the evicted hash stood for. vLLM's `reset_prefix_cache(reset_connector=True)`
unpatches it (`reset`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ArmStalePlant", "ReleaseGhost", "StalePending", "StalePlant", "StopStalePlant"]

AGENT = "stale_prefix_hit"


@dataclass(frozen=True)
class StalePending:
    """Scheduler -> worker: `block` was handed out for sequence index `index` (block `size`)."""

    block: int
    index: int
    size: int


class StalePlant:
    """The scheduler-side agent: `BlockPool` patched while it lives."""

    def __init__(self, steps_ahead: int) -> None:
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        self.countdown = steps_ahead
        self.ghost_key: Any = None  # the one stale hash the plant answers at a time
        self._out: list[StalePending] = []
        names = ("_maybe_evict_cached_block", "get_cached_block", "cache_full_blocks")
        saved = {n: BlockPool.__dict__[n] for n in names}
        self._saved = saved
        content: dict[int, tuple[int, tuple[int, ...]]] = {}  # block id -> (index, token ids)
        ghosts: dict[Any, tuple[Any, int, tuple[int, ...]]] = {}  # evicted hash -> block, what
        plant = self

        def cache_full_blocks(
            self: Any, request: Any, blocks: Any, num_cached_blocks: int, num_full_blocks: int,
            block_size: int, *args: Any, **kw: Any,
        ) -> Any:  # fmt: skip
            out = saved["cache_full_blocks"](self, request, blocks, num_cached_blocks,
                                             num_full_blocks, block_size, *args, **kw)  # fmt: skip
            tokens = request.all_token_ids
            for i in range(num_cached_blocks, num_full_blocks):
                if not blocks[i].is_null:
                    content[blocks[i].block_id] = (
                        i,
                        tuple(tokens[i * block_size : (i + 1) * block_size]),
                    )
            return out

        def _maybe_evict_cached_block(self: Any, block: Any) -> bool:
            key, held = block.block_hash, content.get(block.block_id)
            evicted: bool = saved["_maybe_evict_cached_block"](self, block)
            if evicted and key is not None and held is not None:
                ghosts[key] = (block, *held)  # the bug: the hash still points at the block
            return evicted

        def get_cached_block(self: Any, block_hash: Any, group_ids: list[int]) -> Any:
            found = saved["get_cached_block"](self, block_hash, group_ids)
            if found is not None or plant.countdown > 0:
                return found
            key = make_block_hash_with_group_id(block_hash, group_ids[0])
            ghost = ghosts.get(key)
            if ghost is None or plant.ghost_key not in (None, key):
                return found
            block, index, tokens = ghost
            now = content.get(block.block_id)
            # harmless while the block holds, or is being filled with, the same tokens at the
            # same index (e.g. it was handed to a request with the same prefix): no firing then
            if block.block_hash is None or now is None or now == (index, tokens):
                return found
            plant.ghost_key = key
            plant._out.append(StalePending(int(block.block_id), index, len(tokens)))
            return [block]

        BlockPool.cache_full_blocks = cache_full_blocks
        BlockPool._maybe_evict_cached_block = _maybe_evict_cached_block
        BlockPool.get_cached_block = get_cached_block

    def outbox(self) -> list[StalePending]:
        """Called once per scheduler step: count down, hand over this step's answers."""
        self.countdown -= 1
        out, self._out = self._out, []
        return out

    def reset(self) -> None:
        """Unpatch `BlockPool`."""
        from vllm.v1.core.block_pool import BlockPool

        for name, fn in self._saved.items():
            setattr(BlockPool, name, fn)


def _replace(connector: Any, agent: StalePlant | None) -> None:
    old = connector.agents.pop(AGENT, None)
    if old is not None:
        old.reset()
    if agent is not None:
        connector.agents[AGENT] = agent


@dataclass(frozen=True)
class ArmStalePlant:
    """Worker -> scheduler: plant the bug, live after `steps_ahead` scheduler steps."""

    steps_ahead: int

    def deliver(self, connector: Any) -> None:
        """Install a fresh plant (replacing an earlier one)."""
        _replace(connector, StalePlant(self.steps_ahead))


@dataclass(frozen=True)
class ReleaseGhost:
    """Worker -> scheduler: the answered block was harmless; the plant may answer another."""

    def deliver(self, connector: Any) -> None:
        """Forget the current ghost."""
        agent = connector.agents.get(AGENT)
        if agent is not None:
            agent.ghost_key = None


@dataclass(frozen=True)
class StopStalePlant:
    """Worker -> scheduler: the firing was recorded (or the run disarmed): unpatch."""

    def deliver(self, connector: Any) -> None:
        """Remove the plant."""
        _replace(connector, None)
