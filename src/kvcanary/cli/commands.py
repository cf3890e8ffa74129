"""`kvcanary run`, `check-config` and `selftest` on the built-in reference engine.

Each command checks every input first (`cli/validate.py`, one line and exit 2 on the first bad
one), then does the work. Shared pieces (`print_summary`, `exit_on_violations`, the canary flag
types) are reused by `cli/vllm.py`; a new command or flag adds a parameter and a check.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import kvcanary
from kvcanary.app.observability import EventLog, RunMetrics, StepObserver
from kvcanary.app.selftest.campaign import CAMPAIGN_MODES, CampaignSpec, run_campaign
from kvcanary.app.selftest.outcome import outcome_json, run_outcome_campaign
from kvcanary.app.selftest.outcome_report import outcome_html, outcome_table
from kvcanary.app.selftest.report import campaign_json, campaign_passed, html_report, result_table
from kvcanary.app.selftest.selection import parse_names, transfer_selection
from kvcanary.app.session import RunSettings, RunSummary, run_session, warm_up_kernels
from kvcanary.app.workload import WorkloadSpec
from kvcanary.canary import CanaryConfig, CanaryLaunchCapacities
from kvcanary.canary import CanaryMode as CanaryModeValue
from kvcanary.canary.config import parse_mode
from kvcanary.canary.kernels import compile_cache
from kvcanary.cli.errors import (
    EXIT_BAD_INPUT,
    EXIT_CLEAN,
    EXIT_CODES_HELP,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    EXIT_STOPPED,
    EXIT_VIOLATIONS,
    BadInput,
    check_distinct_paths,
    check_int,
    check_output_path,
    explain,
    typed_flag,
)
from kvcanary.cli.validate import (
    MAX_SEED,
    canary_config,
    canary_knobs,
    check_choice,
    check_plant_fixture,
    check_reference_engine_env,
    check_run_sizes,
)
from kvcanary.engine.config import EngineConfig
from kvcanary.engine.model import ModelConfig
from kvcanary.engine.plants import PLANT_NAMES

__all__ = [
    "EXIT_BAD_INPUT", "EXIT_CLEAN", "EXIT_STOPPED", "EXIT_VIOLATIONS", "app", "exit_on_violations",
    "main", "print_summary", "replay_command",
]  # fmt: skip


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvcanary {kvcanary.__version__}")
        raise typer.Exit(EXIT_CLEAN)


app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,  # plain click help: wraps at any width, never cuts a flag name
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    help="KV-cache canary: make KV corruption impossible to miss.",
    epilog=EXIT_CODES_HELP,
)
err_console = Console(stderr=True)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="print the version"),
    ] = False,
) -> None:
    """KV-cache canary: make KV corruption impossible to miss."""


CanaryMode = Annotated[
    str, typer.Option("--kv-canary", help="none | log | raise | recover (off = none)")
]
RealData = Annotated[str, typer.Option("--kv-canary-real-data", help="none | partial | all")]
Sweep = Annotated[
    int,
    typer.Option("--kv-canary-sweep-interval", help="prefix-cache sweep every N steps; 0 = off"),
]


def _fail(message: str) -> typer.Exit:
    typer.echo(" ".join(message.split()), err=True)
    return typer.Exit(EXIT_BAD_INPUT)


def _canary_config(kv_canary: str, real_data: str, sweep: int) -> CanaryConfig:
    """The canary config from flags and `KVCANARY_*` (ValueError with the library's message)."""
    return CanaryConfig.from_args_and_env(
        kv_canary=kv_canary,
        kv_canary_real_data=real_data,
        kv_canary_sweep_interval=sweep,
        environ=os.environ,
    )


def _explicit(ctx: typer.Context, names: dict[str, str]) -> frozenset[str]:
    """The flags of `names` (parameter -> flag) the user passed on the command line."""
    out = set()
    for param, flag in names.items():
        source = ctx.get_parameter_source(param)
        if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
            out.add(flag)
    return frozenset(out)


def _argv(ctx: typer.Context) -> list[str]:
    obj = ctx.find_root().obj
    return list(obj.get("argv", [])) if isinstance(obj, dict) else sys.argv[1:]


def replay_command(argv: list[str]) -> str:
    """The command line that replays this run: its `KVCANARY_*` variables and its flags."""
    env = [
        f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("KVCANARY_")
    ]
    return " ".join([*env, "kvcanary", *(shlex.quote(a) for a in argv)])


@app.command(epilog=EXIT_CODES_HELP)
def run(
    ctx: typer.Context,
    kv_canary: CanaryMode = "log",
    kv_canary_real_data: RealData = "partial",
    kv_canary_sweep_interval: Sweep = 8,
    model: Annotated[
        str, typer.Option(help="tiny (a real tiny transformer) | oracle (token oracle)")
    ] = "tiny",
    requests: Annotated[int, typer.Option(help="requests in the workload (1-100000)")] = 48,
    seed: Annotated[int, typer.Option(help="seed of the workload and the model")] = 0,
    num_slots: Annotated[int, typer.Option(help="KV pool slots (slot 0 reserved)")] = 448,
    max_running_requests: Annotated[int, typer.Option(help="requests holding a row")] = 8,
    max_batch_size: Annotated[int, typer.Option(help="batch rows per forward")] = 8,
    chunked_prefill_size: Annotated[int, typer.Option(help="-1 = unlimited")] = 32,
    max_prefill_tokens: Annotated[int, typer.Option(help="token budget per step")] = 96,
    speculative_num_draft_tokens: Annotated[
        int, typer.Option(help="draft tokens per verify; 0 = off")
    ] = 2,
    max_context_len: Annotated[int, typer.Option(help="positions per request")] = 256,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16")] = "float32",
    json_path: Annotated[
        Path | None, typer.Option("--json", help="write the summary as JSON")
    ] = None,
    events: Annotated[
        Path | None,
        typer.Option(help="write start, config, injection, step, violation, end as JSON lines"),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(help="serve Prometheus counters on this port; 0 = a free port (printed)"),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="no progress bar")] = False,
    plant: Annotated[
        list[str] | None,
        typer.Option(
            "--plant",
            help="switch on a planted engine bug (repeatable; self-test): "
            + ", ".join(PLANT_NAMES),
        ),
    ] = None,
    host_tier_pages: Annotated[
        int, typer.Option(help="host tier under the pool, in token pages; 0 = off")
    ] = 0,
    disaggregate: Annotated[
        bool, typer.Option(help="prefill and decode engines in two processes (KV moves between)")
    ] = False,
) -> None:
    """Serve the embedded workload on the reference engine with the canary installed."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    argv = _argv(ctx)
    plants = list(plant or ())
    model = check_choice("--model", model, ("tiny", "oracle"))
    dtype = check_choice("--dtype", dtype, ("float32", "bfloat16"))
    check_run_sizes(
        requests=requests, seed=seed, num_slots=num_slots,
        max_running_requests=max_running_requests, max_batch_size=max_batch_size,
        chunked_prefill_size=chunked_prefill_size, max_prefill_tokens=max_prefill_tokens,
        speculative_num_draft_tokens=speculative_num_draft_tokens,
        max_context_len=max_context_len, plants=plants,
    )  # fmt: skip
    explicit = _explicit(ctx, {"kv_canary_real_data": "--kv-canary-real-data",
                               "kv_canary_sweep_interval": "--kv-canary-sweep-interval"})  # fmt: skip
    config = canary_config(kv_canary, kv_canary_real_data, kv_canary_sweep_interval, os.environ,
                           explicit=explicit)  # fmt: skip
    check_reference_engine_env(config, model)
    check_plant_fixture(plants, model, speculative_num_draft_tokens)
    if plants and not config.enabled:
        raise BadInput(f"--plant {plants[0]} with --kv-canary none: nothing would catch it; "
                       "pass --kv-canary log")  # fmt: skip
    if host_tier_pages < 0:
        raise BadInput(f"--host-tier-pages must be >= 0, got {host_tier_pages}; use 0 for no "
                       "host tier")  # fmt: skip
    check_int("--host-tier-pages", host_tier_pages, 0, 1 << 20, "pass 0 (no host tier) or more")
    check_output_path("--json", json_path)
    check_output_path("--events", events)
    check_distinct_paths({"--json": json_path, "--events": events})
    if metrics_port is not None:
        check_int("--metrics-port", metrics_port, 0, 65535,
                  "pass a free TCP port, or 0 to let the OS pick one")  # fmt: skip
    chunk = None if chunked_prefill_size == -1 else chunked_prefill_size
    try:
        settings = RunSettings(
            canary=config,
            engine=EngineConfig(
                num_slots=num_slots,
                max_context_len=max_context_len,
                vocab_size=256,
                max_running_requests=max_running_requests,
                max_batch_size=max_batch_size,
                chunked_prefill_size=chunk,
                max_prefill_tokens=max_prefill_tokens,
                speculative_num_draft_tokens=speculative_num_draft_tokens,
                seed=seed,
                plants=tuple(plants),
            ),
            model=ModelConfig(vocab_size=256, dtype=dtype, seed=seed),
            model_kind=model,
            workload=WorkloadSpec(num_requests=requests, seed=seed, vocab_size=256),
        )
    except ValueError as exc:  # a rule the checks above do not know yet: still one line
        raise BadInput(explain(str(exc), _ENGINE_FLAGS)) from None
    metrics = _start_metrics(metrics_port)  # last check: binding the port; no file exists yet
    observer = StepObserver(EventLog(events) if events else None, metrics)
    observer.event("start", version=kvcanary.__version__, command=replay_command(argv))
    observer.event("config", canary=config, engine=settings.engine, model=settings.model,
                   model_kind=model, requests=requests)  # fmt: skip
    compile_seconds = None
    if config.enabled and compile_cache.is_cold():  # before the bar: it would sit at 0
        err_console.print(f"kvcanary: compiling kernels, first run only, "
                          f"~{compile_cache.estimate_seconds()} s", markup=False, highlight=False)  # fmt: skip
        compile_seconds = round(warm_up_kernels(settings), 3)
        compile_cache.record_seconds(compile_seconds)
    try:
        with Progress(
            TextColumn("[bold]serving"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=err_console, disable=quiet, transient=False,
        ) as bar:  # fmt: skip
            task = bar.add_task("requests", total=requests)
            summary = _serve(  # a plain run, or one with KV leaving the pool (app.transfers_cli)
                settings, host_tier_pages, disaggregate,
                lambda done, total: bar.update(task, completed=done, total=total), observer,
            )  # fmt: skip
        if compile_seconds is not None:  # not in canary_seconds: it ran before the timed run
            summary.figures["kernel_compile_seconds"] = compile_seconds
        observer.event("end", **summary.figures)
    finally:
        observer.close()
    print_summary("kvcanary run", summary.figures, json_path)
    if summary.interrupted is not None:
        typer.echo(f"kv-canary: {summary.interrupted}: stopped early; the summary above is "
                   "partial", err=True)  # fmt: skip
        raise typer.Exit(EXIT_SIGTERM if summary.interrupted == "SIGTERM" else EXIT_SIGINT)
    if summary.stopped_by_raise:
        typer.echo(summary.stop_message or "kv-canary: violation", err=True)
        typer.echo(f"kv-canary: stopped by raise mode; replay: {replay_command(argv)}", err=True)
        raise typer.Exit(EXIT_STOPPED)
    if summary.figures["violations"]:
        typer.echo(f"kv-canary: {summary.figures['violations']} violations; replay: "
                   f"{replay_command(argv)}", err=True)  # fmt: skip
        raise typer.Exit(EXIT_VIOLATIONS)


_ENGINE_FLAGS = {
    f"EngineConfig.{name}": "--" + name.replace("_", "-")
    for name in ("num_slots", "max_context_len", "max_running_requests", "max_batch_size",
                 "chunked_prefill_size", "max_prefill_tokens", "speculative_num_draft_tokens")
} | {"EngineConfig.plants": "--plant", "ModelConfig.dtype": "--dtype"}  # fmt: skip


def _serve(
    settings: RunSettings,
    host_tier_pages: int,
    disaggregate: bool,
    progress: Callable[[int, int], None],
    observer: StepObserver,
) -> RunSummary:
    if disaggregate:
        from kvcanary.app.disagg import run_disaggregated

        return run_disaggregated(settings, progress, host_tier_pages=host_tier_pages)
    if host_tier_pages:
        from kvcanary.app.host_tier import run_host_tier_session

        return run_host_tier_session(settings, host_tier_pages, progress, observer=observer)
    return run_session(settings, progress, observer=observer)


def _start_metrics(port: int | None) -> RunMetrics | None:
    if port is None:
        return None
    try:
        metrics = RunMetrics(port)
    except OSError as exc:
        raise BadInput(f"--metrics-port {port}: cannot serve there ({exc.strerror or exc}); "
                       "pass a free port, or 0 to let the OS pick one") from None  # fmt: skip
    err_console.print(f"kvcanary: Prometheus metrics on http://127.0.0.1:{metrics.port}/metrics",
                      markup=False, highlight=False)  # fmt: skip
    return metrics


def print_summary(title: str, figures: dict[str, Any], json_path: Path | None) -> None:
    """The summary table on stdout, and the same figures as JSON when asked."""
    table = Table(title=title, show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in figures.items():
        table.add_row(key, str(value))
    Console().print(table)
    if json_path is not None:
        json_path.write_text(json.dumps(figures, indent=2) + "\n")


def exit_on_violations(figures: dict[str, Any], seed: int) -> None:
    """Exit 1 with the replay hint when the run reported violations (log mode)."""
    if figures["violations"]:
        typer.echo(
            f"kv-canary: {figures['violations']} violations; replay with --seed {seed}", err=True
        )
        raise typer.Exit(EXIT_VIOLATIONS)


_CAPACITY_FLAGS = {  # parameter -> its spellings: run's name first, the SPEC §6 name second
    "num_slots": ("--num-slots", "--pool-slot-count"),
    "max_context_len": ("--max-context-len", "--max-seq-len-per-req"),
    "max_running_requests": ("--max-running-requests", "--req-to-token-pool-size"),
    "max_batch_size": ("--max-batch-size", "--cuda-graph-max-bs"),
}


@app.command("check-config", epilog=EXIT_CODES_HELP)
def check_config(
    ctx: typer.Context,
    kv_canary: CanaryMode = "none",
    kv_canary_real_data: RealData = "none",
    kv_canary_sweep_interval: Sweep = 0,
    max_running_requests: Annotated[
        int, typer.Option(*_CAPACITY_FLAGS["max_running_requests"], help="req_to_token rows")
    ] = 64,
    max_context_len: Annotated[
        int, typer.Option(*_CAPACITY_FLAGS["max_context_len"], help="positions per request")
    ] = 4096,
    num_slots: Annotated[
        int, typer.Option(*_CAPACITY_FLAGS["num_slots"], help="KV pool slots")
    ] = 10000,
    max_batch_size: Annotated[
        int | None,
        typer.Option(*_CAPACITY_FLAGS["max_batch_size"], help="batch rows per forward"),
    ] = None,
    speculative_num_draft_tokens: Annotated[int | None, typer.Option(help="0 = off")] = None,
    max_prefill_tokens: Annotated[int, typer.Option(help="token budget per step")] = 16384,
    chunked_prefill_size: Annotated[int | None, typer.Option(help="-1 = unlimited")] = None,
) -> None:
    """Validate canary flags, `KVCANARY_*` variables and launch capacities; print what would be
    used. Sizes take `kvcanary run`'s names or the SPEC §6 (SGLang) ones."""
    argv = _argv(ctx)
    flag = {p: typed_flag(argv, names) for p, names in _CAPACITY_FLAGS.items()}
    limit = 2**31 - 1
    for param, value, low in (("max_running_requests", max_running_requests, 1),
                              ("max_context_len", max_context_len, 1), ("num_slots", num_slots, 1),
                              ("max_batch_size", max_batch_size, 0)):  # fmt: skip
        if value is not None:
            check_int(flag[param], value, low, limit)
    if speculative_num_draft_tokens is not None:
        check_int("--speculative-num-draft-tokens", speculative_num_draft_tokens, 0, 64,
                  "pass 0 (off) to 64")  # fmt: skip
    check_int("--max-prefill-tokens", max_prefill_tokens, 1, limit)
    if chunked_prefill_size is not None and chunked_prefill_size != -1:
        check_int("--chunked-prefill-size", chunked_prefill_size, 1, limit,
                  "pass -1 (unlimited) or a positive size")  # fmt: skip
    explicit = _explicit(ctx, {"kv_canary_real_data": "--kv-canary-real-data",
                               "kv_canary_sweep_interval": "--kv-canary-sweep-interval"})  # fmt: skip
    config = canary_config(kv_canary, kv_canary_real_data, kv_canary_sweep_interval, os.environ,
                           explicit=explicit)  # fmt: skip
    chunk = None if chunked_prefill_size in (None, -1) else chunked_prefill_size
    try:
        caps = CanaryLaunchCapacities.from_args(
            req_to_token_pool_size=max_running_requests, max_seq_len_per_req=max_context_len,
            pool_slot_count=num_slots, cuda_graph_max_bs=max_batch_size,
            speculative_num_draft_tokens=speculative_num_draft_tokens,
            max_prefill_tokens=max_prefill_tokens, chunked_prefill_size=chunk,
        )  # fmt: skip
    except (ValueError, TypeError) as exc:
        names = {"req_to_token_pool_size": flag["max_running_requests"],
                 "max_seq_len_per_req": flag["max_context_len"], "pool_slot_count": flag["num_slots"],
                 "cuda_graph_max_bs": flag["max_batch_size"]}  # fmt: skip
        raise BadInput(explain(str(exc), names)) from None
    Console().print(config)
    Console().print(caps)


