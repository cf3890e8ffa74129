"""A long-running vLLM server never goes silent: after the canary's fill-once ring is full, the
worker still counts every violation by tag and reason (what /metrics exports) and logs at most
one line per step, naming the vLLM request whose block table holds the reported slots. No vLLM
engine: the worker's collection runs over a real canary and a stand-in runner."""

from __future__ import annotations

import logging
import types

import numpy as np
import pytest

from kvcanary.adapters.vllm.view import build_forward_view
from kvcanary.adapters.vllm.worker import CanaryWorker
from kvcanary.canary import CanaryConfig, CanaryLaunchCapacities, install
from kvcanary.contract import BufferGroupSpec, GroupKind

B, BLOCKS, RING = 32, 4, 4
TABLE = [1, 2, 3]


def _worker() -> CanaryWorker:
    config = CanaryConfig.from_args_and_env(
        kv_canary="log", kv_canary_real_data="none",
        environ={"KVCANARY_RING_CAPACITY": str(RING), "KVCANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1",
                 "KVCANARY_STATS_PRINT_EVERY_N_STEPS": "0"},
    )  # fmt: skip
    caps = CanaryLaunchCapacities.from_args(
        req_to_token_pool_size=4, max_seq_len_per_req=BLOCKS * B, pool_slot_count=BLOCKS * B,
        cuda_graph_max_bs=None, speculative_num_draft_tokens=None,
        max_prefill_tokens=BLOCKS * B, chunked_prefill_size=None,
    )  # fmt: skip
    canary = install(config, [BufferGroupSpec(kind=GroupKind.FULL, num_slots=BLOCKS * B)], caps)
    assert canary is not None
    canary.mark_init_finished()
    table = types.SimpleNamespace(block_size=B, block_table=types.SimpleNamespace(
        np=np.array([TABLE], dtype=np.int32)))  # fmt: skip
    runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(num_reqs=1, block_table=[table])
    )
    worker = CanaryWorker(runner, config)
    worker.canary = canary
    worker.last_request_ids = ["cmpl-7-0"]
    return worker


def _step(worker: CanaryWorker, computed: int, scheduled: int, truth: list[int]) -> None:
    slots = [TABLE[p // B] * B + p % B for p in range(computed, computed + scheduled)]
    view = build_forward_view(
        block_table=np.array([TABLE], dtype=np.int32), block_size=B,
        num_computed=np.array([computed]), num_scheduled=np.array([scheduled]),
        input_ids=np.array(truth[computed : computed + scheduled]),
        positions=np.arange(computed, computed + scheduled), slot_mapping=np.array(slots),
        truth_tokens=[truth],
    )  # fmt: skip
    canary = worker.canary
    assert canary is not None
    canary.pre_forward(view=view)
    canary.post_forward(view=view)
    canary.end_step()
    worker._collect()


def test_after_the_ring_fills_counts_go_on_and_each_step_logs_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = _worker()
    tokens = list(range(5, 5 + 2 * B + 8))
    _step(worker, 0, 2 * B, tokens)
    assert worker.take_figures().violations == {}
    # vLLM now claims other tokens for the cached prefix: every prefix slot fails verify_token
    wrong = [t + 1 for t in tokens[: 2 * B]] + tokens[2 * B :]
    caplog.set_level(logging.WARNING, logger="kvcanary")
    steps = 3
    for i in range(steps):
        _step(worker, 2 * B + i, 1, wrong)
    canary = worker.canary
    assert canary is not None
    total = canary.total_violations
    assert total > RING  # the ring filled on the first step and dropped the rest
    counts = worker.take_figures().violations
    assert sum(n for key, n in counts.items() if key.endswith("|verify_token")) == total
    ours = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv-canary: step")]
    assert len(ours) == steps  # one line per step, however many violations
    assert all(line.endswith("vLLM request(s): cmpl-7-0") or "beyond the full ring" in line
               for line in ours)  # fmt: skip
    assert "vLLM request(s): cmpl-7-0" in ours[0]
    assert all("beyond the full ring, by tag/reason: " in line and "/verify_token=" in line
               for line in ours)  # fmt: skip
    assert len(worker.drain_violations()) == RING  # the details the ring kept


def test_drained_figures_restart_at_zero_and_what_went_out_stays_as_it_was() -> None:
    """`StepFigures.drain` (the connector's stats each step) zeroes the figures in place; a
    violations map it handed out is never counted into again (vLLM may still aggregate it)."""
    worker = _worker()
    tokens = list(range(5, 5 + 2 * B + 8))
    _step(worker, 0, 2 * B, tokens)
    clean = worker.figures.drain()
    assert clean["checks"] > 0 and clean["violations"] == {}
    assert worker.figures.checks == 0 and worker.figures.is_empty()
    wrong = [t + 1 for t in tokens[: 2 * B]] + tokens[2 * B :]
    _step(worker, 2 * B, 1, wrong)
    first = worker.figures.drain()
    sent = dict(first["violations"])
    assert first["checks"] > 0 and sum(sent.values()) > 0
    assert clean["violations"] == {}  # the clean step's map took none of the later counts
    _step(worker, 2 * B + 1, 1, wrong)
    assert first["violations"] == sent  # the next step's counts went into a new map
    second = worker.figures.drain()
    assert second["checks"] > first["checks"] and second["violations"] == sent
    assert worker.figures.is_empty()
