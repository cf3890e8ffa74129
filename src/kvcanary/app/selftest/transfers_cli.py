"""The body of `kvcanary selftest --transfers` (the CLI parses and checks the flags, with
`selection.transfer_selection`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import typer
from rich.console import Console

from kvcanary.app.selftest.transfers import run_transfer_campaign
from kvcanary.app.selftest.transfers_report import transfer_json, transfer_passed, transfer_table

__all__ = ["selftest_transfers"]


def selftest_transfers(
    faults: Sequence[str], places: Sequence[str], seeds: range, json_path: Path | None
) -> int:
    """Run the transfer campaign; returns the exit status (0 pass, 1 fail)."""
    logging.disable(logging.WARNING)  # violations are expected; the table tells the story
    baseline, summaries = run_transfer_campaign(faults, seeds, 24, places=places)
    Console(width=200).print(transfer_table(baseline, summaries))
    if json_path is not None:
        json_path.write_text(json.dumps(transfer_json(baseline, summaries), indent=2) + "\n")
    for c in baseline:
        if c.violations or not c.outputs_identical:
            typer.echo(f"clean {c.where} seed {c.seed}: {c.violations} violations", err=True)
    for s in summaries:
        for c in s.cases:
            if not c.correlation.one_to_one:
                typer.echo(
                    f"{s.fault} {s.where} seed {c.seed} not caught 1:1; replay: {c.replay}",
                    err=True,
                )
    return 0 if transfer_passed(baseline, summaries) else 1
