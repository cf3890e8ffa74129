"""How the canary's own time per decode step grows with batch size and context length.

The reference engine (`kvcanary.app.session.build_stack`: its KV pool, `req_to_token` table,
scheduler, runner and the canary as `kvcanary run` installs it, `log` + real-data `partial` +
sweep 16, fast kernels) serves `B` requests with `L`-token prompts, for each cell of a grid of
batch sizes (1-256) and context lengths (256-16k). The model is the weightless `oracle` model
(K/V written from a hash, no attention math), so a 16k-token prefill takes seconds; the canary
sees exactly the views, slots and pool layout it sees with the tiny transformer. To keep the
caches as cold as after a real forward (whose attention streams the whole KV through them),
`--flush-mb` of memory (e.g. 64 MiB, twice this machine's L3) can be read before every step;
the default (0) leaves the caches as the oracle model's forward leaves them.

Per cell, after the prefill and `--warmup` decode steps, `--steps` decode steps are timed; the
canary's own time is the hooks' timer (pre_forward + post_forward + end_step) and its entries
are the verify entries and record writes of the step (`canary.slot_run_counter` deltas). The
grid is measured `--passes` times, pass after pass (each pass visits every cell), and a cell's
figures pool its steps of every pass: a slow stretch of a shared host then weighs on one pass of
every cell instead of on all the steps of a few cells. Each pass's own fit is printed as it ends
(each cell's figure of the pass goes to stderr as it is measured). Bytes
touched per step, as in bench/engine_overhead.py: verify entries x 64 (record + chain
predecessor) + writes x 32 + 16 x real-KV sources x (TAIL and SWEEP entries). The table prints
the median per cell; then a least-squares fit `time = c0 + c1 * entries` over all cells (weighted
by 1/time, so each cell counts by its relative error) gives the fixed per-step constant c0
(goal <= 50 us) and the cost per entry c1.

Time is the canary's CPU time (`time.thread_time` around its three hooks; the kernels run on
this thread with the default `--threads 1`), so that other processes on a shared machine do not
add their time slices to it; the hooks' wall-clock time is printed beside it.

    python bench/scaling.py [--quick] [--batches 1,4,16,64,256] [--contexts 256,1024,4096,16384]
                            [--max-entries 524288] [--steps 21] [--passes 3] [--json PATH]

`--quick` runs a 2 x 2 grid with 3 steps, twice (a smoke test, seconds). Cells with more than
`--max-entries` context tokens (B x L) are skipped to bound memory and time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvcanary.app.session import RunSettings, build_stack
from kvcanary.canary import CanaryConfig
from kvcanary.engine.config import EngineConfig
from kvcanary.engine.model import ModelConfig
from kvcanary.engine.plan import ForwardKind

VOCAB = 256
RECORD_BYTES = 32
PARTIAL_BYTES = 16
C0_GOAL_US = 50.0


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers (`"1,4,16"`), each at least 1."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated integers >= 1, e.g. 1,4,16"
        )
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int_list, default="1,4,16,64,256",
                   help="comma-separated batch sizes")  # fmt: skip
    p.add_argument("--contexts", type=int_list, default="256,1024,4096,16384",
                   help="comma-separated prompt lens")  # fmt: skip
    p.add_argument("--max-entries", type=int, default=1 << 19, help="skip cells with B x L above")
    p.add_argument("--steps", type=int, default=21, help="timed decode steps per cell and pass")
    p.add_argument("--passes", type=int, default=3, help="measurements of the whole grid")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps per cell")
    p.add_argument("--flush-mb", type=int, default=0, help="MiB read before each step")
    p.add_argument("--kv-heads", type=int, default=1, help="pool K/V heads (x head_dim 64, fp32)")
    p.add_argument("--threads", type=int, default=1, help="numba threads (0 = numba's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="2 x 2 grid, 3 steps: a smoke test")
    p.add_argument("--json", type=Path, default=None, help="write the table and fit as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.steps, args.warmup = [1, 8], [256, 1024], 3, 1
        args.passes = 2
    if args.steps < 2:
        p.error(f"--steps {args.steps}: must be >= 2")
    if args.passes < 1:
        p.error(f"--passes {args.passes}: must be >= 1")
    return args


def cell_settings(args: argparse.Namespace, batch: int, context: int) -> RunSettings:
    """Engine, oracle model and canary for one cell; the pool holds every request's run."""
    new_tokens = args.warmup + args.steps + 4 + batch  # early requests decode during prefill
    max_len = context + new_tokens + 1
    chunk = max(4096, context)
    canary = CanaryConfig.from_args_and_env(
        kv_canary="log", kv_canary_real_data="partial", kv_canary_sweep_interval=16, environ={}
    )
    return RunSettings(
        canary=canary,
        engine=EngineConfig(
            num_slots=batch * max_len + 1,
            max_context_len=max_len,
            vocab_size=VOCAB,
            max_running_requests=batch,
            max_batch_size=batch,
            chunked_prefill_size=chunk,
            max_prefill_tokens=chunk,
            speculative_num_draft_tokens=0,
            seed=args.seed,
        ),
        model=ModelConfig(
            vocab_size=VOCAB,
            hidden=64,
            num_layers=1,
            num_heads=args.kv_heads,
            num_kv_heads=args.kv_heads,
            head_dim=64,
            intermediate=64,
            dtype="float32",
            seed=args.seed,
        ),
        model_kind="oracle",
    )


