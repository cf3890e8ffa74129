"""Recover-mode self-test results: a Rich table and an HTML page (JSON: `outcome.outcome_json`)."""

from __future__ import annotations

import html
from collections.abc import Sequence

from rich.table import Table

from kvcanary.app.selftest.campaign import CampaignSpec
from kvcanary.app.selftest.outcome import OutcomeSummary, outcome_json

__all__ = ["outcome_html", "outcome_table"]

_COLUMNS = (
    ("name", "name"), ("kind", "kind"), ("seeds", "seeds"),
    ("seeds ok", "seeds_corrupted_delivered_0"), ("corrupted delivered", "corrupted_delivered"),
    ("log: corrupted delivered", "log_corrupted_delivered"), ("failed", "failed"),
    ("recovered", "recovered"), ("recomputes", "recoveries"),
    ("recompute tokens", "recompute_tokens"), ("latency mean/max", None),
    ("budget spent", "retry_budget_spent"), ("incidents", "incidents"),
    ("delivered", "delivered"), ("unmatched", "unmatched"),
)  # fmt: skip


def _cells(j: dict[str, object]) -> list[str]:
    out = []
    for _, key in _COLUMNS:
        if key is None:
            out.append(f"{j['recovery_latency_steps_mean']}/{j['recovery_latency_steps_max']}")
        else:
            out.append(str(j[key]))
    return out


def outcome_table(summaries: Sequence[OutcomeSummary]) -> Table:
    """One row per fault (and the clean baseline): recover's outcome next to log's damage."""
    table = Table(
        title="kvcanary selftest --kv-canary recover (outputs vs a fault-free run; "
        "log column: what log mode delivered)"
    )
    for title, key in _COLUMNS:
        table.add_column(title, justify="left" if key in ("name", "kind") else "right")
    table.add_column("ok", justify="right")
    for s in summaries:
        table.add_row(*_cells(s.as_json()), "[green]yes[/]" if s.passed else "[red]NO[/]")
    return table


def outcome_html(summaries: Sequence[OutcomeSummary], spec: CampaignSpec) -> str:
    """A self-contained HTML page with the same columns."""
    doc = outcome_json(list(summaries), spec)
    head = "".join(f"<th>{html.escape(t)}</th>" for t, _ in _COLUMNS) + "<th>ok</th>"
    rows = "".join(
        "<tr>"
        + "".join(f"<td>{html.escape(c)}</td>" for c in _cells(s.as_json()))
        + f"<td>{'yes' if s.passed else 'NO'}</td></tr>"
        for s in summaries
    )
    verdict = "PASSED" if doc["passed"] else "FAILED"
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        "<title>kvcanary selftest --kv-canary recover</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px}</style></head><body>"
        f"<h1>kvcanary selftest (kv_canary_mode=recover): {verdict}</h1>"
        f"<p>{spec.seeds} seeds from {spec.first_seed}. Each fault runs against a fault-free "
        "run of the same workload; <b>corrupted delivered</b> counts requests delivered with a "
        "different output (must be 0 in recover mode); the log column shows what log mode "
        "delivered with the same fault.</p>"
        f"<table><tr>{head}</tr>{rows}</table></body></html>"
    )
