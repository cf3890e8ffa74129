"""`kvcanary vllm --disaggregate` (the real vLLM prefill -> decode pair, app.vllm.pd_campaign) and
`kvcanary vllm --offload` (the host tier, app.vllm.offload_campaign)
behind a progress bar, a table per fault and the exit status."""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvcanary.cli.commands import EXIT_VIOLATIONS, err_console, print_summary

__all__ = ["run_disaggregated"]


def run_disaggregated(settings: Any, spec: Any, json_path: Path | None) -> None:
    """Run the campaign; exit 1 when a clean request was not clean (a violation, a different
    output, a failed request) or a fault case was not caught at its landing (in mode `recover`:
    or its recomputed output differs from the prefill engine's own)."""
    from kvcanary.app.vllm.pd_campaign import run_pd_campaign

    work = Path(tempfile.mkdtemp(prefix="kvcanary-vllm-pd-"))
    err_console.print(f"starting two vLLM OpenAI servers (prefill, decode) on 127.0.0.1; "
                      f"storage and logs in {work} ...", markup=False)  # fmt: skip
    total = spec.requests + spec.seeds * len(spec.faults)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console) as bar:  # fmt: skip
        task = bar.add_task("prefill -> decode requests", total=total)
        figures = run_pd_campaign(settings, spec, work, tick=lambda: bar.advance(task))
    rows = figures.pop("rows")
    if rows:
        recover = "output_identical" in rows[0]
        table = Table(title="transfer faults (caught at the landing / cases)")
        for col in ("fault", "caught", "landing violations (min-max)",
                    *(("output identical",) if recover else ())):  # fmt: skip
            table.add_column(col)
        caught, cases, same = Counter[str](), Counter[str](), Counter[str]()
        found: dict[str, list[int]] = {}
        for r in rows:
            cases[r["fault"]] += 1
            caught[r["fault"]] += bool(r["caught"])
            same[r["fault"]] += bool(r.get("output_identical"))
            found.setdefault(r["fault"], []).append(r["landing_violations"])
        for fault, n in cases.items():
            v = found[fault]
            table.add_row(fault, f"{caught[fault]}/{n}", f"{min(v)}-{max(v)}",
                          *((f"{same[fault]}/{n}",) if recover else ()))  # fmt: skip
        Console().print(table)
    print_summary("kvcanary vllm --disaggregate", figures, None)
    if json_path is not None:
        import json

        json_path.write_text(json.dumps({**figures, "rows": rows}, indent=2) + "\n")
    clean_ok = (figures["clean_violations"] == 0 and figures["requests_failed"] == 0
                and figures["outputs_identical"] == figures["clean_requests"]
                and figures["clean_landings_verified"] == figures["clean_requests"])  # fmt: skip
    missed = [r for r in rows if not r["caught"] or r.get("output_identical") is False]
    if not clean_ok or missed or not figures["still_serving"]:
        first = f"; first missed: seed {missed[0]['seed']} {missed[0]['fault']}" if missed else ""
        typer.echo(f"kvcanary vllm --disaggregate: not clean or not caught{first}; replay with "
                   f"--disaggregate --first-seed {missed[0]['seed'] if missed else spec.first_seed}"
                   f" --seeds 1; decode log {figures['decode_log']}", err=True)  # fmt: skip
        raise typer.Exit(EXIT_VIOLATIONS)


def run_offloaded(settings: Any, spec: Any, json_path: Path | None) -> None:
    """Run the host-tier campaign; exit 1 when a clean round was not clean (a violation, a
    repeat that differs, a restore without stamps, a failed request) or a fault was missed."""
    from kvcanary.app.vllm.offload_campaign import run_offload_campaign

    work = Path(tempfile.mkdtemp(prefix="kvcanary-vllm-offload-"))
    err_console.print(f"starting a vLLM OpenAI server with the host offload tier on "
                      f"127.0.0.1; log in {work} ...", markup=False)  # fmt: skip
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console) as bar:  # fmt: skip
        task = bar.add_task("offload rounds", total=spec.rounds + spec.seeds * len(spec.faults))
        figures = run_offload_campaign(settings, spec, work, tick=lambda: bar.advance(task))
    rows = figures.pop("rows")
    if rows:
        recover = "output_identical" in rows[0]
        table = Table(title="host-tier faults (caught at the restore / restores)")
        for col in ("fault", "caught", "restore violations (min-max)",
                    *(("output identical",) if recover else ())):  # fmt: skip
            table.add_column(col)
        by: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            by.setdefault(r["fault"], []).append(r)
        for fault, rs in by.items():
            found = [r["restore_violations"] for r in rs]
            same = sum(bool(r.get("output_identical")) for r in rs)
            table.add_row(fault, f"{sum(v > 0 for v in found)}/{len(found)}",
                          f"{min(found)}-{max(found)}",
                          *((f"{same}/{len(rs)}",) if recover else ()))  # fmt: skip
        Console().print(table)
    print_summary("kvcanary vllm --offload", figures, None)
    if json_path is not None:
        import json

        json_path.write_text(json.dumps({**figures, "rows": rows}, indent=2) + "\n")
    clean_ok = (figures["clean_violations"] == 0 and figures["requests_failed"] == 0
                and figures["repeats_identical"] == figures["clean_rounds"]
                and figures["clean_restores"] >= figures["clean_rounds"]
                and figures["clean_restores_stamped"] == figures["clean_restores"])  # fmt: skip
    caught = figures["faults_caught"] == figures["fault_restores"] == figures["fault_cases"]
    caught = caught and all(r.get("output_identical", True) for r in rows)
    if not clean_ok or not caught or not figures["still_serving"]:
        typer.echo(f"kvcanary vllm --offload: not clean or not caught; replay with --offload "
                   f"--first-seed {spec.first_seed}; log {figures['log']}", err=True)  # fmt: skip
        raise typer.Exit(EXIT_VIOLATIONS)
