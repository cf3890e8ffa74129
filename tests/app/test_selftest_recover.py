"""`kvcanary selftest --kv-canary recover` and `kvcanary run --kv-canary recover` (SPEC §14.3):
no corrupted output is ever delivered, the clean baseline matches the fault-free run, and log
mode shows the damage side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcanary.app.selftest.campaign import CAMPAIGN_MODES, CampaignSpec
from kvcanary.app.selftest.outcome import run_outcome_campaign, run_outcome_case
from kvcanary.cli import app, main
from kvcanary.engine.plants import PLANT_NAMES


@pytest.mark.slow
def test_ci_campaign_delivers_no_corrupted_output() -> None:
    """Every fault mode and plant on 2 seeds (the 20-seed campaign is the closing measurement)."""
    summaries = run_outcome_campaign(CampaignSpec(seeds=2))
    by_name = {s.name: s for s in summaries}
    assert set(by_name) == {"clean", *CAMPAIGN_MODES, *PLANT_NAMES}
    for s in summaries:
        j = s.as_json()
        assert j["corrupted_delivered"] == 0 and j["seeds_corrupted_delivered_0"] == 2, j
        if s.kind != "clean":
            assert j["incidents"] > 0, j  # every fault was acted on
        assert j["unmatched"] == 0 or s.kind == "mode", j
    clean = by_name["clean"].as_json()
    assert clean["incidents"] == clean["recoveries"] == clean["failed"] == 0
    # the fault modes recover every request (the retry budget is the plants' backstop only)
    assert all(by_name[m].as_json()["failed"] == 0 for m in CAMPAIGN_MODES)
    # log mode delivers the swapped tokens; recover mode does not
    assert by_name["next_token_swap"].as_json()["log_corrupted_delivered"] > 0


def test_clean_recover_run_matches_the_fault_free_run() -> None:
    case = run_outcome_case(CampaignSpec(seeds=1), 3, with_log=False)
    assert case.kind == "clean" and case.recover.incidents == 0 and case.recover.violations == 0
    assert case.corrupted_delivered == 0 and case.unmatched == 0
    assert len(case.recover.outputs) > 0 and case.recover.failed == 0


def test_swap_is_recovered_where_log_mode_delivers_it() -> None:
    case = run_outcome_case(CampaignSpec(seeds=1), 0, mode="next_token_swap")
    assert case.recover.incidents > 0 and case.recover.recoveries > 0
    assert case.corrupted_delivered == 0 and case.recover.failed == 0
    assert case.log_corrupted_delivered is not None and case.log_corrupted_delivered > 0


def test_tiny_model_shows_the_damage_log_mode_delivers() -> None:
    """With outputs that depend on the KV, a planted eviction bug corrupts outputs in log mode;
    recover mode delivers none of them."""
    case = run_outcome_case(CampaignSpec(seeds=1, model="tiny"), 0, plant="radix_evict_locked")
    assert case.log_corrupted_delivered is not None and case.log_corrupted_delivered > 0
    assert case.corrupted_delivered == 0 and case.recover.failed == 0
    assert case.recover.incidents > 0


def test_selftest_recover_cli_json(tmp_path: Path) -> None:
    out, page = tmp_path / "r.json", tmp_path / "r.html"
    result = CliRunner().invoke(
        app,
        ["selftest", "--kv-canary", " Recover ", "--modes", "next_token_swap,double_alloc",
         "--plants", "none", "--seeds", "1", "--json", str(out), "--html", str(page)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["kv_canary_mode"] == "recover" and doc["passed"]
    results = {r["name"]: r for r in doc["results"]}
    assert set(results) == {"clean", "next_token_swap", "double_alloc"}
    for r in results.values():
        for key in ("corrupted_delivered", "failed", "recovered", "recompute_tokens",
                    "log_corrupted_delivered", "recovery_latency_steps_max"):  # fmt: skip
            assert key in r
        assert r["corrupted_delivered"] == 0
    assert "kv_canary_mode=recover): PASSED" in page.read_text()
    assert (
        "kvcanary selftest --kv-canary recover" in result.output
        and "log: corrupted" in result.output
    )


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("raise", "kvcanary selftest: --kv-canary must be log or recover, got 'raise'; pass "
                  "--kv-canary log (or recover)"),
        ("maybe", "kvcanary selftest: --kv-canary must be one of none/log/raise/recover, got "
                  "'maybe'; pass one of none/log/raise/recover"),
    ],
)  # fmt: skip
def test_selftest_bad_mode_is_one_line(mode: str, message: str) -> None:
    with CliRunner().isolation() as (_, err, _):
        assert main(["selftest", "--kv-canary", mode]) == 2
        assert err.getvalue().decode().strip() == message


def test_run_recover_reports_incidents_and_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCANARY_PERTURB_DOUBLE_ALLOC_PROB", "0.05")
    monkeypatch.setenv("KVCANARY_PERTURB_WARMUP_STEPS", "5")
    events, summary = tmp_path / "ev.jsonl", tmp_path / "s.json"
    result = CliRunner().invoke(
        app,
        ["run", "--kv-canary", "recover", "--model", "oracle", "--requests", "12", "--quiet",
         "--events", str(events), "--json", str(summary)],
    )  # fmt: skip
    assert result.exit_code == 1, result.output  # violations were found (and acted on)
    figures = json.loads(summary.read_text())
    assert figures["canary_mode"] == "recover" and figures["incidents"] > 0
    assert figures["requests_recovered"] + figures["requests_failed"] > 0
    assert (
        figures["requests_finished"] + figures["requests_failed"] + figures["requests_aborted"]
        == 12
    )
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    incidents = [x for x in lines if x["event"] == "incident"]
    assert len(incidents) == figures["incidents"]
    assert {"stage", "launch_tag", "step", "slots", "rows", "reasons"} <= set(incidents[0])
