"""`install(parallel_launches=...)`: a stage of `SERIAL_LAUNCH_ENTRIES` or more entries runs on
numba's thread pool, unless the engine turns that off (vLLM: its OpenMP threads hold the other
cores); either way the records are the same."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvcanary.canary import CanaryConfig, CanaryMode, RealDataMode, install
from kvcanary.canary.kernels import fast
from kvcanary.canary.runtime import SERIAL_LAUNCH_ENTRIES
from tests.canary.conftest import capacities, forward
from tests.canary.handpool import HandPool


def _counting(calls: list[str], name: str, kernel: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        calls.append(name)
        return kernel(*args)

    return call


@pytest.mark.parametrize("parallel", [True, False])
def test_large_stages_use_the_pool_only_when_allowed(
    monkeypatch: pytest.MonkeyPatch, parallel: bool
) -> None:
    calls: list[str] = []
    for name in ("verify", "write", "verify_serial", "write_serial", "stage_serial"):
        monkeypatch.setattr(fast, name, _counting(calls, name, getattr(fast, name)))
    n = SERIAL_LAUNCH_ENTRIES + 100  # one prefill chunk: a stage of n write entries
    pool = HandPool(num_slots=2 * n + 8, num_rows=2, max_len=2 * n)
    config = CanaryConfig(
        mode=CanaryMode.LOG, real_data=RealDataMode.PARTIAL, stats_print_every_n_steps=0
    )
    canary = install(config, [pool.group()], capacities(pool), parallel_launches=parallel)
    assert canary is not None
    forward(pool, canary, pool.view([(1, [7] * n)]))  # writes n records
    forward(pool, canary, pool.view([(1, [8])]))  # verifies them: n entries
    assert canary.total_violations == 0
    pooled = {"verify", "write"} & set(calls)
    assert pooled == ({"verify", "write"} if parallel else set()), calls
    if not parallel:
        assert calls.count("stage_serial") == 4  # HEAD and TAIL of both forwards, one call each
