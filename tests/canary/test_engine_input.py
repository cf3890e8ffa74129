"""Bad engine input gets the SPEC error, never a crash (SPEC §2.2, §14.1, §14.2; issue 12).

One test per crash the issue lists, each failing on the code before the fix: the fast kernel's
segfault on a far `req_to_token` entry when verify is skipped for overflow (run in a subprocess,
so a segfault fails the test instead of killing pytest), the reference kernel's IndexError for
the same input, walker slots past the group and negative walker slots, ForwardViews built from
Python lists, and two requests writing one slot (the kernels must agree, last writer wins).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import kvcanary
from kvcanary.canary import (
    Canary,
    CanaryConfig,
    CanaryContractError,
    CanaryMode,
    RealDataMode,
    install,
)
from kvcanary.canary.hashing import HEAD_HASH, mix3
from kvcanary.contract import ForwardView
from tests.canary.conftest import capacities, forward
from tests.canary.handpool import HandPool

KERNELS = ["fast", "reference"]
ROOT = Path(__file__).resolve().parents[2]
FAR = 10**12


def build(kernels: str, pool: HandPool, *, verify_capacity: int | None = None) -> Canary:
    """A log-mode canary over `pool` (PARTIAL real-KV source); `verify_capacity` shrinks verify."""
    caps = capacities(pool)
    if verify_capacity is not None:
        caps = dataclasses.replace(caps, verify_capacity=verify_capacity)
    cfg = CanaryConfig(
        mode=CanaryMode.LOG, real_data=RealDataMode.PARTIAL, stats_print_every_n_steps=0
    )
    canary = install(cfg, [pool.group(16)], caps, kernels=kernels)
    assert canary is not None
    return canary


def far_entry_in_overflowed_forward(kernels: str) -> str:
    """The message `pre_forward` raises when the seed of a row whose verify is skipped for
    overflow is a far out-of-range `req_to_token` entry."""
    pool = HandPool()
    pool.r2t = pool.r2t.to(torch.int64)
    canary = build(kernels, pool, verify_capacity=1)
    forward(pool, canary, pool.view([(1, [1, 2, 3])]))
    view = pool.view([(1, [4])])
    pool.r2t[1, 2] = FAR  # the seed of the new token: never range-checked before the fix
    with pytest.raises(CanaryContractError) as err:
        canary.pre_forward(view=view)
    return str(err.value)


FAR_MESSAGE = f"kv-canary: slot {FAR} is outside the full group's 64 slots"


def test_fast_kernel_far_seed_in_overflowed_forward_raises_not_segfaults() -> None:
    script = textwrap.dedent(
        """
        from tests.canary.test_engine_input import far_entry_in_overflowed_forward
        print(far_entry_in_overflowed_forward("fast"))
        """
    )
    env = dict(os.environ)
    src = str(Path(kvcanary.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert result.stdout.strip().splitlines()[-1] == FAR_MESSAGE


def test_reference_kernel_far_seed_in_overflowed_forward_raises_contract_error() -> None:
    assert far_entry_in_overflowed_forward("reference") == FAR_MESSAGE


class ListWalker:
    """A prefix-cache walker replaying fixed entries."""

    def __init__(self, entries: list[tuple[int, int, int]]) -> None:
        self.entries = entries

    def walk(
        self, *, unlocked_only: bool = False, swa_resident_only: bool = False
    ) -> list[tuple[int, int, int]]:
        return self.entries


def sweep_with(kernels: str, entries: list[tuple[int, int, int]]) -> Canary:
    """A canary with one cached request, then a sweep over `entries`."""
    pool = HandPool()
    canary = build(kernels, pool)
    canary.config = dataclasses.replace(canary.config, sweep_interval=1)
    forward(pool, canary, pool.view([(1, [1, 2, 3])]))
    canary.attach_prefix_cache(walker=ListWalker(entries))
    canary.end_step()
    return canary


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize(
    ("entry", "bad"),
    [((64, 0, -1), 64), ((67, 0, -1), 67), ((1, 0, 0), None), ((2, 1, 64), 64)],
)
def test_walker_slot_past_the_group_is_a_contract_error(
    kernels: str, entry: tuple[int, int, int], bad: int | None
) -> None:
    good = [(1, 0, -1), (2, 1, 1), (3, 2, 2)]
    if bad is None:  # control: the same walk with in-range slots sweeps cleanly
        canary = sweep_with(kernels, [*good, entry])
        assert canary.sweep_passes == 1 and canary.total_violations == 0
        return
    with pytest.raises(CanaryContractError) as err:
        sweep_with(kernels, [*good, entry])
    assert str(err.value) == f"kv-canary: slot {bad} is outside the full group's 64 slots"


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize(
    ("entry", "bad"), [((-3, 0, -1), -3), ((-1, 0, -1), -1), ((2, 1, -2), -2), ((2, 1, -64), -64)]
)
def test_negative_walker_slot_is_a_contract_error_not_a_wrap(
    kernels: str, entry: tuple[int, int, int], bad: int
) -> None:
    with pytest.raises(CanaryContractError) as err:
        sweep_with(kernels, [(1, 0, -1), entry])
    assert str(err.value) == f"kv-canary: slot {bad} is outside the full group's 64 slots"


VIEW_FIELDS = ["rows", "prefix_lens", "extend_lens", "input_ids", "positions", "out_slots"]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("field", [*VIEW_FIELDS, "req_to_token"])
@pytest.mark.parametrize("container", [list, tuple])
def test_forward_view_from_python_lists_is_the_dtype_type_error(
    kernels: str, field: str, container: type
) -> None:
    pool = HandPool()
    canary = build(kernels, pool)
    view = pool.view([(1, [1, 2]), (2, [3])])
    value = getattr(view, field).tolist()
    bad = dataclasses.replace(view, **{field: container(value)})
    with pytest.raises(TypeError) as err:
        canary.pre_forward(view=bad)
    assert str(err.value) == (
        f"kv-canary: forward_view.{field} must have an int32 or int64 dtype, "
        f"got {container.__name__}"
    )
    canary.pre_forward(view=view)  # nothing was left open by the failed call
    canary.post_forward(view=view)


def double_write_views(pool: HandPool) -> tuple[list[ForwardView], dict[str, int]]:
    """Three forwards; in the second, two requests write one slot (double allocation), a request
    rewrites the seed slot of a later request, and a request writes slot 0 twice.

    Request A (row 1) writes `shared` at its last entry and request B (row 2) at its first, so B
    is the later writer in flat order while interleaving the chains would end on A's write. A
    also writes `b`, the slot B's chain continues from (B's seed), before B's chain starts.
    """
    first = pool.view([(1, [5, 6, 7, 8]), (2, [9])])
    b = int(pool.r2t[2, 0])
    f1, f2, shared, g = pool.alloc(4)
    two = ForwardView(
        rows=torch.tensor([1, 2, 3]),
        prefix_lens=torch.tensor([4, 1, 0]),
        extend_lens=torch.tensor([4, 2, 2]),
        input_ids=torch.tensor([10, 11, 12, 13, 20, 21, 30, 31]),
        positions=torch.tensor([4, 5, 6, 7, 1, 2, 0, 1]),
        out_slots=torch.tensor([f1, f2, b, shared, shared, g, 0, 0]),
        req_to_token=pool.r2t,
    )
    pool.r2t[1, 4:8] = torch.tensor([f1, f2, b, shared], dtype=torch.int32)
    pool.r2t[2, 1:3] = torch.tensor([shared, g], dtype=torch.int32)
    a_next, b_next = pool.alloc(2)
    third = ForwardView(
        rows=torch.tensor([1, 2, 3]),
        prefix_lens=torch.tensor([8, 3, 2]),
        extend_lens=torch.tensor([1, 1, 0]),
        input_ids=torch.tensor([14, 22]),
        positions=torch.tensor([8, 3]),
        out_slots=torch.tensor([a_next, b_next]),
        req_to_token=pool.r2t,
    )
    pool.r2t[1, 8] = a_next
    pool.r2t[2, 3] = b_next
    slots = {"a3": int(pool.r2t[1, 3]), "b": b, "f1": f1, "shared": shared, "g": g}
    return [first, two, third], slots


def run_double_writes(kernels: str) -> tuple[Canary, list[bytes], list[list[int]]]:
    pool = HandPool()
    canary = build(kernels, pool)
    snapshots: list[bytes] = []
    rings: list[list[int]] = []
    for view in double_write_views(pool)[0]:
        forward(pool, canary, view)
        snapshots.append(
            b"".join(
                canary.group("full").buffer(stage, "k").tobytes() for stage in ("head", "tail")
            )
        )
        rings.append(canary.ring.rows[: canary.ring.write_index].ravel().tolist())
    return canary, snapshots, rings


def test_two_requests_writing_one_slot_leave_byte_equal_buffers_and_rings() -> None:
    fast, fast_buffers, fast_rings = run_double_writes("fast")
    ref, ref_buffers, ref_rings = run_double_writes("reference")
    assert fast_buffers == ref_buffers  # every row, slot 0 included, after every forward
    assert fast_rings == ref_rings
    assert fast.total_violations == ref.total_violations > 0  # A lost `shared`, B lost `b`


def record(canary: Canary, slot: int) -> tuple[int, ...]:
    """(TOKEN, POSITION, PREV_HASH, REAL_KV_HASH) of `slot`'s HEAD record, unsigned."""
    words = canary.group("full").buffer("head", "k").view(np.uint64)
    return tuple(int(x) for x in words[slot])


@pytest.mark.parametrize("kernels", KERNELS)
def test_last_writer_wins_and_seeds_are_snapshots(kernels: str) -> None:
    pool = HandPool()
    canary = build(kernels, pool)
    (first, two, _), s = double_write_views(pool)
    forward(pool, canary, first)
    old_b = record(canary, s["b"])
    assert old_b[:3] == (9, 0, HEAD_HASH)
    canary.pre_forward(view=two)
    # B, the later writer in flat order, owns `shared`; its chain starts from its seed `b` as `b`
    # was before A rewrote it in this same forward.
    assert record(canary, s["shared"])[:3] == (20, 1, mix3(old_b[2], old_b[0], old_b[1]))
    assert record(canary, s["b"])[:2] == (12, 6)  # A's write; B never wrote `b`
    a3 = record(canary, s["a3"])
    assert record(canary, s["f1"])[:3] == (10, 4, mix3(a3[2], a3[0], a3[1]))
    assert record(canary, 0)[:3] == (31, 1, mix3(HEAD_HASH, 30, 0))  # C's second slot-0 write
