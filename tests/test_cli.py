"""CLI: bad input is one line on stderr with exit status 2 (no traceback); check-config and a
small clean `kvcanary run` end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BAD = [
    (["check-config", "--speculative-num-draft-tokens", "-1"], {}, "kv-canary: speculative_num_draft_tokens must be non-negative, got -1"),
    (["run", "--speculative-num-draft-tokens", "-1"], {}, "kv-canary: speculative_num_draft_tokens must be non-negative, got -1"),
    (["check-config", "--kv-canary", "maybe"], {}, "kv-canary: kv_canary must be one of none/log/raise/recover, got 'maybe'"),
    (["check-config", "--kv-canary-real-data", "some"], {}, "kv-canary: kv_canary_real_data must be one of none/partial/all, got 'some'"),
    (["check-config", "--kv-canary", "log", "--kv-canary-sweep-interval", "-2"], {}, "kv-canary: kv_canary_sweep_interval must be non-negative, got -2"),
    (["check-config", "--kv-canary-sweep-interval", "3"], {}, "kv-canary: kv_canary_sweep_interval=3 requires kv_canary mode log, raise or recover"),
    (["check-config", "--req-to-token-pool-size", "0"], {}, "kv-canary: req_to_token_pool_size must be positive, got 0"),
    (["check-config", "--max-seq-len-per-req", "0"], {}, "kv-canary: max_seq_len_per_req must be positive, got 0"),
    (["check-config", "--pool-slot-count", "-5"], {}, "kv-canary: pool_slot_count must be positive, got -5"),
    (["check-config", "--cuda-graph-max-bs", "-1"], {}, "kv-canary: cuda_graph_max_bs must be non-negative, got -1"),
    (["check-config", "--max-prefill-tokens", "0"], {}, "kv-canary: max_prefill_tokens must be positive, got 0"),
    (["check-config"], {"KVCANARY_RING_CAPACITY": "0"}, "kv-canary: ViolationLog ring_capacity must be positive, got 0"),
    (["check-config"], {"KVCANARY_ENABLE_V": "maybe"}, "kv-canary: KVCANARY_ENABLE_V must be a boolean (1/0/true/false/yes/no/on/off), got 'maybe'"),
    (["check-config"], {"KVCANARY_PERTURB_SEED": "x"}, "kv-canary: KVCANARY_PERTURB_SEED must be an integer, got 'x'"),
    (["check-config"], {"KVCANARY_PERTURB_WARMUP_STEPS": "-1"}, "kv-canary: KVCANARY_PERTURB_WARMUP_STEPS must be non-negative, got -1"),
    (["check-config"], {"KVCANARY_PERTURB_LATE_WRITE_PROB": "2"}, "kv-canary: KVCANARY_PERTURB_LATE_WRITE_PROB must be a probability in [0, 1], got '2'"),
    (["check-config"], {"KVCANARY_PERTURB_LATE_WRITE_PROB": "1"}, "kv-canary: KVCANARY_PERTURB_TARGET_GROUP must be explicitly set to 'full' or 'swa'"),
    (["check-config"], {"KVCANARY_PERTURB_LATE_WRITE_PROB": "1", "KVCANARY_PERTURB_TARGET_GROUP": "any"}, "kv-canary: KVCANARY_PERTURB_TARGET_GROUP must be one of 'full' / 'swa', got 'any'"),
    (["check-config"], {"KVCANARY_PERTURB_REAL_KV_USED_PROB": "1", "KVCANARY_PERTURB_TARGET_GROUP": "full"}, "kv-canary: real-KV perturb modes require --kv-canary-real-data partial or all"),
    (["check-config"], {"KVCANARY_PERTURB_NEXT_TOKEN_SWAP_PROB": "1"}, "kv-canary: KVCANARY_PERTURB_NEXT_TOKEN_SWAP_PROB > 0 requires KVCANARY_ENABLE_WRITE_INPUT_ASSERT=1"),
]  # fmt: skip


def kvcanary(
    args: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVCANARY_")} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "kvcanary.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=600,
    )


@pytest.mark.parametrize(("args", "env", "message"), BAD)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], env: dict[str, str], message: str
) -> None:
    result = kvcanary(args, env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == message
    assert "Traceback" not in result.stderr + result.stdout


def test_check_config_prints_capacities() -> None:
    result = kvcanary(
        [
            "check-config",
            "--kv-canary",
            "log",
            "--cuda-graph-max-bs",
            "160",
            "--speculative-num-draft-tokens",
            "4",
            "--chunked-prefill-size",
            "8192",
        ]
    )
    assert result.returncode == 0, result.stderr
    assert (
        "write_req_capacity=160" in result.stdout and "write_entry_capacity=8192" in result.stdout
    )


@pytest.mark.slow
def test_small_clean_run_writes_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    result = kvcanary(
        [
            "run",
            "--quiet",
            "--model",
            "oracle",
            "--requests",
            "12",
            "--num-slots",
            "256",
            "--json",
            str(out),
        ]
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(out.read_text())
    assert summary["violations"] == 0 and summary["violations_by_reason"] == {}
    assert summary["requests_finished"] + summary["requests_aborted"] == 12
    assert summary["protected_slot_checks"] > 0 and summary["sweep_passes"] > 0
    for key in ("tokens_generated", "forward_steps", "retractions", "evictions", "radix_hit_tokens",
                "spec_accepted_tokens", "wall_seconds", "canary_seconds"):  # fmt: skip
        assert key in summary


FAULT_ENV = {
    "KVCANARY_PERTURB_REAL_KV_USED_PROB": "1",
    "KVCANARY_PERTURB_TARGET_GROUP": "full",
    "KVCANARY_PERTURB_WARMUP_STEPS": "3",
}
SMALL_RUN = ["run", "--quiet", "--model", "oracle", "--requests", "6", "--num-slots", "256"]


@pytest.mark.slow
def test_violations_in_log_mode_exit_1(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    result = kvcanary([*SMALL_RUN, "--json", str(out)], FAULT_ENV)
    assert result.returncode == 1, result.stderr
    summary = json.loads(out.read_text())
    assert summary["violations"] > 0 and summary["violations_by_reason"].keys() == {
        "verify_real_kv_hash"
    }
    assert summary["requests_finished"] + summary["requests_aborted"] == 6  # log mode keeps serving
    assert "replay with --seed 0" in result.stderr


@pytest.mark.slow
def test_raise_mode_stops_with_exit_3(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    result = kvcanary([*SMALL_RUN, "--kv-canary", "raise", "--json", str(out)], FAULT_ENV)
    assert result.returncode == 3, result.stderr
    summary = json.loads(out.read_text())
    assert summary["violations"] > 0
    assert summary["requests_finished"] + summary["requests_aborted"] < 6  # stopped early
