"""`kvcanary selftest --transfers`: the result table and JSON document of the transfer faults."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from kvcanary.app.selftest.transfers import TransferCase, TransferSummary
from kvcanary.app.selftest.transfers_recover import RecoverCase

__all__ = ["recover_json", "recover_table", "transfer_json", "transfer_passed", "transfer_table"]


def transfer_passed(baseline: Sequence[TransferCase], summaries: Sequence[TransferSummary]) -> bool:
    """Every fault caught 1:1 on every seed, and silent clean baselines with correct outputs."""
    clean = all(c.violations == 0 and c.outputs_identical for c in baseline)
    return clean and all(s.passed for s in summaries)


def transfer_json(
    baseline: Sequence[TransferCase], summaries: Sequence[TransferSummary]
) -> dict[str, object]:
    """The `--json` document."""
    return {
        "passed": transfer_passed(baseline, summaries),
        "clean_baseline": {
            "runs": len(baseline),
            "violations": sum(c.violations for c in baseline),
            "outputs_identical_runs": sum(c.outputs_identical for c in baseline),
        },
        "results": [s.as_json() | {"passed": s.passed} for s in summaries],
    }


def transfer_table(baseline: Sequence[TransferCase], summaries: Sequence[TransferSummary]) -> Table:
    """One row per (fault, place)."""
    clean = sum(c.violations for c in baseline)
    table = Table(title=f"kvcanary selftest --transfers (clean baselines: {len(baseline)} runs, "
                        f"{clean} violations)")  # fmt: skip
    for col in ("fault", "where", "seeds", "1:1", "missed", "false alarms", "latency med/max",
                "tags", "reasons", "ok"):  # fmt: skip
        table.add_column(col)
    for s in summaries:
        j = s.as_json()
        table.add_row(
            s.fault, s.where, str(j["seeds"]), str(j["seeds_caught_1to1"]), str(j["missed"]),
            str(j["false_alarms"]), f"{j['latency_steps_median']}/{j['latency_steps_max']}",
            " ".join(j["tags_seen"]), " ".join(j["reasons_seen"]),  # type: ignore[arg-type]
            "[green]yes[/]" if s.passed else "[red]NO[/]",
        )  # fmt: skip
    return table


def _recover_rows(cases: Sequence[RecoverCase]) -> list[dict[str, object]]:
    keys = list(dict.fromkeys((c.fault, c.where) for c in cases))  # in campaign order
    rows = []
    for fault, where in keys:
        group = [c for c in cases if (c.fault, c.where) == (fault, where)]
        rows.append({
            "name": fault, "where": where, "seeds": len(group),
            "seeds_contained": sum(c.contained for c in group),
            "incidents": sum(c.incidents for c in group),
            "rejected_landings": sum(c.rejected for c in group),
            "requests_recomputed": sum(len(c.recomputed) for c in group),
            "requests_failed": sum(len(c.failed) for c in group),
            "outputs_identical_seeds": sum(c.outputs_identical for c in group),
            "failing_seeds": [c.seed for c in group if not c.contained],
        })  # fmt: skip
    return rows


def recover_json(
    baseline: Sequence[RecoverCase], cases: Sequence[RecoverCase], model: str
) -> dict[str, object]:
    """The `--json` document of `--kv-canary recover`."""
    return {
        "passed": all(c.contained for c in [*baseline, *cases]),
        "mode": "recover",
        "model": model,
        "clean_baseline": {
            "runs": len(baseline),
            "incidents": sum(c.incidents for c in baseline),
            "outputs_identical_runs": sum(c.outputs_identical for c in baseline),
        },
        "results": _recover_rows(cases),
    }


def recover_table(
    baseline: Sequence[RecoverCase], cases: Sequence[RecoverCase], model: str
) -> Table:
    """One row per (fault, place) in mode `recover`."""
    table = Table(title=f"kvcanary selftest --transfers --kv-canary recover (model {model}; clean "
                        f"baselines: {len(baseline)} runs, {sum(c.incidents for c in baseline)} "
                        "incidents)")  # fmt: skip
    cols = ("name", "where", "seeds", "seeds_contained", "incidents", "rejected_landings",
            "requests_recomputed", "requests_failed", "outputs_identical_seeds")  # fmt: skip
    for col in cols:
        table.add_column(col.replace("_", " "))
    for row in _recover_rows(cases):
        table.add_row(*(str(row[c]) for c in cols))
    return table