@app.command(epilog=EXIT_CODES_HELP)
def selftest(
    ctx: typer.Context,
    modes: Annotated[str, typer.Option(help="all | none | comma-separated fault modes")] = "all",
    plants: Annotated[
        str, typer.Option(help="all | none | comma-separated planted engine bugs")
    ] = "all",
    seeds: Annotated[int, typer.Option(help="seeds per mode and plant (1-1000)")] = 20,
    first_seed: Annotated[int, typer.Option(help="first seed (replay a failing one)")] = 0,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="write the results as JSON")
    ] = None,
    html_path: Annotated[
        Path | None, typer.Option("--html", help="write an HTML report with plots")
    ] = None,
    transfers: Annotated[
        bool, typer.Option(help="run the transfer faults (host tier, prefill->decode) instead")
    ] = False,
    places: Annotated[
        str, typer.Option(help="with --transfers: host, disagg or both (comma-separated)")
    ] = "host,disagg",
    kv_canary: Annotated[
        str,
        typer.Option(
            "--kv-canary",
            help="log: prove each fault is caught 1:1 | recover: prove no corrupted output is "
            "delivered (vs a fault-free run, log mode side by side)",
        ),
    ] = "log",
    model: Annotated[
        str | None,
        typer.Option(
            help="tiny: serve every case with the tiny transformer (outputs depend on the KV, so "
            "log mode's damage shows); default: the token oracle (tiny for spec_rollback_stale)"
        ),
    ] = None,
) -> None:
    """Inject every fault mode and planted bug on many seeds; prove each is caught 1:1.

    Exit status 0 only when every mode and plant is caught on every seed and the clean baseline
    (same seeds, no faults) has zero violations. With `--kv-canary recover`: 0 only when no
    request is delivered with an output different from the fault-free run, for every fault on
    every seed, and the clean baseline has no incident. `KVCANARY_*` variables are validated and
    applied to every case as `run` applies them (the write-input assert and the token oracle on
    the cases the token oracle serves); the self-test injects its own faults, so
    `KVCANARY_PERTURB_*` is refused.
    """
    check_int("--seeds", seeds, 1, 1000, "pass 1 to 1000")
    check_int("--first-seed", first_seed, 0, MAX_SEED - seeds, "pass a smaller non-negative seed")
    if transfers:
        _selftest_transfers(ctx, modes, places, range(first_seed, first_seed + seeds), json_path,
                            model)  # fmt: skip
    logging.disable(logging.WARNING)  # violations are expected here; the table tells the story
    argv = _argv(ctx)
    try:
        spec = CampaignSpec(
            modes=parse_names(modes, CAMPAIGN_MODES), plants=parse_names(plants, PLANT_NAMES), seeds=seeds,
            first_seed=first_seed, model=model,
        )  # fmt: skip
        selftest_mode = parse_mode(kv_canary)
        if selftest_mode not in (CanaryModeValue.LOG, CanaryModeValue.RECOVER):
            raise ValueError(f"--kv-canary must be log or recover, got {kv_canary!r}; pass "
                             "--kv-canary log (or recover)")  # fmt: skip
    except ValueError as exc:
        raise BadInput(explain(str(exc), {"kv_canary": "--kv-canary"})) from None
    if not spec.modes and not spec.plants:
        raise BadInput("--modes none with --plants none leaves nothing to test; pass --modes all")
    spec = dataclasses.replace(spec, canary_knobs=_selftest_knobs(model))
    check_output_path("--json", json_path)
    check_output_path("--html", html_path)
    check_distinct_paths({"--json": json_path, "--html": html_path})
    if selftest_mode is CanaryModeValue.RECOVER:
        _selftest_recover(spec, json_path, html_path)
        return
    total = spec.seeds * (1 + len(spec.modes) + len(spec.plants))
    with Progress(
        TextColumn("[bold]selftest {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err_console,
    ) as bar:  # fmt: skip
        task = bar.add_task("", total=total)
        baseline, summaries = run_campaign(
            spec, lambda what: bar.update(task, advance=1, description=what)
        )
    Console(width=200).print(result_table(baseline, summaries))
    if json_path is not None:
        json_path.write_text(json.dumps(campaign_json(baseline, summaries), indent=2) + "\n")
    if html_path is not None:
        html_path.write_text(html_report(baseline, summaries, command=replay_command(argv)))
    for o in baseline:
        if o.violations:
            typer.echo(
                f"clean baseline seed {o.seed}: {o.violations} violations; replay: kvcanary run --seed {o.seed}",
                err=True,
            )
    for s in summaries:
        for o in s.outcomes:
            if not o.correlation.one_to_one:
                typer.echo(f"{s.name} seed {o.seed} not caught 1:1; replay: {o.replay}", err=True)
    if not campaign_passed(baseline, summaries):
        raise typer.Exit(EXIT_VIOLATIONS)


def _selftest_transfers(
    ctx: typer.Context, modes: str, places: str, seeds: range, json_path: Path | None,
    model: str | None,
) -> None:  # fmt: skip
    """`selftest --transfers`: checks its flags, runs it and exits with its status."""
    from kvcanary.app.selftest.transfers_cli import selftest_transfers

    try:
        mode = parse_mode(ctx.params["kv_canary"])
        if mode not in (CanaryModeValue.LOG, CanaryModeValue.RECOVER):
            raise ValueError(f"--kv-canary must be log or recover, got {ctx.params['kv_canary']!r}; "
                             "pass --kv-canary log (or recover)")  # fmt: skip
    except ValueError as exc:
        raise BadInput(explain(str(exc), {"kv_canary": "--kv-canary"})) from None
    recover = mode is CanaryModeValue.RECOVER
    if model not in (None, "tiny", "oracle"):
        raise BadInput(f"--model must be tiny or oracle, got {model!r}; pass --model tiny")
    unused = {"plants": "--plants", "html_path": "--html"}
    if not recover:
        unused["model"] = "--model"
    for flag in sorted(_explicit(ctx, unused)):
        value = ctx.params[next(p for p, f in unused.items() if f == flag)]
        raise BadInput(f"{flag} {value} does not apply to selftest --transfers (the transfer "
                       "faults run on the token oracle; --model only with --kv-canary recover); "
                       "drop it or drop --transfers")  # fmt: skip
    if knobs := _selftest_knobs(model):
        var = "KVCANARY_" + knobs[0][0].upper()  # the variable that set this field
        raise BadInput(f"{var}={os.environ.get(var, knobs[0][1])} is set, but selftest "
                       "--transfers does not apply KVCANARY_* variables; unset it (or drop "
                       "--transfers)")  # fmt: skip
    check_output_path("--json", json_path)
    try:
        faults, where = transfer_selection(modes, places)
    except ValueError as exc:
        raise BadInput(explain(str(exc), {})) from None
    if recover:
        from kvcanary.app.selftest.transfers_cli import selftest_transfers_recover

        status = selftest_transfers_recover(faults, where, seeds, json_path, model or "oracle")
        raise typer.Exit(status)
    raise typer.Exit(selftest_transfers(faults, where, seeds, json_path))


def _selftest_knobs(model: str | None) -> tuple[tuple[str, object], ...]:
    """The user's `KVCANARY_*` knobs for the campaign, validated as `run` validates them;
    `KVCANARY_PERTURB_*` is refused (the campaign injects its own faults)."""
    perturb_vars = sorted(k for k in os.environ if k.startswith("KVCANARY_PERTURB_"))
    if perturb_vars:
        raise BadInput(f"{perturb_vars[0]} is set, but selftest injects its own faults; unset it "
                       "(kvcanary run replays one fault)")  # fmt: skip
    knobs = canary_knobs(os.environ)
    if stride := dict(knobs).get("verify_stride"):
        raise BadInput(f"KVCANARY_VERIFY_STRIDE={stride} is set, but selftest's detection "
                       "deadlines assume every slot verified each forward; unset it")  # fmt: skip
    if model == "tiny":  # every case but next_token_swap then serves the tiny model
        check_reference_engine_env(canary_config("log", "partial", 0, os.environ), "tiny")
    return knobs


def _selftest_recover(spec: CampaignSpec, json_path: Path | None, html_path: Path | None) -> None:
    """`selftest --kv-canary recover`: outcomes against fault-free runs (SPEC §14.3)."""
    total = spec.seeds * (1 + len(spec.modes) + len(spec.plants))
    with Progress(
        TextColumn("[bold]selftest recover {task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=err_console,
    ) as bar:  # fmt: skip
        task = bar.add_task("", total=total)
        summaries = run_outcome_campaign(
            spec, lambda what: bar.update(task, advance=1, description=what)
        )
    Console(width=220).print(outcome_table(summaries))
    if json_path is not None:
        json_path.write_text(json.dumps(outcome_json(summaries, spec), indent=2) + "\n")
    if html_path is not None:
        html_path.write_text(outcome_html(summaries, spec))
    passed = True
    for s in summaries:
        for c in s.cases:
            if c.corrupted_delivered or (s.kind == "clean" and c.recover.incidents):
                passed = False
                typer.echo(
                    f"{s.name} seed {c.seed}: {c.corrupted_delivered} corrupted outputs "
                    f"delivered, {c.recover.incidents} incidents; replay: {c.replay}",
                    err=True,
                )
    if not passed:
        raise typer.Exit(EXIT_VIOLATIONS)


_names = parse_names  # the name `cli.vllm` imports it by


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point (see `kvcanary.cli.entry.main`)."""
    from kvcanary.cli.entry import main as entry_main

    return entry_main(argv)
