"""Sweeps of a walk given as runs (`PrefixCacheWalker.walk_runs`): the same result as the walk
they expand to, on the fused path (`sweep_runs_serial`) and every path it hands back to.

A canary writes records for a few requests, a stray write corrupts records and KV bytes, and
the sweep reads a random walk. The same walk is handed once as runs and once as the expanded
`[n, 3]` entries (`walk` only); everything observable must match: ring rows, violation counts,
run counters, every record and the error a bad walk raises. Runs out of range, malformed runs
and walks larger than one thread's limit send the fused sweep back to the general path.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcanary.canary import (
    CanaryConfig,
    CanaryLaunchCapacities,
    CanaryMode,
    RealDataMode,
    install,
    runtime,
)
from kvcanary.canary.fused import FusedForward
from kvcanary.canary.view_checks import runs_entries, walker_runs
from kvcanary.contract import (
    BufferGroupSpec,
    CanaryContractError,
    ForwardView,
    GroupKind,
    RealKvSource,
)

N_SLOTS = 48
INT64_MAX = (1 << 63) - 1


_EMPTY = np.zeros((0, 4), dtype=np.int64)


class RunsWalker:
    """A walker offering `walk_runs` (and, to show which one the canary prefers, `walk`); its
    walk is empty until `fill`."""

    def __init__(self, runs: Any) -> None:
        self.runs: Any = _EMPTY
        self.given = runs
        self.plain_walks = 0

    def fill(self) -> None:
        self.runs = self.given

    def walk_runs(self, *, unlocked_only: bool = False,
                  swa_resident_only: bool = False) -> np.ndarray:  # fmt: skip
        return self.runs

    def walk(self, *, unlocked_only: bool = False, swa_resident_only: bool = False) -> Any:
        self.plain_walks += 1
        return [tuple(e) for e in runs_entries(self.runs).tolist()]


class EntriesWalker:
    """The same walk as plain `(slot, position, prev_slot)` triples."""

    def __init__(self, runs: np.ndarray) -> None:
        self.entries: list[Any] = []
        self.given = [tuple(e) for e in runs_entries(runs).tolist()]

    def fill(self) -> None:
        self.entries = self.given

    def walk(self, *, unlocked_only: bool = False, swa_resident_only: bool = False) -> Any:
        return self.entries


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    rng = np.random.default_rng(draw(st.integers(0, 2**63 - 1)))
    requests = []
    free = list(range(1, N_SLOTS))
    rng.shuffle(free)
    for _ in range(int(rng.integers(1, 4))):  # requests writing consecutive slots
        start = int(rng.integers(1, N_SLOTS - 8))
        requests.append(list(range(start, start + int(rng.integers(1, 8)))))
    runs = []
    for _ in range(int(rng.integers(0, 6))):
        lax = rng.random() < 0.15  # a slot or predecessor one past the group's ends
        length = int(rng.integers(0, 10))
        first = int(rng.integers(-1 if lax else 0, N_SLOTS + (1 if lax else 0) - length + 1))
        prev = int(rng.integers(-2 if lax else -1, N_SLOTS + (1 if lax else 0)))
        runs.append((first, int(rng.integers(0, 10)), prev, length))
    return {
        "requests": requests,
        "runs": np.array(runs, dtype=np.int64).reshape(-1, 4),
        "record_flips": [
            int(x) for x in rng.integers(0, N_SLOTS * 32, size=int(rng.integers(0, 4)))
        ],
        "kv_flips": [int(x) for x in rng.integers(0, N_SLOTS * 32, size=int(rng.integers(0, 3)))],
        "mode": list(RealDataMode)[int(rng.integers(0, 3))],
        "serial_limit": [runtime.SERIAL_LAUNCH_ENTRIES, runtime.SERIAL_LAUNCH_ENTRIES, 4, 1][
            int(rng.integers(0, 4))
        ],
    }


def outcome(sc: dict[str, Any], walker: Any, kernels: str = "fast") -> list[Any]:
    """Everything observable after the scenario's forwards, stray writes and one sweep."""
    k_bytes = torch.zeros(N_SLOTS, 32, dtype=torch.uint8)
    sources = (RealKvSource(k_bytes, 1, 32, 16),)
    groups = [BufferGroupSpec(kind=GroupKind.FULL, num_slots=N_SLOTS, k_sources=sources,
                              v_sources=sources)]  # fmt: skip
    cfg = CanaryConfig(mode=CanaryMode.LOG, real_data=sc["mode"], sweep_interval=2,
                       ring_capacity=6, stats_print_every_n_steps=0)  # fmt: skip
    caps = CanaryLaunchCapacities(write_req_capacity=4, write_entry_capacity=32,
                                  verify_capacity=64, max_seq_len_per_req=8)  # fmt: skip
    events: list[Any] = []
    with mock.patch.object(runtime, "SERIAL_LAUNCH_ENTRIES", sc["serial_limit"]):
        canary = install(cfg, groups, caps, kernels=kernels)
        assert canary is not None
        canary.attach_prefix_cache(walker=walker)
        canary.mark_init_finished()
        canary.end_step()  # step 0 sweeps (the walk is read), before anything is written
        for slots in sc["requests"]:  # one request a forward, its tokens written
            table = np.zeros((2, 8), dtype=np.int64)
            table[1, : len(slots)] = slots
            k_bytes[slots] = torch.randint(0, 256, (len(slots), 32), dtype=torch.uint8,
                                           generator=torch.Generator().manual_seed(len(slots)))  # fmt: skip
            view = ForwardView(rows=np.array([1]), prefix_lens=np.array([0]),
                               extend_lens=np.array([len(slots)]),
                               input_ids=np.arange(len(slots)) + 3,
                               positions=np.arange(len(slots)), out_slots=np.array(slots),
                               req_to_token=table)  # fmt: skip
            canary.pre_forward(view=view)
            canary.post_forward(view=view)
        record = canary.group("full").buffer("tail", "k").reshape(-1)
        for i in sc["record_flips"]:
            record[i] ^= 8
        for i in sc["kv_flips"]:
            k_bytes.view(-1)[i] ^= 1
        if canary.step % 2:
            canary.end_step()  # the sweep below is due on an even step
        walker.fill()
        try:
            canary.end_step()
        except (TypeError, ValueError) as err:  # CanaryContractError is a ValueError
            events.append((type(err).__name__, str(err)))
        events.append((canary.ring.rows.tolist(), canary.total_violations,
                       dict(canary.kernel_run_counter), dict(canary.slot_run_counter),
                       canary.sweep_passes, record.tobytes()))  # fmt: skip
    return events


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(scenarios())
def test_runs_sweep_equals_the_expanded_walk(sc: dict[str, Any]) -> None:
    runs_walker = RunsWalker(sc["runs"])
    fast = outcome(sc, runs_walker)
    assert runs_walker.plain_walks == 0  # the runs were read, not the plain walk
    assert fast == outcome(sc, EntriesWalker(sc["runs"]))
    assert outcome(sc, RunsWalker(sc["runs"]), "reference") == outcome(
        sc, EntriesWalker(sc["runs"]), "reference"
    )


