"""The first `kvcanary run` on a machine: one compile line with an estimate, compilation kept
out of the canary time, the cache in the user's cache folder; later runs say nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcanary.canary.kernels import compile_cache


def test_compile_estimate_is_the_last_measured_compile(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    assert compile_cache.estimate_seconds(env) == compile_cache.COLD_START_SECONDS
    compile_cache.default_cache_dir(env).mkdir(parents=True)
    compile_cache.record_seconds(37.4, env)
    assert compile_cache.estimate_seconds(env) == 37
    # it lives beside the per-digest folders, so a kernel edit (new folder) still finds it
    assert (compile_cache.default_cache_dir(env).parent / "last-compile-seconds").is_file()
    (compile_cache.default_cache_dir(env).parent / "last-compile-seconds").write_text("junk")
    assert compile_cache.estimate_seconds(env) == compile_cache.COLD_START_SECONDS


def test_recording_into_an_unwritable_cache_is_silent(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path / "missing" / "deeper")}
    compile_cache.record_seconds(5.0, env)  # no folder: nothing written, nothing raised
    assert compile_cache.estimate_seconds(env) == compile_cache.COLD_START_SECONDS


def _run(cache_home: Path, out: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCANARY_", "NUMBA_CACHE"))}
    env["XDG_CACHE_HOME"] = str(cache_home)
    return subprocess.run(
        [sys.executable, "-m", "kvcanary.cli", "run", "--requests", "2", "--quiet", "--json",
         str(out)], capture_output=True, text=True, env=env, timeout=1200,
    )  # fmt: skip


@pytest.mark.slow
def test_cold_run_compiles_once_outside_canary_time(tmp_path: Path) -> None:
    cache_home = tmp_path / "cache"
    cold = _run(cache_home, tmp_path / "cold.json")
    assert cold.returncode == 0, cold.stderr
    lines = [ln for ln in cold.stderr.splitlines() if "compiling" in ln]
    assert len(lines) == 1 and lines[0].startswith("kvcanary: compiling kernels, first run only, ~")
    figures = json.loads((tmp_path / "cold.json").read_text())
    assert figures["kernel_compile_seconds"] > figures["canary_seconds"]
    assert figures["canary_seconds"] < figures["wall_seconds"]
    assert any((cache_home / "kvcanary" / "numba").rglob("*.nbi"))  # the user's cache folder
    measured = float((cache_home / "kvcanary" / "numba" / "last-compile-seconds").read_text())
    assert measured == pytest.approx(figures["kernel_compile_seconds"], abs=0.1)
    warm = _run(cache_home, tmp_path / "warm.json")
    assert warm.returncode == 0, warm.stderr
    assert "compiling" not in warm.stderr
    assert "kernel_compile_seconds" not in json.loads((tmp_path / "warm.json").read_text())
