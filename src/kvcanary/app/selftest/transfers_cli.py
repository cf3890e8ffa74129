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
from kvcanary.app.selftest.transfers_recover import run_recover_campaign
from kvcanary.app.selftest.transfers_report import (
    recover_json,
    recover_table,
    transfer_json,
    transfer_passed,
    transfer_table,
)

__all__ = ["selftest_transfers", "selftest_transfers_recover"]


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


def selftest_transfers_recover(
    faults: Sequence[str], places: Sequence[str], seeds: range, json_path: Path | None, model: str
) -> int:
    """The campaign in mode `recover`; exit status 0 when every case is contained."""
    logging.disable(logging.WARNING)
    baseline, cases = run_recover_campaign(faults, seeds, 24, places, model)
    Console(width=200).print(recover_table(baseline, cases, model))
    doc = recover_json(baseline, cases, model)
    if json_path is not None:
        json_path.write_text(json.dumps(doc, indent=2) + "\n")
    for c in [*baseline, *cases]:
        if not c.contained:
            typer.echo(f"{c.fault} {c.where} seed {c.seed} not contained; replay: {c.replay}",
                       err=True)  # fmt: skip
    return 0 if doc["passed"] else 1
