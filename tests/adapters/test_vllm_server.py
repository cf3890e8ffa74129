"""The real OpenAI server (vLLM's default multiprocess executor) with `KVCanaryConnector`, driven
over HTTP on 127.0.0.1: >= 60 concurrent completion requests with shared prefixes give 0
violations in bf16 and in fp32, the canary checked and swept, and the `kvcanary_*` series are
on vLLM's `/metrics` (at 0 before the first request)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcanary.app.vllm.engine import VllmSettings
from kvcanary.app.vllm.model import ensure_tiny_llama
from kvcanary.app.vllm.server import VllmServer, drive, kvcanary_series, scrape
from kvcanary.app.vllm.workload import VllmWorkload

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SERIES = ("kvcanary_forwards_total", "kvcanary_checks_total", "kvcanary_sweeps_total",
          "kvcanary_violations_total")  # fmt: skip


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[VllmServer]:  # fmt: skip
    log = tmp_path_factory.mktemp("vllm") / f"server-{request.param}.log"
    srv = VllmServer(VllmSettings(model=ensure_tiny_llama(), dtype=request.param, kv_blocks=24),
                     log_path=log)  # fmt: skip
    try:
        srv.start()
        yield srv
    finally:
        srv.close()


def test_concurrent_requests_over_http_are_clean_and_counted(server: VllmServer) -> None:
    before = kvcanary_series(scrape(server))
    assert all(before.get(name) == 0 for name in SERIES), before  # exported as 0 from the start
    assert before["kvcanary_violations_total:verify_real_kv_hash"] == 0
    requests = VllmWorkload(num_requests=64, seed=1, max_tokens=24).requests()
    results = drive(server, requests, concurrency=64)
    assert [r.status for r in results] == [200] * 64, [r.error for r in results][:3]
    assert sum(r.tokens for r in results) == sum(r.max_tokens for r in requests)
    after = kvcanary_series(scrape(server))
    assert after["kvcanary_violations_total"] == 0
    assert after["kvcanary_forwards_total"] > 0
    assert after["kvcanary_checks_total"] > 10_000
    assert after["kvcanary_sweeps_total"] > 0
    log = Path(server.log_path or "").read_text(errors="replace")
    assert "kv-canary: installed on vLLM" in log and "sweep_interval=4" in log
    assert "verify_token=True" in log and "real_data=partial" in log
    assert "kv-canary: step" not in log  # no violation line
    # the line per sweep stays quiet in vLLM (one every 4 steps; counted on /metrics instead)
    assert "[canary] sweep pass=" not in log


def test_raise_mode_stops_the_server_with_the_violation_in_its_log(tmp_path: Path) -> None:
    env = {"KVCANARY_PERTURB_REAL_KV_USED_PROB": "1", "KVCANARY_PERTURB_TARGET_GROUP": "full",
           "KVCANARY_PERTURB_WARMUP_STEPS": "10"}  # fmt: skip
    log = tmp_path / "server-raise.log"
    srv = VllmServer(VllmSettings(model=ensure_tiny_llama(), dtype="bfloat16", kv_blocks=24),
                     extra_config={"mode": "raise"}, env=env, log_path=log)  # fmt: skip
    try:
        srv.start()
        requests = VllmWorkload(num_requests=16, seed=0, max_tokens=24).requests()
        results = drive(srv, requests, concurrency=16, timeout=120)
        srv.process.wait(timeout=60)  # type: ignore[union-attr]  # the server stops
        assert not srv.alive()
    finally:
        srv.close()
    text = log.read_text(errors="replace")
    first = text.index("kv-canary: raise mode stops vLLM: kv_canary violation: launch_tag=")
    assert "fail_reason=verify_real_kv_hash" in text[first : first + 300]
    failed = [r for r in results if r.status != 200]
    # every in-flight client learns which violation stopped vLLM, not only "EngineCore ..."
    named = "kv-canary: raise mode stopped vLLM: kv_canary violation: launch_tag="
    assert failed and all(r.status == 500 and named in r.error for r in failed), failed[0].error
    assert "fail_reason=verify_real_kv_hash" in failed[0].error
    # a request that did answer finished before the failing step: all its tokens, no partial one
    for req, r in zip(requests, results, strict=True):
        assert r.status != 200 or r.tokens == req.max_tokens
