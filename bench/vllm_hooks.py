"""Where the canary's time goes inside vLLM: each adapter hook and canary call timed per step.

One in-process vLLM engine (the test suite's tiny Llama, block size 32, prefix caching on, the
canary in `log` + real-data `partial` + a sweep every 4 steps + token checks) runs a seeded
workload after a warm-up run; every hook below is wrapped with a timer for the run. The
wrappers add about a microsecond per call, so the figures are a little high; nested calls are
each counted in their own line (`start_load_kv` holds `before_forward`, which holds `_view`
and `Canary.pre_forward`). The scheduler-side hooks (`build_connector_meta`, the pool snapshot)
are not in the canary's own time that `bench/vllm_overhead.py` reports. The `compiled ...`
lines time the numba calls the hooks make from Python (`FusedForward`'s HEAD and TAIL kernels,
the small sweep, `StepPrep`'s pass and the mirror's two-list gather); a hook's time beyond its
compiled calls is Python.

    python bench/vllm_hooks.py [--kind decode|prefill] [--dtype bfloat16|float32] [--runs 4]
                               [--hidden 256] [--layers 2] [--sweep-interval 4]

The vLLM benches run the canary in `log` with real-data `partial` whatever the environment says;
`--sweep-interval` (default: `KVCANARY_SWEEP_INTERVAL` if set, else 4) sets the sweep cadence.
A `KVCANARY_MODE` or `KVCANARY_REAL_DATA` other than the bench's is refused (exit 2), never
replaced unseen.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

#: the profiled engine's sequence and context limits (`bench/vllm_scaling.py` checks its grid)
MAX_SEQS, MAX_MODEL_LEN = 16, 512
#: the canary settings every vLLM bench runs with (the sweep cadence is `--sweep-interval`)
BENCH_CANARY = {"KVCANARY_MODE": "log", "KVCANARY_REAL_DATA": "partial"}
#: the vLLM benches' process defaults, each kept where the caller set it: vLLM's own log at
#: WARNING, the token check on, no periodic stats line, the engine core in this process (the
#: canary's timer is read here)
PROCESS_DEFAULTS = {"VLLM_LOGGING_LEVEL": "WARNING", "KVCANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
                    "KVCANARY_STATS_PRINT_EVERY_N_STEPS": "0",
                    "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # fmt: skip


def model_spec(hidden: int = 256, layers: int = 2) -> Any:
    """The vLLM benches' Llama (`TinyLlamaSpec`) of width `hidden` and `layers` layers: head_dim
    64, half as many KV heads as heads, an MLP 4x wide. The defaults are the test suite's tiny
    model; `--hidden 1024 --layers 8` the wider one."""
    from kvcanary.app.vllm.model import TinyLlamaSpec

    heads = hidden // 64
    return TinyLlamaSpec(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 2))  # fmt: skip


def sweep_interval_arg(text: str) -> int:
    """An argparse type: a sweep interval, an integer >= 0 (0: no sweeps)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 0 (0: no sweeps)")
    return value


def add_sweep_interval(ap: argparse.ArgumentParser) -> None:
    """`--sweep-interval N`: steps between prefix-cache sweeps (`bench_env` resolves a missing
    flag: `KVCANARY_SWEEP_INTERVAL` when set, else 4)."""
    ap.add_argument("--sweep-interval", type=sweep_interval_arg, default=None,
                    help="steps between prefix-cache sweeps (default: KVCANARY_SWEEP_INTERVAL "
                         "if set, else 4; 0: none)")  # fmt: skip


def sweeps_text(sweep_interval: int) -> str:
    """`sweep every N steps` / `no sweeps`, for the benches' headers."""
    return f"sweep every {sweep_interval} steps" if sweep_interval > 0 else "no sweeps"


