"""Compile the fast kernels for the runtime's signatures before a first run, on every core.

A cold first run spends nearly all of its extra time in numba's compiler, which holds the GIL: a
single process compiles `build_plan`, `verify` and `write` (and the serial twins of the last two)
one after the other. They are independent (they share only small intrinsics), so `precompile()` splits them into groups of
about equal compile time and compiles one group in this process while the others compile in child
processes (`python -m kvcanary.canary.kernels.precompile GROUP`). Each process writes numba's
cache (files per function, replaced atomically by numba); this process then loads what the
children compiled from that cache. On a 2-core machine the cold start roughly halves.

`dispatcher.compile(signature)` needs no input data: the signatures below are the ones the
canary runtime passes (C-contiguous int64/uint64/int32 arrays, bools, int64 scalars). A caller
that passes other types still works: numba compiles that signature on its first call, as before
(tests/canary/test_precompile.py checks that a run after `precompile()` compiles nothing).

A child that fails or cannot start costs only time: its group is then compiled here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from numba import types

import kvcanary
from kvcanary.canary.kernels import compile_cache
from kvcanary.canary.kernels.fast_forward import (
    forward_head,
    forward_tail,
    sweep_runs_serial,
    sweep_serial,
)
from kvcanary.canary.kernels.fast_plan import build_plan, build_plan_packed
from kvcanary.canary.kernels.fast_stage import stage_serial
from kvcanary.canary.kernels.fast_verify import verify, verify_serial
from kvcanary.canary.kernels.fast_write import write, write_serial

__all__ = ["GROUPS", "compile_group", "precompile", "signatures"]

_I64 = types.Array(types.int64, 1, "C")
_U64_2D = types.Array(types.uint64, 2, "C")
_I64_2D = types.Array(types.int64, 2, "C")
_I32_2D = types.Array(types.int32, 2, "C")
_B, _N = types.boolean, types.int64
# real-KV sources (four word views), their params table and count (SPEC §4)
_SOURCES = (_U64_2D, _U64_2D, _U64_2D, _U64_2D, _I64_2D, _N)
_RING = (_N, _U64_2D, _I64)  # launch tag, ring rows (u64 view), ring state

# the view's arrays and table, the group, truth, capacities, marks, the verify stride and phase
_PLAN = (_I64, _I64, _I64, _I32_2D, _I64, _I64, _B, _N, _N, _I64_2D, _I64, _N, _N, _I64, _N, _N)

#: kernel -> its argument types as `Canary` passes them (see runtime.py `_launch_stage`, `_plan`)
_SIGNATURES: dict[str, tuple[types.Type, ...]] = {
    "build_plan": _PLAN,
    "verify": (_U64_2D, _I64, _I64, _I64, _I64, *_SOURCES, *_RING),
    "write": (_U64_2D, _I64, _I64, _I64, _B, _I64, _I64, _B, _I64, _I64, _B, *_SOURCES, *_RING),
}
_SIGNATURES["verify_serial"] = _SIGNATURES["verify"]
_SIGNATURES["write_serial"] = _SIGNATURES["write"]
# verify's entry arrays and a verify flag, then write's arguments (sources and ring once)
_SIGNATURES["build_plan_packed"] = _SIGNATURES["build_plan"]
_SIGNATURES["stage_serial"] = (*_SIGNATURES["verify"][:5], _B, *_SIGNATURES["write"][1:])

# the fused path (`canary.fused`): the packed buffer, the view's six arrays, the reference
# engine's int32 table, no truth table (int64, empty), then capacities, the group and one launch
# (`forward_head`); the packed plan's sizes and flags, then one launch (`forward_tail`). vLLM's
# int64 table and int32 token table compile on its first forward (numba's disk cache keeps them).
_LAUNCH = (_U64_2D, *_SOURCES, *_RING)
_SIGNATURES["forward_head"] = (
    *(_I64,) * 7, _I32_2D, _I64_2D, _I64, _B, _N, _N, _I64, _B, _N, _N, _N, _N, _I64, _N, _B,
    _N, _N, *_LAUNCH,
)  # fmt: skip
_SIGNATURES["forward_tail"] = (_I64, _N, _N, _N, _N, _B, _B, _B, *_LAUNCH)
_SIGNATURES["sweep_serial"] = (_I64_2D, _N, *_LAUNCH)  # a walk, the group's slots, one launch
_SIGNATURES["sweep_runs_serial"] = (_I64_2D, _N, _N, *_LAUNCH)  # runs, slots, serial limit, launch

_KERNELS: dict[str, Callable[..., object]] = {
    "build_plan": build_plan,
    "build_plan_packed": build_plan_packed,
    "verify": verify,
    "write": write,
    "verify_serial": verify_serial,
    "write_serial": write_serial,
    "stage_serial": stage_serial,
    "forward_head": forward_head,
    "forward_tail": forward_tail,
    "sweep_serial": sweep_serial,
    "sweep_runs_serial": sweep_runs_serial,
}

#: compile groups of about equal cost (seconds on a 2-core machine, each in a fresh process: write
#: ~7.5 plus its serial twin ~2.5, which reuses write's helpers; verify ~5.3, build_plan ~2.9,
#: verify's serial twin ~1). The first group compiles in the calling process, which has its
#: imports done; a child first spends ~2 s importing numba and the package.
GROUPS: tuple[tuple[str, ...], ...] = (
    ("write", "write_serial", "stage_serial", "forward_tail", "forward_head"),
    (
        "verify",
        "verify_serial",
        "build_plan",
        "build_plan_packed",
        "sweep_serial",
        "sweep_runs_serial",
    ),
)


def signatures() -> dict[str, tuple[types.Type, ...]]:
    """The signature each kernel is precompiled for (a copy)."""
    return dict(_SIGNATURES)


def compile_group(names: Sequence[str]) -> None:
    """Compile (or load from numba's cache) each named kernel for its runtime signature."""
    for name in names:
        if name not in _KERNELS:
            raise ValueError(f"kernel must be one of {sorted(_KERNELS)}, got {name!r}")
        _KERNELS[name].compile(_SIGNATURES[name])  # type: ignore[attr-defined]


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _start_child(group: Sequence[str]) -> subprocess.Popen[bytes] | None:
    env = dict(os.environ)
    folder = compile_cache.cache_dir()
    if folder is not None:  # the child must write where this process will read
        env["NUMBA_CACHE_DIR"] = str(folder)
    # The child must compile this very package (numba keys its cache by source file), not
    # whichever `kvcanary` its own sys.path would find first.
    package_root = str(Path(kvcanary.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "kvcanary.canary.kernels.precompile", *group]
    try:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        return None


def precompile(cores: int | None = None) -> None:
    """Compile every kernel for the runtime's signatures, the groups in parallel on up to
    `cores` processes (default: the cores this process may run on)."""
    cores = _usable_cores() if cores is None else cores
    local, *others = GROUPS if cores > 1 else (tuple(n for g in GROUPS for n in g),)
    children = [(group, _start_child(group)) for group in others]
    try:
        compile_group(local)
        for group, child in children:
            if child is not None:
                child.wait()
            # Loads the child's machine code from the cache; compiles it here if the child
            # failed (its error costs only time, so it is not reported).
            compile_group(group)
    finally:
        for _, child in children:
            if child is not None and child.poll() is None:
                child.kill()
                child.wait()


def _main(argv: Sequence[str]) -> int:
    compile_group(argv)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