def timer_overhead() -> float:
    """Seconds one `thread_time()` pair adds to what it brackets (the best of many empty pairs;
    the clock is a system call here, about a microsecond)."""
    best = 1.0
    for _ in range(2000):
        start = time.thread_time()
        best = min(best, time.thread_time() - start)
    return best


class CpuTimer:
    """Adds up the thread CPU time spent inside the canary's per-step hooks, less the clock's
    own cost (`timer_overhead`) per call."""

    def __init__(self, canary: Any, overhead: float) -> None:
        self.seconds = 0.0
        self._overhead = overhead
        for name in ("pre_forward", "post_forward", "end_step"):
            setattr(canary, name, self._timed(getattr(canary, name)))

    def _timed(self, fn: Any) -> Any:
        def call(**kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return fn(**kwargs)
            finally:
                self.seconds += time.thread_time() - start - self._overhead

        return call


def measure_cell(
    args: argparse.Namespace, batch: int, context: int, flush: np.ndarray
) -> dict[str, Any]:
    """Prefill, warm up, then time `--steps` decode steps of one cell."""
    settings = cell_settings(args, batch, context)
    stack = build_stack(settings)
    canary, hooks, engine = stack.canary, stack.hooks, stack.engine
    assert canary is not None
    cpu = CpuTimer(canary, args.timer_overhead)
    sources = canary.group("full").sources["k"].count
    rng = random.Random(args.seed)
    max_new = settings.engine.max_context_len - context - 1
    for i in range(batch):
        prompt = [rng.randrange(VOCAB) for _ in range(context)]
        engine.add_request(f"r{i}", prompt, max_new, stack.sampling(f"r{i}"))
    prefill_start = time.perf_counter()
    while True:
        result = engine.step()
        if result.plan is not None and result.plan.kind is ForwardKind.DECODE:
            break
    prefill_seconds = time.perf_counter() - prefill_start
    for _ in range(args.warmup):
        engine.step()
    times, walls, entries, nbytes, contexts = [], [], [], [], []
    for _ in range(args.steps):
        if flush.size:
            int(flush.sum())  # evict the canary's data, as a forward's attention would
        before = dict(canary.slot_run_counter)
        seconds_before, cpu_before = hooks.seconds, cpu.seconds
        result = engine.step()
        plan = result.plan
        if plan is None or plan.kind is not ForwardKind.DECODE:
            raise RuntimeError("a timed step was not a decode of the whole batch")
        times.append(cpu.seconds - cpu_before)
        walls.append(hooks.seconds - seconds_before)
        writes = sum(1 for c in plan.chunks for s in c.out_slots if s >= 0)
        n_entries = n_bytes = 0
        for tag, value in canary.slot_run_counter.items():
            delta = value - before.get(tag, 0)
            if delta == 0:
                continue
            w = 0 if tag.is_sweep else writes
            v = delta - w
            n_entries += delta
            n_bytes += v * RECORD_BYTES * 2 + w * RECORD_BYTES
            if not tag.name.startswith("HEAD_"):
                n_bytes += delta * PARTIAL_BYTES * sources
        entries.append(n_entries)
        nbytes.append(n_bytes)
        contexts.append(statistics.fmean(c.prefix_len + 1 for c in plan.chunks))
    if canary.total_violations:
        raise RuntimeError(f"{canary.total_violations} violations on a clean run")
    return {
        "batch": batch,
        "context": context,
        "contexts": contexts,
        "entries": entries,
        "bytes": nbytes,
        "times": times,
        "walls": walls,
        "prefill_seconds": prefill_seconds,
    }


def pooled(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell's table row from its `measure_cell` results (one per pass): medians over the
    steps of every pass."""

    def every(key: str) -> list[float]:
        return [x for s in steps for x in s[key]]

    times = every("times")
    return {
        "batch": steps[0]["batch"],
        "context": steps[0]["context"],
        "context_mean": round(statistics.fmean(every("contexts")), 1),
        "entries": int(statistics.median(every("entries"))),
        "bytes": int(statistics.median(every("bytes"))),
        "canary_us_median": round(1e6 * statistics.median(times), 2),
        "canary_us_min": round(1e6 * min(times), 2),
        "canary_wall_us_median": round(1e6 * statistics.median(every("walls")), 2),
        "prefill_seconds": round(statistics.median(s["prefill_seconds"] for s in steps), 2),
        "passes": len(steps),
    }


def fit(cells: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares `time = c0 + c1 * entries` over the cells' medians, weighted by 1/time
    (relative residuals: the cells span four decades, and unweighted the big cells' noise would
    swamp the constant), with the plain unweighted fit and its R^2 beside it."""
    x = np.array([c["entries"] for c in cells], dtype=np.float64)
    y = np.array([c["canary_us_median"] for c in cells], dtype=np.float64)
    a = np.stack([np.ones_like(x), x], axis=1)
    w = 1.0 / y
    (c0, c1), *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    (o0, o1), *_ = np.linalg.lstsq(a, y, rcond=None)
    pred = a @ np.array([o0, o1])
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    rel = np.abs(a @ np.array([c0, c1]) - y) / y
    small = [c["canary_us_median"] for c in cells if c["entries"] == x.min()]
    return {
        "c0_us": round(float(c0), 2),
        "c1_ns_per_entry": round(1000 * float(c1), 3),
        "max_relative_residual": round(float(rel.max()), 3),
        "ols_c0_us": round(float(o0), 2),
        "ols_c1_ns_per_entry": round(1000 * float(o1), 3),
        "ols_r2": round(r2, 4),
        "smallest_cell_us": round(min(small), 2),
    }


def main(argv: list[str] | None = None) -> int:
    """Measure the grid, print the table and the fit; always 0 (the goal is reported)."""
    args = parse_args(argv)
    import numba

    if args.threads > 0:
        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    flush = np.ones(args.flush_mb << 17, dtype=np.int64)  # MiB -> 8-byte words
    args.timer_overhead = timer_overhead()
    load_before = os.getloadavg()[0]
    measure_cell(args, 1, 64, flush)  # compile / load the kernels outside the table
    grid = [(b, c) for b in args.batches for c in args.contexts if b * c <= args.max_entries]
    measured: dict[tuple[int, int], list[dict[str, Any]]] = {cell: [] for cell in grid}
    pass_fits = []
    for k in range(args.passes):
        for batch, context in grid:
            got = measure_cell(args, batch, context, flush)
            measured[batch, context].append(got)
            print(f"  pass {k + 1}/{args.passes}: batch {batch}, context {context}: "
                  f"{1e6 * statistics.median(got['times']):.1f} us", file=sys.stderr,
                  flush=True)  # fmt: skip
        if len(grid) >= 2:  # this pass alone: how far one pass's fit strays
            one = fit([pooled([m[k]]) for m in measured.values()])
            pass_fits.append(one)
            print(f"pass {k + 1}/{args.passes}: {len(grid)} cells, c0 = {one['c0_us']:.1f} us, "
                  f"c1 = {one['c1_ns_per_entry']:.2f} ns per entry", flush=True)  # fmt: skip
    cells = [pooled(measured[cell]) for cell in grid]
    print(
        f"canary scaling (reference engine, oracle model, log + real-data partial + sweep 16, "
        f"{numba.get_num_threads()} numba threads, flush {args.flush_mb} MiB per step; "
        f"canary CPU time, median of {args.steps} decode steps x {args.passes} passes, less "
        f"{1e6 * args.timer_overhead:.2f} us clock cost per hook call)"
    )
    print(
        f"{'batch':>6}{'context':>9}{'entries/step':>14}{'bytes/step':>14}"
        f"{'canary us':>12}{'min us':>10}{'wall us':>10}{'ns/entry':>10}"
    )
    for c in cells:
        print(
            f"{c['batch']:>6}{c['context']:>9}{c['entries']:>14,}{c['bytes']:>14,}"
            f"{c['canary_us_median']:>12.1f}{c['canary_us_min']:>10.1f}"
            f"{c['canary_wall_us_median']:>10.1f}"
            f"{1000 * c['canary_us_median'] / c['entries']:>10.2f}"
        )
    result = fit(cells) if len(cells) >= 2 else {}
    if result:
        verdict = "PASS" if result["c0_us"] <= C0_GOAL_US else "MISS"
        print(
            f"fit time = c0 + c1 * entries (weighted 1/time): c0 = {result['c0_us']:.1f} us per "
            f"step (goal <= {C0_GOAL_US:.0f} us) {verdict}, c1 = {result['c1_ns_per_entry']:.2f} "
            f"ns per entry, largest relative residual {100 * result['max_relative_residual']:.0f} %"
            f" (all {args.passes} passes pooled)"
        )
        print(
            f"  unweighted: c0 = {result['ols_c0_us']:.1f} us, c1 = "
            f"{result['ols_c1_ns_per_entry']:.2f} ns per entry, R^2 = {result['ols_r2']:.4f}; "
            f"smallest cell {result['smallest_cell_us']:.1f} us"
        )
    load_after = os.getloadavg()[0]
    print(f"loadavg 1m before/after: {load_before:.2f} / {load_after:.2f} on {os.cpu_count()} cpus")
    if args.json is not None:
        figures = {"cells": cells, "fit": result, "pass_fits": pass_fits}
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
