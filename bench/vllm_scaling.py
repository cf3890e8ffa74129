"""How the canary's own time per decode step grows inside vLLM, and its fixed per-step constant.

One in-process vLLM engine (`bench/vllm_hooks.py`'s: the test suite's tiny Llama, block size
32, prefix caching on, the canary in `log` + real-data `partial` + a sweep every 4 steps
(`--sweep-interval`) + token checks; vLLM's default dtype unless `--dtype`) serves `B` requests
of `P`-token prompts for each cell of a grid. A cell's decode figures are the difference of two
runs over the same prompts (prefix cache reset before each): one generating `1 + --decode`
tokens a request, one generating 1 (the prefill alone). Where the prefill is chunked (B x P
above the 512-token step budget) the longer run's early rows decode beside later rows' chunks,
so a few of its decode steps carry prefill tokens too.
Its time is the canary's own time (the worker's timer around its hooks: view, HEAD, mirror,
TAIL, sweeps; `canary_seconds`), its entries the protected-slot checks (verify entries and
record writes of every stage, sweeps included), both per decode step. The grid is run
`--repeats` times, pass after pass (each pass visits every cell, so a slow stretch of a shared
host weighs on one pass of every cell rather than on all the repeats of a few cells), and each
cell's median over the passes is printed; so is each pass's own fit, as the pass ends. A
weighted least-squares fit `time = c0 + c1 * entries` over the cells (weights 1/time, as
`bench/scaling.py` fits the reference engine) gives the fixed per-step constant c0 (goal <=
100 us) and the cost per entry c1.

The scheduler side (the pool snapshot for a sweep, per-step stats) is not in this time:
`bench/vllm_hooks.py` times it. The canary-off arm and on/off ratios are `bench/vllm_overhead.py`.

    python bench/vllm_scaling.py [--batches 1,4,16] [--prompts 32,128,384] [--decode 32]
                                 [--repeats 3] [--dtype auto|bfloat16|float32]
                                 [--sweep-interval 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from scaling import fit, int_list  # bench/scaling.py: the same weighted fit for both engines
from vllm_hooks import (  # bench/vllm_hooks.py: the profile's engine and its canary settings
    MAX_MODEL_LEN,
    MAX_SEQS,
    add_sweep_interval,
    bench_env,
    profiled_engine,
    set_process_defaults,
    sweeps_text,
)

GOAL_C0_US = 100.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int_list, default="1,4,16",
                    help=f"requests per cell (at most {MAX_SEQS})")  # fmt: skip
    ap.add_argument("--prompts", type=int_list, default="32,128,384",
                    help="prompt tokens per request")  # fmt: skip
    ap.add_argument("--decode", type=int, default=32, help="decode steps timed per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    add_sweep_interval(ap)
    args = ap.parse_args()
    batches, prompts = args.batches, args.prompts
    if max(batches) > MAX_SEQS:
        ap.error(f"--batches {max(batches)}: at most {MAX_SEQS} (the engine's max_num_seqs)")
    if max(prompts) + args.decode + 1 > MAX_MODEL_LEN:
        ap.error(f"--prompts {max(prompts)} with --decode {args.decode}: prompt + decode + 1 "
                 f"must be at most {MAX_MODEL_LEN} tokens (max_model_len)")  # fmt: skip
    if args.decode < 1 or args.repeats < 1:
        ap.error(f"--decode {args.decode} / --repeats {args.repeats}: each must be at least 1")
    canary_env = bench_env(ap, args)  # refuses a conflicting environment now
    set_process_defaults()

    from kvcanary.app.vllm.workload import VllmRequest

    engine = profiled_engine(args.dtype, canary_env)

    def run(batch: int, prompt: int, tokens: int, seed: int) -> dict[str, Any]:
        rng = random.Random(f"{batch}:{prompt}:{seed}")
        reqs = [VllmRequest(tuple(rng.randrange(1, 512) for _ in range(prompt)), tokens)
                for _ in range(batch)]  # fmt: skip
        engine.reset_prefix_cache()
        figures: dict[str, Any] = engine.run(reqs, seed=seed).figures
        if figures["violations"]:
            raise SystemExit(f"violations on clean work: {figures['violations_by_reason']}; "
                             f"replay: python bench/vllm_scaling.py --batches {batch} "
                             f"--prompts {prompt} --decode {args.decode}")  # fmt: skip
        return figures

    run(4, 64, 8, seed=999)  # warm-up: numba kernels, vLLM's first-call paths
    grid = [(batch, prompt) for batch in batches for prompt in prompts]
    # per cell, one (canary us, entries, steps) per pass that decoded
    passes: dict[tuple[int, int], list[tuple[float, float, int]]] = {cell: [] for cell in grid}
    pass_fits: list[dict[str, float]] = []
    for seed in range(args.repeats):
        this_pass = []
        for batch, prompt in grid:
            full = run(batch, prompt, 1 + args.decode, seed)
            pre = run(batch, prompt, 1, seed)
            n = full["forward_steps"] - pre["forward_steps"]
            if n <= 0:
                continue
            us = 1e6 * (full["canary_seconds"] - pre["canary_seconds"]) / n
            entries = (full["protected_slot_checks"] - pre["protected_slot_checks"]) / n
            passes[batch, prompt].append((us, entries, n))
            this_pass.append({"entries": entries, "canary_us_median": us})
        if len(this_pass) >= 2:
            one = fit(this_pass)
            pass_fits.append(one)
            print(f"pass {seed + 1}/{args.repeats}: {len(this_pass)} cells, c0 = "
                  f"{one['c0_us']:.1f} us, c1 = {one['c1_ns_per_entry']:.2f} ns per entry",
                  flush=True)  # fmt: skip
    cells: list[dict[str, Any]] = []
    print(f"canary per decode step inside vLLM (tiny model, dtype {engine.dtype}, log + partial + "
          f"{sweeps_text(args.sweep_interval)}; median of {args.repeats} prefill-subtracted runs, "
          f"one a pass)")  # fmt: skip
    print(f"{'batch':>5} {'prompt':>6} {'steps':>6} {'entries/step':>13} {'canary us':>10} "
          f"{'ns/entry':>9}")  # fmt: skip
    for (batch, prompt), got in passes.items():
        if not got:
            continue
        cell = {"batch": batch, "prompt": prompt,
                "steps": int(statistics.median(g[2] for g in got)),
                "entries": round(statistics.median(g[1] for g in got), 1),
                "canary_us_median": round(statistics.median(g[0] for g in got), 2)}  # fmt: skip
        cells.append(cell)
        print(f"{batch:5d} {prompt:6d} {cell['steps']:6d} {cell['entries']:13.1f} "
              f"{cell['canary_us_median']:10.1f} "
              f"{1000 * cell['canary_us_median'] / max(cell['entries'], 1):9.1f}")  # fmt: skip
    if len(cells) < 2:
        print("fewer than two cells: no fit")
        return 1
    result = fit(cells)
    verdict = "PASS" if result["c0_us"] <= GOAL_C0_US else "MISS"
    print(
        f"fit time = c0 + c1 * entries (weighted 1/time): c0 = {result['c0_us']:.1f} us per "
        f"step (goal <= {GOAL_C0_US:.0f} us) {verdict}, c1 = {result['c1_ns_per_entry']:.2f} "
        f"ns per entry, largest relative residual {100 * result['max_relative_residual']:.0f} %"
        f" (the cells' medians over {args.repeats} passes)"
    )
    print(f"  unweighted: c0 = {result['ols_c0_us']:.1f} us, c1 = "
          f"{result['ols_c1_ns_per_entry']:.2f} ns per entry, R^2 = {result['ols_r2']:.4f}; "
          f"smallest cell {result['smallest_cell_us']:.1f} us")  # fmt: skip
    if args.json_path is not None:
        figures = {"cells": cells, "fit": result, "pass_fits": pass_fits,
                   "sweep_interval": args.sweep_interval}  # fmt: skip
        args.json_path.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
