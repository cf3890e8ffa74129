"""vLLM's host offload tier on the CPU platform (`kvcanary.adapters.vllm.offload`), as a user
runs it: one OpenAI server with the user's `OffloadingConnector` (the canary's CPU spec, loaded
by `spec_name` + `spec_module_path`) and the canary composed by the `KVCANARY_MODE` shortcut.
A few device blocks, so each prompt's blocks are evicted by the next prompts and a repeat of it
loads them back from the host tier. Clean: every restore carries its stamps and verifies, 0
violations, the repeat's greedy output identical to the first. Faults (`app.vllm.offload_faults`):
another page's bytes, a flipped bit, a lost store, each caught at its restore, 1:1."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from kvcanary.app.vllm.engine import VllmSettings
from kvcanary.app.vllm.model import ensure_tiny_llama
from kvcanary.app.vllm.server import VllmServer, drive, kvcanary_series, scrape
from kvcanary.app.vllm.workload import VllmRequest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LOADED = re.compile(r"kv-canary: offload load of (\d+) blocks \(stamps (\d+)\): (\d+) violations")
JOURNAL = re.compile(r"kvcanary-offload-fault: load=(\d+) fault=(\w+) blocks=(\d+)")


def _server(tmp_path: Path, spec: str, module: str, **extra: object) -> VllmServer:
    user = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": spec, "spec_module_path": module,
                                          "cpu_bytes_to_use": 64 << 20, **extra}}  # fmt: skip
    settings = VllmSettings(model=ensure_tiny_llama(), dtype="auto", kv_blocks=20,
                            max_num_batched_tokens=256)  # fmt: skip
    return VllmServer(settings, env={"KVCANARY_MODE": "log"}, transfer_config=user,
                      log_path=tmp_path / "server.log")  # fmt: skip


def _rounds(server: VllmServer, rounds: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """Per round: a prompt, three others (evicting its blocks), the prompt again: the first and
    the repeated greedy outputs."""
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        prompt, *others = (tuple(rng.randrange(1, 500) for _ in range(200)) for _ in range(4))
        [first] = drive(server, [VllmRequest(prompt, 8)])
        drive(server, [VllmRequest(p, 1) for p in others], concurrency=1)
        [again] = drive(server, [VllmRequest(prompt, 8)])
        assert first.status == again.status == 200, (first.error, again.error)
        out.append((first.output_ids, again.output_ids))
    return out


def test_offload_round_trip_is_clean_and_carries_the_stamps(tmp_path: Path) -> None:
    server = _server(tmp_path, "CanaryCPUOffloadingSpec", "kvcanary.adapters.vllm.offload")
    try:
        server.start()
        outputs = _rounds(server, rounds=3, seed=1)
        violations = kvcanary_series(scrape(server))["kvcanary_violations_total"]
    finally:
        server.close()
    log = server.log_path.read_text(errors="replace")  # type: ignore[union-attr]
    loads = LOADED.findall(log)
    assert len(loads) >= 3, log[-3000:]  # every repeat restored from the host tier
    assert all(n == stamps and v == "0" for n, stamps, v in loads), loads
    assert all(first == again and len(first) == 8 for first, again in outputs), outputs
    assert violations == 0


def test_offload_faults_are_caught_at_their_restore_one_to_one(tmp_path: Path) -> None:
    from kvcanary.app.vllm.offload_faults import OFFLOAD_FAULTS

    server = _server(tmp_path, "OffloadFaultSpec", "kvcanary.app.vllm.offload_faults",
                     fault_schedule=list(OFFLOAD_FAULTS))  # fmt: skip
    try:
        server.start()
        _rounds(server, rounds=len(OFFLOAD_FAULTS), seed=2)
        assert server.alive()  # log mode keeps serving
    finally:
        server.close()
    log = server.log_path.read_text(errors="replace")  # type: ignore[union-attr]
    journal, loads = JOURNAL.findall(log), LOADED.findall(log)
    assert len(journal) == len(loads) >= len(OFFLOAD_FAULTS), (journal, loads)
    assert {f for _, f, _ in journal} == set(OFFLOAD_FAULTS)
    for (_, fault, _), (_, _, violations) in zip(journal, loads, strict=True):
        assert (int(violations) > 0) == (fault != "none"), (fault, violations)
