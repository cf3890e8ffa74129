"""The verify stride (`CanaryConfig.verify_stride`, docs/spec.md §5.5): each phase's
verify plan is the full plan's entries that `reference.verified` keeps, in plan order; the
`stride` phases partition the full plan; range checks and their errors do not depend on the
stride; and a canary with a stride finds a corrupted record within `stride` steps while a clean
run stays clean."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.canary import CanaryConfig, CanaryLaunchCapacities, CanaryMode, RealDataMode, install
from kvcanary.canary.config import VERIFY_STRIDE_SPAN
from kvcanary.canary.kernels import fast, reference
from kvcanary.contract import LaunchTag
from tests.canary.handpool import HandPool


@st.composite
def long_tables(draw: st.DrawFn) -> dict[str, Any]:
    """Rows several stride units long (up to 300 positions), FULL or through an SWA table,
    with or without a window; now and then a slot outside the group (an error)."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    num_slots = draw(st.integers(8, 600))
    nrows, ncols = draw(st.integers(2, 6)), draw(st.integers(1, 300))
    r2t = rng.integers(0, num_slots, size=(nrows, ncols)).astype(np.int64)
    if draw(st.integers(0, 9)) == 0:
        r2t[rng.integers(0, nrows), rng.integers(0, ncols)] = num_slots  # out of range
    use_lut = draw(st.booleans())
    lut = (rng.integers(0, num_slots, size=num_slots) if use_lut else np.zeros(0)).astype(np.int64)
    rows = [int(r) for r in rng.permutation(np.arange(1, nrows))] + [0]
    prefix = [int(rng.integers(0, ncols + 1)) for _ in rows]
    truth = rng.integers(0, 50, size=(len(rows), ncols)).astype(np.int64)
    return {
        "args": (
            np.array(rows, dtype=np.int64), np.array(prefix, dtype=np.int64),
            np.zeros(len(rows), dtype=np.int64), r2t, np.zeros(0, dtype=np.int64), lut, use_lut,
            draw(st.sampled_from([1 << 62, 1, 70, 130])), num_slots, truth,
            np.full(len(rows), ncols, dtype=np.int64), 0, 1 << 40,
        ),
        "marks": num_slots,
        "stride": draw(st.integers(2, 7)),
    }  # fmt: skip


def verify_entries(kernels: Any, t: dict[str, Any], stride: int, phase: int) -> Any:
    """`(err, total_v, [(slot, prev, pos, tok), ...])` of one phase's plan."""
    marks = np.full(t["marks"], -1, dtype=np.int64)
    plan = kernels.build_plan(*t["args"], marks, stride, phase)
    err = [int(x) for x in np.asarray(plan[9])]
    if err[0] != 0:
        return err, 0, []
    cols = [np.asarray(c).tolist() for c in plan[3:7]]
    return err, int(plan[7]), list(zip(*cols, strict=True))


@settings(max_examples=150, deadline=None)
@given(long_tables())
def test_phases_partition_the_full_plan_in_both_kernels(t: dict[str, Any]) -> None:
    stride = t["stride"]
    err, total, full = verify_entries(reference, t, 1, 0)
    assert verify_entries(fast, t, 1, 0) == (err, total, full)
    union: list[Any] = []
    for phase in range(stride):
        got = verify_entries(reference, t, stride, phase)
        assert verify_entries(fast, t, stride, phase) == got  # byte-equal kernels
        assert got[0] == err  # range checks and their error: the stride changes nothing
        if err[0] != 0:
            continue
        kept = [e for e in full if reference.verified(e[2], stride, phase)]
        assert got[2] == kept and got[1] == len(kept)
        union += got[2]
    if err[0] == 0:  # every entry verified in exactly one phase of `stride`
        assert sorted(union) == sorted(full)


def test_units_are_spans_of_positions_in_rotation() -> None:
    span = VERIFY_STRIDE_SPAN
    assert [reference.verified(p, 3, 0) for p in (0, span - 1, span, 3 * span)] == [
        True, True, False, True,
    ]  # fmt: skip
    assert reference.verified(span, 3, 1) and not reference.verified(span, 3, 2)
    assert all(reference.verified(p, 1, 0) for p in range(300))
    # each position in exactly one phase of any stride
    assert all(sum(reference.verified(p, n, k) for k in range(n)) == 1
               for p in range(0, 1000, 7) for n in range(1, 9))  # fmt: skip


def run_decode(stride: int, steps: int, flip_at: int | None) -> tuple[list[int], list[int]]:
    """Four requests of 150 prompt tokens decoding `steps` tokens through a `log` canary with
    real-KV checks and verify stride `stride`. `flip_at`: before that step, flip one bit of the
    TAIL record of an early position of request 1. Returns the violations seen after each step
    and the HEAD verify entries of each step."""
    pool = HandPool(num_slots=1024, num_rows=6, max_len=200)
    cfg = CanaryConfig(mode=CanaryMode.LOG, real_data=RealDataMode.PARTIAL,
                       stats_print_every_n_steps=0, verify_stride=stride)  # fmt: skip
    caps = CanaryLaunchCapacities(write_req_capacity=8, write_entry_capacity=1024,
                                  verify_capacity=4096, max_seq_len_per_req=200)  # fmt: skip
    canary = install(cfg, [pool.group()], caps, kernels="fast")
    assert canary is not None
    canary.mark_init_finished()
    rows = [1, 2, 3, 4]
    batch = [(r, [(r * 7 + i) % 50 for i in range(150)]) for r in rows]
    seen, verified = [], []
    for step in range(steps + 1):
        if flip_at is not None and step == flip_at:
            slot = int(pool.r2t[1, 3])
            canary.group("full").buffer("tail", "k")[slot, 8] ^= 1  # its POSITION
        view = pool.view(batch)
        before = canary.slot_run_counter[LaunchTag.HEAD_K_FULL]
        canary.pre_forward(view=view)
        pool.write_kv(view)
        canary.post_forward(view=view)
        canary.end_step()
        writes = len(batch) * len(batch[0][1])
        verified.append(canary.slot_run_counter[LaunchTag.HEAD_K_FULL] - before - writes)
        seen.append(canary.total_violations)
        batch = [(r, [(r + step) % 50]) for r in rows]
    return seen, verified


@pytest.mark.parametrize("stride", [1, 2, 5])
def test_a_strided_canary_stays_clean_and_verifies_a_stride_share(stride: int) -> None:
    seen, verified = run_decode(stride, steps=2 * stride + 2, flip_at=None)
    assert seen[-1] == 0
    full = [4 * (150 + s - 1) for s in range(1, len(verified))]  # decode steps' attended slots
    if stride == 1:
        assert verified[1:] == full
    else:  # each step verifies its phase's units; any `stride` steps verify every unit
        assert all(0 <= v < f for v, f in zip(verified[1:], full, strict=True))
        assert sum(verified[1 : 1 + stride]) >= full[0]


@pytest.mark.parametrize(("stride", "flip_at"), [(1, 3), (4, 3), (4, 4), (4, 5), (4, 6), (7, 2)])
def test_a_corrupted_record_is_found_within_stride_steps(stride: int, flip_at: int) -> None:
    seen, _ = run_decode(stride, steps=flip_at + stride + 1, flip_at=flip_at)
    assert seen[flip_at - 1] == 0
    first = next(i for i, n in enumerate(seen) if n > 0)
    # TAIL verifies the flipped record at the first step whose phase covers its unit
    assert flip_at <= first < flip_at + stride, (seen, first)
