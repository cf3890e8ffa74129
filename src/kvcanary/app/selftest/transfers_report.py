"""`kvcanary selftest --transfers`: the result table and JSON document of the transfer faults."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from kvcanary.app.selftest.transfers import TransferCase, TransferSummary

__all__ = ["transfer_json", "transfer_passed", "transfer_table"]


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
