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


def test_run_disaggregate_is_clean_and_matches_reference(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    result = RUNNER.invoke(app, ["run", "--disaggregate", "--requests", "12", "--model", "oracle",
                                 "--quiet", "--json", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["violations"] == 0 and figures["prefill_violations"] == 0
    assert figures["transfers"] > 0 and figures["outputs_identical"] is True


def test_selftest_transfers_host_catches_a_fault_one_to_one(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    result = RUNNER.invoke(app, ["selftest", "--transfers", "--places", "host", "--seeds", "1",
                                 "--modes", "bit_flip_in_transit", "--json", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["passed"] and doc["results"][0]["seeds_caught_1to1"] == 1


def test_selftest_transfers_bad_mode_is_exit_2() -> None:
    result = RUNNER.invoke(app, ["selftest", "--transfers", "--modes", "bogus"])
    assert result.exit_code == 2
    assert "--modes: unknown transfer fault 'bogus'" in result.output


def test_selftest_transfers_recover_contains_a_bad_restore(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    result = RUNNER.invoke(app, ["selftest", "--transfers", "--kv-canary", "recover", "--places",
                                 "host", "--seeds", "1", "--modes", "stale_host_copy", "--json",
                                 str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["passed"] and doc["mode"] == "recover" and doc["clean_baseline"]["incidents"] == 0
    (row,) = doc["results"]
    assert row["seeds_contained"] == 1 and row["rejected_landings"] == 1
    assert row["requests_recomputed"] == 0 and row["requests_failed"] == 0


def test_selftest_transfers_refuses_raise_and_model_without_recover() -> None:
    bad = RUNNER.invoke(app, ["selftest", "--transfers", "--kv-canary", "raise"])
    assert bad.exit_code == 2 and "--kv-canary must be log or recover" in bad.output
    model = RUNNER.invoke(app, ["selftest", "--transfers", "--model", "tiny"])
    assert model.exit_code == 2 and "--model tiny does not apply" in model.output
