"""vLLM's host offload tier on the CPU platform (`kvcanary.adapters.vllm.offload`), as a user
runs it: `kvcanary vllm --offload` starts one OpenAI server with the user-level
`OffloadingConnector` (the canary's CPU spec, loaded by `spec_name` + `spec_module_path`) and the
canary composed by the `KVCANARY_MODE` shortcut. Few device blocks, so each prompt's blocks are
evicted by the next prompts and a repeat restores them from the host tier. Clean: every restore
carries its stamps and verifies, 0 violations, the repeat's greedy output identical to the
first. Faults (`app.vllm.offload_faults`): another page's bytes, a flipped bit, a lost store,
each caught at its restore, 1:1 with the fault journal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcanary.app.vllm.offload_campaign import OFFLOAD_FAULTS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_the_offload_command_round_trips_clean_and_catches_every_fault(tmp_path: Path) -> None:
    # CI size; the closing note's measurement runs --requests 20 --seeds 10
    out = tmp_path / "offload.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_")}
    result = subprocess.run(
        [sys.executable, "-m", "kvcanary.cli", "vllm", "--offload", "--requests", "3",
         "--faults", "all", "--seeds", "1", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=1200,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["repeats_identical"] == doc["clean_rounds"] == 3
    assert doc["clean_restores"] >= 3 and doc["clean_restores_stamped"] == doc["clean_restores"]
    assert doc["clean_restore_violations"] == doc["clean_violations"] == 0
    assert doc["requests_failed"] == 0 and doc["still_serving"]
    assert [r["fault"] for r in doc["rows"]] == list(OFFLOAD_FAULTS[1:])
    assert all(r["caught"] for r in doc["rows"])
    assert doc["faults_caught"] == doc["fault_cases"] == len(OFFLOAD_FAULTS) - 1
    assert "host-tier faults (caught at the restore / restores)" in result.stdout


def test_recover_mode_recomputes_a_bad_restore(tmp_path: Path) -> None:
    # a restore whose checksum differs is a vLLM load error of the waiting request (the user's
    # kv_load_failure_policy=recompute): it recomputes, so its repeat gets the first's tokens
    out = tmp_path / "offload.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_")}
    result = subprocess.run(
        [sys.executable, "-m", "kvcanary.cli", "vllm", "--offload", "--kv-canary", "recover",
         "--requests", "2", "--faults", "all", "--seeds", "1", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=1200,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["repeats_identical"] == 2 and doc["clean_violations"] == 0
    assert doc["requests_failed"] == 0 and doc["still_serving"]
    assert [(r["fault"], r["caught"], r["output_identical"]) for r in doc["rows"]] == [
        (f, True, True) for f in OFFLOAD_FAULTS[1:]
    ]
