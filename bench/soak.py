"""Soak the reference engine with the canary in log mode: many requests, zero violations expected.

Serves `--requests` (default 10,000) requests of the embedded `WorkloadSpec` workload (shared
system prompts -> radix hits, prompts crossing chunk boundaries, ~10% aborted in prefill or
decode, a pool small enough to force radix evictions and retractions, speculative decoding with
k = 2 draft tokens) through `run_session`, with the canary in `log` mode, real-data `partial` and
a prefix-cache sweep every 16 steps. The oracle model (default) stores deterministic K/V and
samples from the token oracle, so the run is dominated by the engine and the canary, not by
transformer math; `--model tiny` runs the real tiny transformer instead.

Arrivals are spaced (`--arrivals-per-step` requests every `--arrival-interval` steps, default
2 every 5 steps, close to the engine's throughput at these sizes) so the waiting queue stays short
and aborts land in prefill and decode, not in the queue. The engine sizes default to
`kvcanary run`'s.

Before the timed run a short warm-up session (its own stack) JIT-compiles the numba kernels, so
`wall_seconds` and `canary_seconds` are steady-state figures; the warm-up time is reported apart.

Prints the run summary (the `kvcanary run --json` schema) and a few derived rates. `--json PATH`
writes the summary keys at the top level plus a `bench` object with the derived figures.
Exit status 1 when the canary reported any violation (or raise mode stopped the run), else 0.

    python bench/soak.py [--requests 10000] [--model oracle|tiny] [--seed 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvcanary.app.session import RunSettings, Stack, build_stack, run_session
from kvcanary.app.workload import WorkloadSpec
from kvcanary.canary import CanaryConfig
from kvcanary.engine.config import EngineConfig
from kvcanary.engine.model import ModelConfig

VOCAB = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000, help="requests served (default 10000)")
    p.add_argument("--model", choices=("tiny", "oracle"), default="oracle")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the model")
    p.add_argument("--kv-canary", default="log", help="none | log | raise")
    p.add_argument("--real-data", default="partial", help="none | partial | all")
    p.add_argument("--sweep-interval", type=int, default=16, help="sweep every N steps; 0 = off")
    p.add_argument("--arrivals-per-step", type=int, default=2, help="requests per arrival group")
    p.add_argument("--arrival-interval", type=int, default=5, help="steps between arrival groups")
    p.add_argument("--abort-fraction", type=float, default=0.1)
    p.add_argument("--num-slots", type=int, default=448, help="KV pool slots (slot 0 reserved)")
    p.add_argument("--max-running-requests", type=int, default=8)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--chunked-prefill-size", type=int, default=32, help="-1 = unlimited")
    p.add_argument("--max-prefill-tokens", type=int, default=96, help="token budget per step")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=2, help="k; 0 = off")
    p.add_argument("--max-context-len", type=int, default=256)
    p.add_argument("--warmup-requests", type=int, default=24, help="0 = no JIT warm-up session")
    p.add_argument(
        "--progress-every", type=int, default=500, help="requests between progress lines (no TTY)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--json", type=Path, default=None, help="write the figures as JSON")
    args = p.parse_args(argv)
    if args.requests < 1:
        p.error("--requests must be >= 1")
    return args


def make_settings(args: argparse.Namespace, num_requests: int) -> RunSettings:
    """`kvcanary run`'s settings for these options and `num_requests` requests."""
    chunk = None if args.chunked_prefill_size == -1 else args.chunked_prefill_size
    return RunSettings(
        canary=CanaryConfig.from_args_and_env(
            kv_canary=args.kv_canary,
            kv_canary_real_data=args.real_data,
            kv_canary_sweep_interval=args.sweep_interval,
            environ=os.environ,
        ),
        engine=EngineConfig(
            num_slots=args.num_slots,
            max_context_len=args.max_context_len,
            vocab_size=VOCAB,
            max_running_requests=args.max_running_requests,
            max_batch_size=args.max_batch_size,
            chunked_prefill_size=chunk,
            max_prefill_tokens=args.max_prefill_tokens,
            speculative_num_draft_tokens=args.speculative_num_draft_tokens,
            seed=args.seed,
        ),
        model=ModelConfig(vocab_size=VOCAB, seed=args.seed),
        model_kind=args.model,
        workload=WorkloadSpec(
            num_requests=num_requests,
            seed=args.seed,
            vocab_size=VOCAB,
            abort_fraction=args.abort_fraction,
            arrivals_per_step=args.arrivals_per_step,
            arrival_interval_steps=args.arrival_interval,
        ),
    )


