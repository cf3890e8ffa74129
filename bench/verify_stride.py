"""The verify stride's trade-off: the canary's own time per decode step against how many steps a
corrupted record goes unreported, for each `KVCANARY_VERIFY_STRIDE` (docs/spec.md §5.5).

One process drives one canary per stride (`log`, real-data `partial`, no sweep) over the same
synthetic decode batch: `--requests` requests with `--context`-token prompts in a shared pool,
one K source of 32 bytes a token, then `--steps` decode steps of one token per request. Every
step builds one view, writes the same KV bytes, and runs each canary's `pre_forward`,
`post_forward` and `end_step` in turn (the order rotates every step, so drift and cache effects
hit each stride alike); the time of those three calls is the canary's own time. Printed per
stride: the median µs a decode step, its ratio to stride 1, the HEAD verify entries a step, and
the detection latency over `--trials` corruptions: before a random step, one bit of the TAIL
record of a random attended slot is flipped; the latency is the number of steps after that
step until the canary reports it (0 = by the same step's TAIL, as with stride 1), then the bit
is restored. The bound is `stride - 1`.

    python bench/verify_stride.py [--strides 1,2,4,8] [--requests 32] [--context 1024]
                                  [--steps 64] [--trials 64] [--seed 0] [--json PATH]
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

from kvcanary.canary import Canary, CanaryLaunchCapacities, install
from kvcanary.canary.config import CanaryConfig, CanaryMode, RealDataMode
from kvcanary.contract import BufferGroupSpec, ForwardView, GroupKind, LaunchTag, RealKvSource

TOKEN_BYTES = 32


class Pool:
    """Bump-allocated slots, a `req_to_token` table and one K byte tensor shared by every canary
    (each canary keeps its own records; the views and KV bytes are the same for all)."""

    def __init__(self, requests: int, width: int, rng: np.random.Generator) -> None:
        self.num_slots = requests * width + 1
        self.r2t = np.zeros((requests + 1, width), dtype=np.int64)
        self.k = torch.zeros(self.num_slots, TOKEN_BYTES, dtype=torch.uint8)
        self.lengths = np.zeros(requests + 1, dtype=np.int64)
        self.next_slot = 1
        self.rng = rng

    def view(self, tokens: dict[int, int]) -> ForwardView:
        """A forward extending each row `r` by `tokens[r]` tokens at fresh slots, KV written."""
        rows, prefix, extend, out, pos = [], [], [], [], []
        for row, n in tokens.items():
            start = int(self.lengths[row])
            slots = np.arange(self.next_slot, self.next_slot + n, dtype=np.int64)
            self.next_slot += n
            self.r2t[row, start : start + n] = slots
            self.lengths[row] = start + n
            rows.append(row)
            prefix.append(start)
            extend.append(n)
            out.append(slots)
            pos.append(np.arange(start, start + n, dtype=np.int64))
        out_slots = np.concatenate(out)
        ids = self.rng.integers(0, 1000, size=len(out_slots)).astype(np.int64)
        self.k[torch.from_numpy(out_slots)] = torch.from_numpy(
            self.rng.integers(0, 256, size=(len(out_slots), TOKEN_BYTES), dtype=np.uint8)
        )
        return ForwardView(
            rows=np.array(rows, dtype=np.int64), prefix_lens=np.array(prefix, dtype=np.int64),
            extend_lens=np.array(extend, dtype=np.int64), input_ids=ids,
            positions=np.concatenate(pos), out_slots=out_slots, req_to_token=self.r2t,
        )  # fmt: skip


def make_canary(pool: Pool, stride: int, requests: int, width: int) -> Canary:
    cfg = CanaryConfig(mode=CanaryMode.LOG, real_data=RealDataMode.PARTIAL,
                       stats_print_every_n_steps=0, verify_stride=stride)  # fmt: skip
    group = BufferGroupSpec(kind=GroupKind.FULL, num_slots=pool.num_slots, has_v=False,
                            k_sources=(RealKvSource(pool.k, 1, TOKEN_BYTES, 16),))  # fmt: skip
    caps = CanaryLaunchCapacities(write_req_capacity=requests, write_entry_capacity=requests * width,
                                  verify_capacity=requests * width, max_seq_len_per_req=width)  # fmt: skip
    canary = install(cfg, [group], caps)
    assert canary is not None
    canary.mark_init_finished()
    return canary


def step_all(canaries: list[Canary], view: ForwardView, order: list[int]) -> list[float]:
    """Each canary's pre/post/end on `view`, in `order`; their seconds by canary index."""
    spent = [0.0] * len(canaries)
    for i in order:
        c = canaries[i]
        t0 = time.perf_counter()
        c.pre_forward(view=view)
        c.post_forward(view=view)
        c.end_step()
        spent[i] = time.perf_counter() - t0
    return spent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strides", default="1,2,4,8", help="comma-separated strides (1 first)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps")
    p.add_argument("--trials", type=int, default=64, help="corruptions per stride")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures as JSON to PATH")
    args = p.parse_args(argv)
    # the corruptions are reported on every step until restored: the bench counts them instead
    logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
    try:
        strides = [int(s) for s in args.strides.split(",")]
    except ValueError:
        p.error(f"--strides must be comma-separated integers, got {args.strides!r}")
    if strides[0] != 1 or min(strides) < 1 or args.requests < 1 or args.context < 1:
        p.error("--strides must start with 1 (the reference); --requests and --context >= 1")
    rng = np.random.default_rng(args.seed)
    max_latency = max(strides)
    width = args.context + args.steps + 2 + args.trials * (max_latency + 1)
    pool = Pool(args.requests, width, rng)
    try:
        canaries = [make_canary(pool, s, args.requests, width) for s in strides]
    except ValueError as err:
        p.error(str(err))
    rows = list(range(1, args.requests + 1))
    print(f"verify stride bench: {args.requests} requests x {args.context}-token prompts, "
          f"{args.steps} decode steps, {args.trials} corruptions a stride, seed {args.seed}")  # fmt: skip
    step_all(canaries, pool.view(dict.fromkeys(rows, args.context)), list(range(len(strides))))
    times: list[list[float]] = [[] for _ in strides]
    entries: list[list[int]] = [[] for _ in strides]
    for step in range(args.steps):
        before = [c.slot_run_counter[LaunchTag.HEAD_K_FULL] for c in canaries]
        k = step % len(strides)
        order = list(range(k, len(strides))) + list(range(k))
        spent = step_all(canaries, pool.view(dict.fromkeys(rows, 1)), order)
        for i, c in enumerate(canaries):
            times[i].append(spent[i])
            entries[i].append(c.slot_run_counter[LaunchTag.HEAD_K_FULL] - before[i] - len(rows))
    latencies: list[list[int]] = [[] for _ in strides]
    for _ in range(args.trials):
        row = int(rng.choice(rows))
        slot = int(pool.r2t[row, rng.integers(0, pool.lengths[row])])
        flipped = [c.group("full").buffer("tail", "k")[slot] for c in canaries]
        for rec in flipped:
            rec[8] ^= 1  # POSITION's low bit
        found = [c.total_violations for c in canaries]
        waiting = set(range(len(canaries)))
        lag = 0
        while waiting and lag < max_latency + 1:
            step_all(canaries, pool.view(dict.fromkeys(rows, 1)), list(range(len(strides))))
            for i in list(waiting):
                if canaries[i].total_violations > found[i]:
                    latencies[i].append(lag)
                    waiting.discard(i)
            lag += 1
        for i in waiting:
            latencies[i].append(-1)  # not found within the bound: printed, and the exit is 1
        for rec in flipped:
            rec[8] ^= 1
    base = statistics.median(times[0])
    results: dict[str, Any] = {"requests": args.requests, "context": args.context,
                               "steps": args.steps, "trials": args.trials, "strides": {}}  # fmt: skip
    print(f"{'stride':>6} {'us/step':>9} {'vs 1':>6} {'verify/step':>12} {'latency mean':>13} "
          f"{'max':>4} {'bound':>6}")  # fmt: skip
    ok = True
    for i, s in enumerate(strides):
        med = statistics.median(times[i])
        lat = latencies[i]
        missed = sum(1 for x in lat if x < 0)
        ok &= missed == 0 and max(lat) <= s - 1
        mean = statistics.fmean(x for x in lat if x >= 0) if missed < len(lat) else float("nan")
        results["strides"][str(s)] = {
            "us_per_step": 1e6 * med, "vs_stride_1": med / base,
            "verify_entries_per_step": statistics.fmean(entries[i]),
            "latency_mean_steps": mean, "latency_max_steps": max(lat), "missed": missed,
        }  # fmt: skip
        print(f"{s:>6} {1e6 * med:>9.1f} {med / base:>5.2f}x {statistics.fmean(entries[i]):>12.0f} "
              f"{mean:>13.2f} {max(lat):>4} {s - 1:>6}" + (f"  ({missed} missed)" if missed else ""))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
