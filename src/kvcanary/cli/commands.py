"""`kvcanary run`, `check-config` and `selftest` on the built-in reference engine."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvcanary.app.observability import EventLog, RunMetrics, StepObserver
from kvcanary.app.selftest.campaign import CAMPAIGN_MODES, CampaignSpec, run_campaign
from kvcanary.app.selftest.outcome import outcome_json, run_outcome_campaign
from kvcanary.app.selftest.outcome_report import outcome_html, outcome_table
from kvcanary.app.selftest.report import campaign_json, campaign_passed, html_report, result_table
from kvcanary.app.session import RunSettings, RunSummary, run_session
from kvcanary.app.workload import WorkloadSpec
from kvcanary.canary import CanaryConfig, CanaryLaunchCapacities
from kvcanary.canary import CanaryMode as CanaryModeValue
from kvcanary.canary.config import parse_mode
from kvcanary.engine.config import EngineConfig
from kvcanary.engine.model import ModelConfig
from kvcanary.engine.plants import PLANT_NAMES

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="KV-cache canary: make KV corruption impossible to miss.",
)
err_console = Console(stderr=True)

EXIT_CLEAN, EXIT_VIOLATIONS, EXIT_BAD_INPUT, EXIT_STOPPED = 0, 1, 2, 3

CanaryMode = Annotated[
    str, typer.Option("--kv-canary", help="none | log | raise | recover (off = none)")
]
RealData = Annotated[str, typer.Option("--kv-canary-real-data", help="none | partial | all")]
Sweep = Annotated[
    int,
    typer.Option("--kv-canary-sweep-interval", help="prefix-cache sweep every N steps; 0 = off"),
]


def _fail(message: str) -> typer.Exit:
    typer.echo(message, err=True)
    return typer.Exit(EXIT_BAD_INPUT)


def _canary_config(kv_canary: str, real_data: str, sweep: int) -> CanaryConfig:
    return CanaryConfig.from_args_and_env(
        kv_canary=kv_canary,
        kv_canary_real_data=real_data,
        kv_canary_sweep_interval=sweep,
        environ=os.environ,
    )


@app.command()
def run(
    kv_canary: CanaryMode = "log",
    kv_canary_real_data: RealData = "partial",
    kv_canary_sweep_interval: Sweep = 8,
    model: Annotated[
        str, typer.Option(help="tiny (a real tiny transformer) | oracle (token oracle)")
    ] = "tiny",
    requests: Annotated[int, typer.Option(help="requests in the workload")] = 48,
    seed: Annotated[int, typer.Option(help="seed of the workload and the model")] = 0,
    num_slots: Annotated[int, typer.Option(help="KV pool slots (slot 0 reserved)")] = 448,
    max_running_requests: Annotated[int, typer.Option()] = 8,
    max_batch_size: Annotated[int, typer.Option()] = 8,
    chunked_prefill_size: Annotated[int, typer.Option(help="-1 = unlimited")] = 32,
    max_prefill_tokens: Annotated[int, typer.Option(help="token budget per step")] = 96,
    speculative_num_draft_tokens: Annotated[
        int, typer.Option(help="draft tokens per verify; 0 = off")
    ] = 2,
    max_context_len: Annotated[int, typer.Option()] = 256,
    dtype: Annotated[str, typer.Option(help="float32 | bfloat16")] = "float32",
    json_path: Annotated[
        Path | None, typer.Option("--json", help="write the summary as JSON")
    ] = None,
    events: Annotated[
        Path | None, typer.Option(help="write every violation and step summary as JSON lines")
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="serve Prometheus counters on this port")
    ] = None,
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
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
    """Serve the embedded workload on the reference engine with the canary installed.

    Exit status: 0 clean, 1 violations found (log mode), 2 bad input, 3 stopped by raise mode.
    """
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        chunk = None if chunked_prefill_size == -1 else chunked_prefill_size
        CanaryLaunchCapacities.from_args(  # validates the sizes with the canary's own messages
            req_to_token_pool_size=max_running_requests, max_seq_len_per_req=max_context_len,
            pool_slot_count=num_slots, cuda_graph_max_bs=max_batch_size,
            speculative_num_draft_tokens=speculative_num_draft_tokens,
            max_prefill_tokens=max_prefill_tokens, chunked_prefill_size=chunk,
        )  # fmt: skip
        settings = RunSettings(
            canary=_canary_config(kv_canary, kv_canary_real_data, kv_canary_sweep_interval),
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
                plants=tuple(plant or ()),
            ),
            model=ModelConfig(vocab_size=256, dtype=dtype, seed=seed),
            model_kind=model,
            workload=WorkloadSpec(num_requests=requests, seed=seed, vocab_size=256),
        )
        if host_tier_pages < 0:
            raise ValueError(
                f"--host-tier-pages must be >= 0, got {host_tier_pages}; use 0 for no host tier"
            )
    except (ValueError, TypeError) as exc:
        raise _fail(str(exc)) from None
    observer = StepObserver(
        EventLog(events) if events else None, RunMetrics(metrics_port) if metrics_port else None
    )
    with Progress(
        TextColumn("[bold]serving"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err_console, disable=quiet, transient=False,
    ) as bar:  # fmt: skip
        task = bar.add_task("requests", total=requests)
        summary = _serve(  # a plain run, or one with KV leaving the pool (app.transfers_cli)
            settings, host_tier_pages, disaggregate,
            lambda done, total: bar.update(task, completed=done, total=total), observer,
        )  # fmt: skip
    observer.close()
    print_summary("kvcanary run", summary.figures, json_path)
    if summary.stopped_by_raise:
        err_console.print(
            "kv-canary: stopped by raise mode; replay with --seed", seed, markup=False
        )
        raise typer.Exit(EXIT_STOPPED)
    exit_on_violations(summary.figures, seed)


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


@app.command("check-config")
def check_config(
    kv_canary: CanaryMode = "none",
    kv_canary_real_data: RealData = "none",
    kv_canary_sweep_interval: Sweep = 0,
    req_to_token_pool_size: Annotated[int, typer.Option()] = 64,
    max_seq_len_per_req: Annotated[int, typer.Option()] = 4096,
    pool_slot_count: Annotated[int, typer.Option()] = 10000,
    cuda_graph_max_bs: Annotated[int | None, typer.Option()] = None,
    speculative_num_draft_tokens: Annotated[int | None, typer.Option()] = None,
    max_prefill_tokens: Annotated[int, typer.Option()] = 16384,
    chunked_prefill_size: Annotated[int | None, typer.Option()] = None,
) -> None:
    """Validate canary flags, `KVCANARY_*` variables and capacities; print what would be used."""
    try:
        config = _canary_config(kv_canary, kv_canary_real_data, kv_canary_sweep_interval)
        caps = CanaryLaunchCapacities.from_args(
            req_to_token_pool_size=req_to_token_pool_size, max_seq_len_per_req=max_seq_len_per_req,
            pool_slot_count=pool_slot_count, cuda_graph_max_bs=cuda_graph_max_bs,
            speculative_num_draft_tokens=speculative_num_draft_tokens,
            max_prefill_tokens=max_prefill_tokens, chunked_prefill_size=chunked_prefill_size,
        )  # fmt: skip
    except (ValueError, TypeError) as exc:
        raise _fail(str(exc)) from None
    Console().print(config)
    Console().print(caps)


@app.command()
def selftest(
    modes: Annotated[str, typer.Option(help="all | none | comma-separated fault modes")] = "all",
    plants: Annotated[
        str, typer.Option(help="all | none | comma-separated planted engine bugs")
    ] = "all",
    seeds: Annotated[int, typer.Option(help="seeds per mode and plant")] = 20,
    first_seed: Annotated[int, typer.Option(help="first seed (replay a failing one)")] = 0,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="write the results as JSON")
    ] = None,
    html_path: Annotated[
        Path | None, typer.Option("--html", help="write an HTML report with plots")
    ] = None,
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
    every seed, and the clean baseline has no incident.
    """
    logging.disable(logging.WARNING)  # violations are expected here; the table tells the story
    try:
        spec = CampaignSpec(
            modes=_names(modes, CAMPAIGN_MODES), plants=_names(plants, PLANT_NAMES), seeds=seeds,
            first_seed=first_seed, model=model,
        )  # fmt: skip
        selftest_mode = parse_mode(kv_canary)
        if selftest_mode not in (CanaryModeValue.LOG, CanaryModeValue.RECOVER):
            raise ValueError(f"selftest: --kv-canary must be log or recover, got {kv_canary!r}")
    except ValueError as exc:
        raise _fail(str(exc)) from None
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
        html_path.write_text(html_report(baseline, summaries))
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


def _names(value: str, known: tuple[str, ...]) -> tuple[str, ...]:
    word = value.strip().lower()
    if word == "all":
        return known
    if word in ("none", ""):
        return ()
    return tuple(n.strip() for n in word.split(",") if n.strip())


def main() -> None:
    """Console-script entry point."""
    app(prog_name="kvcanary")
