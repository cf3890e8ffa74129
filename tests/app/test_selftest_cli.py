"""`kvcanary selftest` end to end on 3 seeds: every mode and plant caught 1:1, clean baseline silent."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcanary.app.selftest.campaign import CAMPAIGN_MODES, EXPECTED_REASONS, CampaignSpec
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


def test_selftest_applies_kvcanary_knobs_to_every_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """`KVCANARY_*` knobs reach each case's canary as `kvcanary run` applies them; unset ones
    keep the campaign's fixture (no stats lines, default ring)."""
    import dataclasses

    from kvcanary.app.selftest.campaign import case_settings
    from kvcanary.cli import commands

    specs: list[CampaignSpec] = []

    def fake_campaign(spec: CampaignSpec, progress: object) -> tuple[list[object], list[object]]:
        specs.append(spec)
        return [], []

    monkeypatch.setattr(commands, "run_campaign", fake_campaign)
    for k in [k for k in os.environ if k.startswith("KVCANARY_")]:
        monkeypatch.delenv(k)
    args = ["selftest", "--seeds", "1", "--modes", "late_write", "--plants", "spec_rollback_stale"]
    assert main(args) == 0
    plain = specs.pop()
    assert plain.canary_knobs == ()
    monkeypatch.setenv("KVCANARY_RING_CAPACITY", "64")
    monkeypatch.setenv("KVCANARY_STATS_PRINT_EVERY_N_STEPS", "7")
    monkeypatch.setenv("KVCANARY_ENABLE_VERIFY_TOKEN_ASSERT", "1")
    monkeypatch.setenv("KVCANARY_ENABLE_WRITE_INPUT_ASSERT", "1")
    assert main(args) == 0
    spec = specs.pop()
    assert dict(spec.canary_knobs) == {
        "ring_capacity": 64, "stats_print_every_n_steps": 7, "enable_verify_token_assert": True,
        "enable_write_input_assert": True,
    }  # fmt: skip
    for mode, plant in (("late_write", None), (None, "spec_rollback_stale"), (None, None)):
        before = case_settings(plain, 0, mode=mode, plant=plant).canary
        after = case_settings(spec, 0, mode=mode, plant=plant).canary
        assert before.ring_capacity == 1024 and before.stats_print_every_n_steps == 0
        assert after.ring_capacity == 64 and after.stats_print_every_n_steps == 7
        assert after.enable_verify_token_assert and not before.enable_verify_token_assert
        # the write-input assert needs the token oracle: the rollback plant serves the tiny model
        assert after.enable_write_input_assert == (plant != "spec_rollback_stale")
        assert after == dataclasses.replace(
            before, ring_capacity=64, stats_print_every_n_steps=7, enable_verify_token_assert=True
        )
