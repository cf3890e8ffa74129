"""--events JSON lines and Prometheus counters."""

from __future__ import annotations

import json
from pathlib import Path

from kvcanary.app.observability import EventLog, RunMetrics, StepObserver
from kvcanary.contract import Violation


def violation(tag: int, bits: int, slot: int) -> Violation:
    return Violation(kernel_kind=tag, slot_idx=slot, position=3, stored_token=1, expected_token=-1,
                     stored_chain_hash=0, expected_aux=0, fail_reason_bits=bits, step_when_pumped=7,
                     message="m")  # fmt: skip


def test_events_and_metrics(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    metrics = RunMetrics()
    observer = StepObserver(EventLog(path), metrics)
    observer.on_step(step=0, stats={"retractions": 0}, protected=10, sweeps=1, violations=[])
    observer.on_step(step=1, stats={"retractions": 2}, protected=25, sweeps=1,
                     violations=[violation(2, 4, 9), violation(0, 3, 5)])  # fmt: skip
    observer.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["event"] for e in lines] == ["step", "violation", "violation", "step"]
    assert (
        lines[1]["launch_tag"] == "TAIL_K_FULL"
        and lines[1]["reasons"] == ["verify_real_kv_hash"]
        and lines[1]["slot_idx"] == 9
    )
    assert lines[2]["reasons"] == ["verify_chain_hash", "verify_position"]
    assert lines[3] == {
        "event": "step",
        "step": 1,
        "protected_slot_checks": 25,
        "sweep_passes": 1,
        "violations": 2,
        "retractions": 2,
    }
    sample = metrics.registry.get_sample_value
    assert sample("kvcanary_steps_total") == 2
    assert sample("kvcanary_protected_slot_checks_total") == 25
    assert sample("kvcanary_sweep_passes_total") == 1
    assert (
        sample(
            "kvcanary_violations_total", {"reason": "verify_position", "launch_tag": "HEAD_K_FULL"}
        )
        == 1
    )
    assert (
        sample(
            "kvcanary_violations_total",
            {"reason": "verify_real_kv_hash", "launch_tag": "TAIL_K_FULL"},
        )
        == 1
    )
