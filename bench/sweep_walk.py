"""A prefix-cache sweep of a paged cache: the walk as runs (`walk_runs`, one per block, expanded
inside the canary's compiled sweep) against the same walk as an `[n, 3]` array (`walk_array`,
expanded first), in one process.

For each `--blocks` size, one canary (`log`, real-data `partial` over one 32-byte K source,
one-thread launches as in vLLM) covers a pool of that many blocks of `--block-size` slots.
`--requests` requests fill it in one forward (each a chain of blocks in a shuffled block
order), then the canary sweeps every step: vLLM's `SnapshotWalker` over the blocks' snapshot,
once offering runs and once (a wrapper) only the `[n, 3]` array. The two alternate for
`--repeats` rounds; printed per size: the entries a sweep verifies, the median µs of each
(`Canary.end_step`, the sweep and its walk) and their ratio. A sweep that reports a violation
stops the bench (the pool is clean).

    python bench/sweep_walk.py [--blocks 1024,16384] [--block-size 32] [--requests 64]
                               [--repeats 15] [--seed 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from kvcanary.adapters.vllm.sweep import BlockSnapshot, SnapshotWalker
from kvcanary.canary import Canary, CanaryLaunchCapacities, install
from kvcanary.canary.config import CanaryConfig, CanaryMode, RealDataMode
from kvcanary.contract import BufferGroupSpec, ForwardView, GroupKind, RealKvSource
from scaling import int_list  # bench/scaling.py: comma-separated integers >= 1, as argparse type

TOKEN_BYTES = 32


class ArrayOnly:
    """The same walker offering only the `[n, 3]` walk (the path before runs)."""

    def __init__(self, walker: SnapshotWalker) -> None:
        self.inner = walker

    def walk(self, *, unlocked_only: bool = False, swa_resident_only: bool = False) -> Any:
        return self.inner.walk(unlocked_only=unlocked_only)

    def walk_array(self, *, unlocked_only: bool = False,
                   swa_resident_only: bool = False) -> np.ndarray:  # fmt: skip
        return self.inner.walk_array(unlocked_only=unlocked_only)


def filled_canary(blocks: int, b: int, requests: int,
                  rng: np.random.Generator) -> tuple[Canary, BlockSnapshot]:  # fmt: skip
    """A canary over `blocks` blocks (block 0 the null block) whose every other block holds
    written KV of one of `requests` chains, and the snapshot of those blocks."""
    per = (blocks - 1) // requests
    order = rng.permutation(blocks - 1)[: per * requests].reshape(requests, per) + 1
    num_slots = blocks * b
    k = torch.from_numpy(rng.integers(0, 256, (num_slots, TOKEN_BYTES), dtype=np.uint8))
    sources = (RealKvSource(k, 1, TOKEN_BYTES, 16),)
    group = BufferGroupSpec(kind=GroupKind.FULL, num_slots=num_slots, k_sources=sources,
                            v_sources=sources)  # fmt: skip
    config = CanaryConfig(mode=CanaryMode.LOG, real_data=RealDataMode.PARTIAL, sweep_interval=1,
                          stats_print_every_n_steps=0)  # fmt: skip
    width = per * b
    caps = CanaryLaunchCapacities(write_req_capacity=requests, write_entry_capacity=requests * width,
                                  verify_capacity=requests * width, max_seq_len_per_req=width)  # fmt: skip
    canary = install(config, [group], caps, parallel_launches=False)
    assert canary is not None
    canary.mark_init_finished()
    r2t = np.zeros((requests + 1, width), dtype=np.int64)
    r2t[1:] = (order[:, :, None] * b + np.arange(b)).reshape(requests, width)
    n = requests * width
    view = ForwardView(rows=np.arange(1, requests + 1), prefix_lens=np.zeros(requests, np.int64),
                       extend_lens=np.full(requests, width, np.int64),
                       input_ids=rng.integers(0, 32000, n), positions=np.tile(np.arange(width), requests),
                       out_slots=r2t[1:].reshape(-1).copy(), req_to_token=r2t)  # fmt: skip
    canary.pre_forward(view=view)
    canary.post_forward(view=view)
    rows = np.zeros((per * requests, 4), dtype=np.int64)
    rows[:, 0] = order.reshape(-1)
    rows[:, 1] = np.tile(np.arange(per), requests)
    parents = np.concatenate([np.full((requests, 1), -1), order[:, :-1]], axis=1)
    rows[:, 2] = parents.reshape(-1)
    rows = rows[np.argsort(rows[:, 0], kind="stable")]  # `snapshot_pool`'s block-id order
    return canary, BlockSnapshot(rows=rows, block_size=b)


def measure(blocks: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    canary, snapshot = filled_canary(blocks, args.block_size, args.requests, rng)
    runs_walker = SnapshotWalker()
    arms = {"runs": runs_walker, "array": ArrayOnly(runs_walker)}
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    entries = canary.slot_run_counter.copy()
    for i in range(args.repeats + 1):
        for arm in list(arms) if i % 2 == 0 else list(arms)[::-1]:
            canary.attach_prefix_cache(walker=arms[arm])
            runs_walker.snapshot = snapshot
            t = time.perf_counter()
            canary.end_step()
            if i:  # the first round warms up
                times[arm].append(time.perf_counter() - t)
    if canary.total_violations:
        raise SystemExit(f"sweep_walk: {canary.total_violations} violations on a clean pool")
    swept = sum(canary.slot_run_counter.values()) - sum(entries.values())
    per_sweep = swept // (2 * (args.repeats + 1))
    runs_us, array_us = (1e6 * statistics.median(times[a]) for a in ("runs", "array"))
    return {"blocks": blocks, "entries": per_sweep, "runs_us": runs_us, "array_us": array_us,
            "ratio": runs_us / array_us}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int_list, default="1024,16384",
                   help="pool sizes in blocks, comma-separated")  # fmt: skip
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    sizes = args.blocks
    if any(s < 2 * args.requests + 1 for s in sizes) or args.requests < 1 or args.block_size < 1:
        p.error(
            "--blocks must each be at least 2 * --requests + 1; --requests and --block-size >= 1"
        )
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    rows = []
    print(f"{'blocks':>8} {'entries':>9} {'runs us':>10} {'array us':>10} {'runs/array':>11}")
    for blocks in sizes:
        r = measure(blocks, args)
        rows.append(r)
        print(f"{r['blocks']:>8} {r['entries']:>9} {r['runs_us']:>10.1f} {r['array_us']:>10.1f} "
              f"{r['ratio']:>10.2f}x", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
