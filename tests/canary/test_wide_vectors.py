"""`wide_vectors`: a marked loop asks LLVM for 512-bit vectors where that is wanted, and only
there (a machine-code property; the byte-equality tests cover the kernels' results)."""

from __future__ import annotations

import re
from typing import Any

import llvmlite.binding as llvm
import numba
import numpy as np
import pytest

from kvcanary.canary.kernels import _intrinsics
from kvcanary.canary.kernels._intrinsics import wide_vectors

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _plain(rows):  # type: ignore[no-untyped-def]
    acc = np.uint64(0)
    for k in range(rows.shape[0]):
        acc ^= rows[k] * _GOLDEN
    return acc


def _marked(rows):  # type: ignore[no-untyped-def]
    wide_vectors()
    acc = np.uint64(0)
    for k in range(rows.shape[0]):
        acc ^= rows[k] * _GOLDEN
    return acc


def _zmm_multiplies(fn: Any) -> int:
    return len(re.findall(r"vpmullq\s+%zmm", "".join(fn.inspect_asm().values())))


def test_marked_loop_asks_for_512_bit_vectors_where_wanted() -> None:
    rows = np.arange(4096, dtype=np.uint64)
    plain, marked = numba.njit(_plain), numba.njit(_marked)  # fresh, uncached compiles
    with np.errstate(over="ignore"):  # the interpreted loop warns where uint64 wraps
        expected = _plain(rows)
    assert plain(rows) == marked(rows) == expected
    wanted = _intrinsics.wide_vectors_wanted()
    ir = "".join(marked.inspect_llvm().values())
    assert ('"prefer-vector-width"="512"' in ir) == wanted
    assert '"prefer-vector-width"' not in "".join(plain.inspect_llvm().values())
    if not llvm.get_host_cpu_features().get("avx512dq", False):
        assert _zmm_multiplies(marked) == 0  # never wider than the CPU has
    elif wanted:
        assert _zmm_multiplies(marked) > 0


@pytest.mark.parametrize("cpu", ["skylake-avx512", "cascadelake", "cooperlake"])
def test_throttling_cpus_keep_256_bit(cpu: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_intrinsics.numba_config, "CPU_NAME", cpu)
    assert not _intrinsics.wide_vectors_wanted()


@pytest.mark.parametrize("cpu", ["sapphirerapids", "emeraldrapids", "znver4", "icelake-server"])
def test_other_cpus_ask_for_512_bit(cpu: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_intrinsics.numba_config, "CPU_NAME", cpu)
    assert _intrinsics.wide_vectors_wanted()
