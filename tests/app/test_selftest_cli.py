"""`kvcanary selftest` end to end on 3 seeds: every mode and plant caught 1:1, clean baseline silent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcanary.app.selftest.campaign import CAMPAIGN_MODES, EXPECTED_REASONS
from kvcanary.cli import app, main
from kvcanary.engine.plants import PLANT_NAMES


@pytest.mark.slow
def test_selftest_three_seeds(tmp_path: Path) -> None:
    out, page = tmp_path / "selftest.json", tmp_path / "selftest.html"
    result = CliRunner().invoke(
        app, ["selftest", "--seeds", "3", "--json", str(out), "--html", str(page)]
    )
    doc = json.loads(out.read_text())
    assert result.exit_code == 0, result.output + json.dumps(doc, indent=1)
    assert doc["passed"] and doc["clean_baseline"] == {"seeds": 3, "violations": 0}
    results = {r["name"]: r for r in doc["results"]}
    assert set(results) == set(CAMPAIGN_MODES) | set(PLANT_NAMES)
    for name, r in results.items():
        assert r["seeds"] == 3 and r["seeds_caught_1to1"] == 3 and r["seeds_caught_any"] == 3, name
        assert r["missed"] == 0 and r["false_alarms"] == 0, name
        assert r["injections"] >= 3 and r["latency_steps_max"] is not None, name
        assert set(r["reasons_seen"]) & EXPECTED_REASONS[name], name
        assert r["kind"] == ("plant" if name in PLANT_NAMES else "mode")
    html = page.read_text()
    assert "kvcanary selftest: PASSED" in html and html.count("data:image/png;base64,") == 2


def test_unknown_mode_is_a_one_line_error() -> None:
    runner = CliRunner()
    with runner.isolation() as (_, err, _):
        assert main(["selftest", "--modes", "bogus"]) == 2
        assert (
            err.getvalue()
            .decode()
            .strip()
            .startswith(
                "kvcanary selftest: --modes: unknown mode 'bogus'; choose from req_to_token,"
            )
        )
    assert CliRunner().invoke(app, ["selftest", "--modes", "bogus"]).exit_code == 2
