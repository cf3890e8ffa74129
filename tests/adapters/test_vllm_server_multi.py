"""The plugin's shortcut as a user composes it: `KVCANARY_MODE=log` beside the user's own
connector (vLLM's ExampleConnector, shared storage), so vLLM runs both in a MultiConnector. The
real OpenAI server over HTTP on 127.0.0.1, vLLM's defaults (dtype auto, multiprocess executor,
stats logging on): every request answers, 0 violations, and vLLM's stats logger (which rebuilds
each child's stats by connector name in the API-server process) keeps the server alive."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcanary.app.vllm.engine import VllmSettings
from kvcanary.app.vllm.model import ensure_tiny_llama
from kvcanary.app.vllm.server import VllmServer, drive, kvcanary_series, scrape
from kvcanary.app.vllm.workload import VllmWorkload

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_log_mode_beside_a_users_connector_serves_and_counts(tmp_path: Path) -> None:
    storage = tmp_path / "kv"
    storage.mkdir()
    user = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)}}  # fmt: skip
    log = tmp_path / "server-multi.log"
    srv = VllmServer(VllmSettings(model=ensure_tiny_llama(), dtype="auto", kv_blocks=48),
                     env={"KVCANARY_MODE": "log"}, transfer_config=user,
                     log_path=log)  # fmt: skip
    try:
        srv.start()
        requests = VllmWorkload(num_requests=24, seed=3, max_tokens=16).requests()
        first = drive(srv, requests[:12], concurrency=12)
        second = drive(srv, requests[12:], concurrency=12)  # after a stats-logging interval
        after = kvcanary_series(scrape(srv))
        assert srv.alive()
    finally:
        srv.close()
    results = first + second
    assert [r.status for r in results] == [200] * len(requests), [r.error for r in results][:3]
    text = log.read_text(errors="replace")
    assert "MultiConnector" in text and "kv-canary: installed on vLLM" in text
    assert "is not registered" not in text
    assert after["kvcanary_violations_total"] == 0
    assert after["kvcanary_forwards_total"] > 0 and after["kvcanary_checks_total"] > 0
    assert any(storage.iterdir())  # the user's connector did its own work beside the canary