class LineProgress:
    """Periodic progress lines on stderr (for logs and pipes, where a live bar cannot redraw)."""

    def __init__(self, stack: Stack, every: int) -> None:
        self.stack, self.every = stack, max(1, every)
        self.next_at = self.every
        self.start = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        if done < self.next_at and done < total:
            return
        self.next_at = (done // self.every + 1) * self.every
        canary = self.stack.canary
        elapsed = time.perf_counter() - self.start
        print(
            f"[soak] {done}/{total} requests  {elapsed:7.1f}s  "
            f"canary {self.stack.hooks.seconds:6.1f}s  "
            f"checks {sum(canary.slot_run_counter.values()) if canary else 0}  "
            f"sweeps {canary.sweep_passes if canary else 0}  "
            f"violations {canary.total_violations if canary else 0}",
            file=sys.stderr,
            flush=True,
        )


def serve(args: argparse.Namespace, settings: RunSettings) -> tuple[dict[str, Any], bool]:
    """Run the session with progress output; returns (figures, stopped_by_raise)."""
    stack = build_stack(settings)
    total = settings.workload.num_requests
    if args.quiet:
        summary = run_session(settings, stack=stack)
    elif sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        with Progress(
            TextColumn("[bold]soak"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), console=Console(stderr=True),
        ) as bar:  # fmt: skip
            task = bar.add_task("requests", total=total)
            summary = run_session(
                settings,
                lambda done, tot: bar.update(task, completed=done, total=tot),
                stack=stack,
            )
    else:
        summary = run_session(settings, LineProgress(stack, args.progress_every), stack=stack)
    return dict(summary.figures), summary.stopped_by_raise


def main(argv: list[str] | None = None) -> int:
    """Warm up, soak, print and (maybe) write the figures; 1 on any violation."""
    args = parse_args(argv)
    settings = make_settings(args, args.requests)
    load_before = os.getloadavg()
    warmup_seconds = 0.0
    if args.warmup_requests > 0:
        start = time.perf_counter()
        warm = run_session(replace(settings, workload=replace(
            settings.workload, num_requests=args.warmup_requests, seed=args.seed + 1
        )))  # fmt: skip
        warmup_seconds = time.perf_counter() - start
        if warm.figures["violations"]:
            print(f"warm-up saw {warm.figures['violations']} violations", file=sys.stderr)
    figures, stopped = serve(args, settings)
    wall = figures["wall_seconds"]
    bench = {
        "model": args.model,
        "requests": args.requests,
        "arrivals": f"{args.arrivals_per_step} every {args.arrival_interval} steps",
        "jit_warmup_seconds": round(warmup_seconds, 3),
        "requests_per_second": round(args.requests / wall, 2) if wall else None,
        "engine_steps_per_second": round(figures["engine_steps"] / wall, 1) if wall else None,
        "canary_share_of_wall": round(figures["canary_seconds"] / wall, 3) if wall else None,
        "canary_ms_per_forward": round(
            1000 * figures["canary_seconds"] / max(1, figures["forward_steps"]), 3
        ),
        "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
    }
    width = max(map(len, [*figures, *bench]))
    print("soak summary (kvcanary run --json schema)")
    for key, value in figures.items():
        print(f"  {key:<{width}}  {value}")
    print("bench")
    for key, value in bench.items():
        print(f"  {key:<{width}}  {value}")
    if args.json is not None:
        args.json.write_text(json.dumps({**figures, "bench": bench}, indent=2) + "\n")
    failed = bool(figures["violations"]) or stopped
    if failed:
        print(
            f"soak: {figures['violations']} violations"
            + (" (stopped by raise mode)" if stopped else "")
            + f"; replay with --seed {args.seed}",
            file=sys.stderr,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
