"""Fixtures for canary tests: a HandPool and a canary factory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from kvcanary.canary import (
    Canary,
    CanaryConfig,
    CanaryLaunchCapacities,
    CanaryMode,
    RealDataMode,
    install,
)
from kvcanary.contract import ForwardView
from tests.canary.handpool import HandPool

MakeCanary = Callable[..., tuple[HandPool, Canary]]


def capacities(pool: HandPool, **overrides: Any) -> CanaryLaunchCapacities:
    args: dict[str, Any] = dict(
        req_to_token_pool_size=pool.num_rows, max_seq_len_per_req=pool.max_len,
        pool_slot_count=pool.num_slots, cuda_graph_max_bs=None, speculative_num_draft_tokens=None,
        max_prefill_tokens=max(64, pool.num_slots), chunked_prefill_size=None,
    )  # fmt: skip
    args.update(overrides)
    return CanaryLaunchCapacities.from_args(**args)


@pytest.fixture(params=["fast", "reference"])
def make_canary(request: pytest.FixtureRequest) -> MakeCanary:
    """Build (pool, canary) with both kernel implementations."""

    def build(*, pool: HandPool | None = None, read_bytes: int | None = 16, caps: dict[str, Any] | None = None,
              oracle: Any = None, **config: Any) -> tuple[HandPool, Canary]:  # fmt: skip
        pool = pool or HandPool()
        base = CanaryConfig(
            mode=CanaryMode.LOG, real_data=RealDataMode.PARTIAL, stats_print_every_n_steps=0
        )
        cfg = replace(base, **config)
        canary = install(
            cfg,
            [pool.group(read_bytes)],
            capacities(pool, **(caps or {})),
            oracle,
            kernels=request.param,
        )
        assert canary is not None
        return pool, canary

    return build


def forward(pool: HandPool, canary: Canary, view: ForwardView, *, end_step: bool = True) -> None:
    """One forward as an engine runs it: HEAD, model writes KV, TAIL, end of step."""
    canary.pre_forward(view=view)
    pool.write_kv(view)
    canary.post_forward(view=view)
    if end_step:
        canary.end_step()