def test_the_property_reaches_each_path_and_finds_violations() -> None:
    """Guard against a vacuous property: runs swept fused, runs handed back (out of range, too
    large), slot errors and violations all occur."""
    answers: list[int] = []
    real = FusedForward.sweep_runs

    def sweep_runs(self: FusedForward, runs: np.ndarray) -> int:
        answers.append(real(self, runs))
        return answers[-1]

    seen = {"errors": 0, "violations": 0}

    @settings(max_examples=200, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
    @given(scenarios())
    def probe(sc: dict[str, Any]) -> None:
        events = outcome(sc, RunsWalker(sc["runs"]))
        seen["errors"] += len(events) > 1
        seen["violations"] += events[-1][1] > 0

    with mock.patch.object(FusedForward, "sweep_runs", sweep_runs):
        probe()
    assert sum(a > 0 for a in answers) > 50, answers
    assert answers.count(-1) > 50, answers
    assert seen["errors"] >= 5 and seen["violations"] > 100, seen


def test_a_run_past_int64_or_of_negative_length_is_a_contract_error() -> None:
    for bad in [(5, 0, -1, -1), (INT64_MAX - 2, 0, -1, 4), (5, INT64_MAX - 1, -1, 3)]:
        with pytest.raises(CanaryContractError, match=r"^kv-canary: the prefix-cache walker's "
                           r"walk_runs\(\) gave run .*: its length must be >= 0"):  # fmt: skip
            runs_entries(np.array([(1, 0, -1, 2), bad], dtype=np.int64))
    sc = {"requests": [[1, 2]], "runs": np.array([(1, 0, -1, -3)], dtype=np.int64),
          "record_flips": [], "kv_flips": [], "mode": RealDataMode.NONE,
          "serial_limit": runtime.SERIAL_LAUNCH_ENTRIES}  # fmt: skip
    for kernels in ("fast", "reference"):
        events = outcome(sc, RunsWalker(sc["runs"]), kernels)
        assert events[0][0] == "CanaryContractError" and "(1, 0, -1, -3)" in events[0][1]


@pytest.mark.parametrize(
    "got",
    [
        [(1, 0, -1, 2)],
        np.zeros((2, 3), dtype=np.int64),
        np.zeros((2, 4), dtype=np.int32),
        np.zeros((4, 4), dtype=np.int64)[:, ::2].repeat(2, axis=1)[::2],
        np.zeros((4, 8), dtype=np.int64)[:, ::2],
    ],
)
def test_walk_runs_of_the_wrong_form_is_a_contract_error(got: Any) -> None:
    walker = RunsWalker(got)
    walker.fill()
    with pytest.raises(CanaryContractError, match=r"^kv-canary: the prefix-cache walker's "
                       r"walk_runs\(\) must return a C-contiguous int64 \[m, 4\] array"):  # fmt: skip
        walker_runs(walker)


def test_a_walker_without_runs_is_read_as_before() -> None:
    assert walker_runs(EntriesWalker(np.zeros((0, 4), dtype=np.int64))) is None


def test_runs_expand_to_consecutive_slots_linked_in_order() -> None:
    runs = np.array([(10, 0, -1, 3), (20, 5, 12, 0), (30, 3, 12, 2)], dtype=np.int64)
    assert runs_entries(runs).tolist() == [[10, 0, -1], [11, 1, 10], [12, 2, 11], [30, 3, 12],
                                           [31, 4, 30]]  # fmt: skip
