"""`precompile()`: the signatures it compiles are the ones the runtime calls, its child processes
fill the cache a later process loads from, and a failing child costs only time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcanary.canary.kernels import fast, precompile

_KERNELS = (
    "build_plan", "build_plan_packed", "verify", "write", "verify_serial", "write_serial",
    "stage_serial", "forward_head", "forward_tail", "sweep_serial", "sweep_runs_serial",
)  # fmt: skip


def _env(cache_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCANARY_", "NUMBA_CACHE"))}
    env["XDG_CACHE_HOME"] = str(cache_home)
    return env


_RUN_THEN_SIGNATURES = """
import contextlib, json, runpy, sys
from kvcanary.canary.kernels import fast
names, sys.argv = sys.argv[1:], ["kvcanary", "run", "--requests", "6", "--quiet"]
with contextlib.suppress(SystemExit):
    runpy.run_module("kvcanary.cli", run_name="__main__")
print(json.dumps({n: [str(s) for s in getattr(fast, n).signatures] for n in names}))
"""


def test_the_runtime_calls_exactly_the_precompiled_signatures() -> None:
    # In a fresh process (other tests here call the kernels with other array types): the
    # default `kvcanary run` (real-KV partial: launches with and without sources, sweeps).
    out = subprocess.run(
        [sys.executable, "-c", _RUN_THEN_SIGNATURES, *_KERNELS],
        capture_output=True, text=True, timeout=1200, check=True,
    )  # fmt: skip
    called = json.loads(out.stdout.strip().splitlines()[-1])
    expected = {n: [str(s)] for n, s in precompile.signatures().items()}
    assert set(expected) == set(_KERNELS)
    # A small run launches only the serial twins (every stage is below SERIAL_LAUNCH_ENTRIES):
    # each forward through the fused path (`forward_head`, `forward_tail`, which call
    # `build_plan` and `stage_serial` with the runtime's own signatures), sweeps through
    # `sweep_serial` (which calls `verify_serial`; `sweep_runs_serial` takes a walker's runs,
    # which the reference engine's walker does not offer); the runtime hands a parallel kernel the very
    # arguments it hands its twin.
    for n in _KERNELS:
        assert called[n] in ([], expected[n]), n
    assert all(called[n] for n in ("forward_head", "forward_tail", "sweep_serial")), called


_STATS = """
import json
from kvcanary.canary.kernels import fast, precompile
precompile.precompile(cores=1)
print(json.dumps({n: [sum(getattr(fast, n).stats.cache_hits.values()),
                      sum(getattr(fast, n).stats.cache_misses.values())]
                  for n in ("build_plan", "build_plan_packed", "verify", "write",
                            "verify_serial", "write_serial", "stage_serial", "forward_head",
                            "forward_tail", "sweep_serial", "sweep_runs_serial")}))
"""

_PRECOMPILE_TWO_CORES = "from kvcanary.canary.kernels import precompile; precompile.precompile(2)"


@pytest.mark.slow
def test_two_process_precompile_fills_the_cache_for_the_next_process(tmp_path: Path) -> None:
    env = _env(tmp_path)
    subprocess.run([sys.executable, "-c", _PRECOMPILE_TWO_CORES], env=env, check=True,
                   timeout=1200)  # fmt: skip
    # every per-digest folder holds the three kernels' indexes: the child wrote where we read
    indexes = {p.name.split(".")[1].split("-")[0] for p in tmp_path.rglob("*.nbi")}
    assert set(_KERNELS) <= indexes
    out = subprocess.run([sys.executable, "-c", _STATS], env=env, capture_output=True,
                         text=True, check=True, timeout=1200)  # fmt: skip
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats == {n: [1, 0] for n in _KERNELS}  # loaded, nothing compiled again


def test_a_failing_child_is_compiled_here_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[str, ...]] = []

    def failing_child(group: tuple[str, ...]) -> subprocess.Popen[bytes]:
        started.append(tuple(group))
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])

    monkeypatch.setattr(precompile, "_start_child", failing_child)
    precompile.precompile(cores=2)
    assert started == list(precompile.GROUPS[1:])
    for name, signature in precompile.signatures().items():
        assert signature in getattr(fast, name).overloads


def test_one_core_compiles_every_group_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_child(group: tuple[str, ...]) -> None:
        raise AssertionError(f"no child process on one core, got one for {group}")

    monkeypatch.setattr(precompile, "_start_child", no_child)
    precompile.precompile(cores=1)
    for name, signature in precompile.signatures().items():
        assert signature in getattr(fast, name).overloads


def test_groups_cover_every_kernel_once() -> None:
    names = [n for group in precompile.GROUPS for n in group]
    assert sorted(names) == sorted(_KERNELS) == sorted(precompile.signatures())


def test_an_unknown_kernel_name_is_refused() -> None:
    with pytest.raises(ValueError, match="kernel must be one of"):
        precompile.compile_group(["verfy"])