def bench_env(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """The benches' canary settings (`log`, real-data `partial`, a sweep every
    `args.sweep_interval` steps) as the adapter's environment; sets `args.sweep_interval` when
    the flag was not given (from `KVCANARY_SWEEP_INTERVAL`, else 4). Exits 2 with one line when
    that variable is not a valid interval, or when the caller's environment sets
    `KVCANARY_MODE` or `KVCANARY_REAL_DATA` to something else: the bench would replace it
    unseen."""
    if args.sweep_interval is None:
        given = os.environ.get("KVCANARY_SWEEP_INTERVAL")
        try:
            args.sweep_interval = 4 if given is None else sweep_interval_arg(given)
        except argparse.ArgumentTypeError as exc:
            ap.error(f"KVCANARY_SWEEP_INTERVAL={given}: {exc}; unset it or pass --sweep-interval")
    for name, value in BENCH_CANARY.items():
        given = os.environ.get(name)
        if given is not None and given.strip().lower() != value:
            ap.error(f"{name}={given} in the environment: this bench runs the canary with "
                     f"{name}={value}; unset {name} to run it")  # fmt: skip
    return {**BENCH_CANARY, "KVCANARY_SWEEP_INTERVAL": str(args.sweep_interval)}


def set_process_defaults() -> None:
    """`PROCESS_DEFAULTS` into this process's environment where unset (vLLM reads them at
    import). The root logger is left unconfigured, as under vLLM's server: the plugin then sets
    up the canary's logging as it does there (an INFO handler on `kvcanary`; a line per sweep
    cost ~90 us a sweep unseen while these benches configured WARNING logging)."""
    for name, value in PROCESS_DEFAULTS.items():
        os.environ.setdefault(name, value)


def profiled_engine(dtype: str, env: dict[str, str], hidden: int = 256,
                    layers: int = 2) -> Any:  # fmt: skip
    """The in-process `VllmEngine` these benches profile (also `bench/vllm_scaling.py`'s): the
    `model_spec(hidden, layers)` Llama (the test suite's tiny one by default), block size 32, 480
    blocks, 16 sequences, 512-token budget and context, the canary in `log` + real-data
    `partial` + the sweep cadence of `env` (`bench_env`'s). Call it after
    `set_process_defaults` (vLLM reads them at import)."""
    from kvcanary.app.vllm.engine import VllmEngine, VllmSettings
    from kvcanary.app.vllm.model import ensure_tiny_llama

    spec = model_spec(hidden, layers)
    settings = VllmSettings(model=ensure_tiny_llama(spec), kv_blocks=480, max_num_seqs=MAX_SEQS,
                            max_num_batched_tokens=512, max_model_len=MAX_MODEL_LEN,
                            dtype=dtype)  # fmt: skip
    return VllmEngine(settings, env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="decode", choices=["decode", "prefill"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256, help="model width (head_dim stays 64)")
    ap.add_argument("--layers", type=int, default=2)
    add_sweep_interval(ap)
    args = ap.parse_args()
    if args.runs < 1 or args.layers < 1:
        ap.error(f"--runs {args.runs} / --layers {args.layers}: each must be at least 1")
    if args.hidden < 64 or args.hidden % 64:
        ap.error(f"--hidden {args.hidden}: must be a positive multiple of 64 (head_dim is 64)")
    canary_env = bench_env(ap, args)  # refuses a conflicting environment now
    set_process_defaults()

    from kvcanary.adapters.vllm import connector, prep, sweep, worker
    from kvcanary.adapters.vllm.mirror import KvMirror
    from kvcanary.app.vllm.workload import VllmRequest
    from kvcanary.canary.runtime import Canary

    spent: Counter[str] = Counter()
    calls: Counter[str] = Counter()

    def wrap(owner: Any, name: str, label: str) -> None:
        fn: Callable[..., Any] = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t
                calls[label] += 1

        setattr(owner, name, timed)

    hooks = [
        (connector.KVCanaryConnector, "start_load_kv"), (connector.KVCanaryConnector, "wait_for_save"),
        (connector.KVCanaryConnector, "build_connector_meta"),
        (connector.KVCanaryConnector, "get_kv_connector_stats"),
        (connector.KVCanaryConnector, "build_connector_worker_meta"),
        (worker.CanaryWorker, "before_forward"), (worker.CanaryWorker, "after_forward"),
        (worker.CanaryWorker, "_view"), (worker.CanaryWorker, "_collect"),
        (prep.StepPrep, "forward"), (KvMirror, "refresh"),
        (Canary, "pre_forward"), (Canary, "post_forward"), (Canary, "end_step"),
        (Canary, "_sweep"),
    ]  # fmt: skip
    for owner, name in hooks:
        wrap(owner, name, f"{owner.__name__}.{name}")
    wrap(connector, "snapshot_pool", "snapshot_pool (scheduler)")
    # compiled calls made from Python only (a kernel another numba function calls cannot be
    # wrapped: numba would try to compile the wrapper into its caller); `FusedForward` binds
    # the kernels when the canary installs, after this
    from kvcanary.adapters.vllm import mirror
    from kvcanary.canary.kernels import fast

    for name in ("forward_head", "forward_tail", "sweep_serial"):
        wrap(fast, name, f"compiled {name}")
    wrap(prep, "_forward", "compiled StepPrep pass")
    wrap(mirror, "_gather_two", "compiled mirror gather, two lists")
    wrap(sweep.ParentLedger, "note_cached", "ParentLedger.note_cached (scheduler)")

    engine = profiled_engine(args.dtype, canary_env, args.hidden, args.layers)

    def workload(seed: int) -> list[VllmRequest]:
        rng = random.Random(f"{args.kind}:{seed}")
        n, plen, out = (8, 32, 96) if args.kind == "decode" else (48, 256, 1)
        return [VllmRequest(tuple(rng.randrange(1, 512) for _ in range(plen)), out)
                for _ in range(n)]  # fmt: skip

    engine.reset_prefix_cache()
    engine.run(workload(999), seed=999)  # warm-up: numba kernels, vLLM's first-call paths
    spent.clear()
    calls.clear()
    steps, wall, canary = 0, 0.0, 0.0
    for seed in range(args.runs):
        engine.reset_prefix_cache()
        run = engine.run(workload(seed), seed=seed)
        steps += run.figures["forward_steps"]
        wall += run.figures["wall_seconds"]
        canary += run.figures["canary_seconds"]
    steps = max(1, steps)
    print(f"{args.kind}, {args.dtype}, {sweeps_text(args.sweep_interval)}: {steps} steps, "
          f"wall {1e6 * wall / steps:.0f} us/step, "
          f"canary's own time {1e6 * canary / steps:.1f} us/step "
          f"({100 * canary / max(wall, 1e-12):.1f} %)")  # fmt: skip
    print(f"{'hook':42s} {'us/step':>9s} {'calls/step':>11s} {'us/call':>9s}")
    for label, secs in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"{label:42s} {1e6 * secs / steps:9.1f} {calls[label] / steps:11.2f} "
              f"{1e6 * secs / calls[label]:9.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
