"""The body of `kvcanary selftest --transfers` (the CLI only parses flags)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import typer
from rich.console import Console

from kvcanary.app.selftest.transfers import PLACES, run_transfer_campaign
from kvcanary.app.selftest.transfers_report import transfer_json, transfer_passed, transfer_table
from kvcanary.engine.transfer_faults import TRANSFER_FAULT_NAMES, validate_transfer_faults

__all__ = ["selftest_transfers"]


def _names(value: str, known: tuple[str, ...]) -> tuple[str, ...]:
    word = value.strip().lower()
    if word == "all":
        return known
    if word in ("none", ""):
        return ()
    return tuple(n.strip() for n in word.split(",") if n.strip())


def selftest_transfers(
    modes: str, places: str, seeds: int, first_seed: int, json_path: Path | None
) -> int:
    """Run the transfer campaign; returns the exit status (0 pass, 1 fail, 2 bad input)."""
    try:
        faults = _names(modes, TRANSFER_FAULT_NAMES)
        validate_transfer_faults(faults)
        where = _names(places, tuple(PLACES))
        bad = [p for p in where if p not in PLACES]
        if bad:
            raise ValueError(f"--places: unknown place {bad[0]!r}; choose from host, disagg")
        if seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {seeds}")
    except ValueError as exc:
        typer.echo(str(exc), err=True)
        return 2
    logging.disable(logging.WARNING)  # violations are expected; the table tells the story
    baseline, summaries = run_transfer_campaign(
        faults, range(first_seed, first_seed + seeds), 24, places=where
    )
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
