"""The transfer paths as users reach them: `kvcanary run --host-tier-pages`, bad input."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvcanary.cli.commands import app

RUNNER = CliRunner()


def test_run_with_host_tier_is_clean_and_matches_reference(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    result = RUNNER.invoke(app, ["run", "--host-tier-pages", "256", "--requests", "30", "--model",
                                 "oracle", "--num-slots", "200", "--quiet", "--json", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["violations"] == 0
    assert figures["host_restores"] > 0 and figures["host_rejected_restores"] == 0
    assert figures["outputs_compared"] > 0 and figures["outputs_identical"] is True


def test_negative_host_tier_pages_is_one_line_exit_2() -> None:
    result = RUNNER.invoke(app, ["run", "--host-tier-pages", "-1"])
    assert result.exit_code == 2
    assert "--host-tier-pages must be >= 0, got -1; use 0 for no host tier" in result.output
    assert "Traceback" not in result.output
