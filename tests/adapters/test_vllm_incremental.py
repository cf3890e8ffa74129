"""The vLLM adapter's per-step shortcuts equal what they replace: the persistent `req_to_token`
(`prep.StepPrep`) equals a full rebuild, byte for byte, over seeded sequences of steps with
adds, growth, finishes, preemptions, row moves and garbage; its block-level wave test never
misses a split the slot-level one makes; its TAIL block list covers every block TAIL reads; the
snapshot walker's array equals its tuples (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.adapters.vllm.prep import StepPrep
from kvcanary.adapters.vllm.sweep import BlockSnapshot, SnapshotWalker
from kvcanary.adapters.vllm.view import build_forward_view, paged_req_to_token, split_waves
from kvcanary.canary.kernels import reference
from kvcanary.canary.view_checks import runs_entries, walker_entries, walker_runs
from kvcanary.contract import ForwardView

ROWS, MAX_BLOCKS, NUM_BLOCKS = 6, 8, 40


def _prep_forward(prep: StepPrep, bt: np.ndarray, computed: np.ndarray, scheduled: np.ndarray,
                  slots: np.ndarray, ids: list[int] | None = None,
                  pos: list[int] | None = None, stride: int = 1,
                  phase: int = 0) -> ForwardView:  # fmt: skip
    """`prep.forward` for `scheduled` tokens per row (ids and positions 0 unless given)."""
    n = len(scheduled)
    qsl = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
    total = int(qsl[-1])
    ids_a = np.array(ids if ids is not None else [0] * total, dtype=np.int64)
    pos_a = np.array(pos if pos is not None else [0] * total, dtype=np.int64)
    return prep.forward(bt, n, qsl, computed, np.zeros(n, dtype=np.int32), ids_a, pos_a, slots,
                        stride=stride, phase=phase)  # fmt: skip


def _step(rng: np.random.Generator, bt: np.ndarray, nblk: np.ndarray) -> None:
    """One engine step's edits of a vLLM-style persistent block table."""
    for _ in range(int(rng.integers(1, 4))):
        r = int(rng.integers(0, ROWS))
        op = int(rng.integers(0, 6))
        if op == 0 and nblk[r] < MAX_BLOCKS:  # add / grow a request: append blocks
            k = int(rng.integers(1, MAX_BLOCKS - nblk[r] + 1))
            bt[r, nblk[r] : nblk[r] + k] = rng.integers(0, NUM_BLOCKS, k)
            nblk[r] += k
        elif op == 1:  # finish: vLLM leaves the ids, resets the count
            nblk[r] = 0
        elif op == 2:  # preempt / clear_row: ids zeroed
            bt[r, : nblk[r]] = 0
            nblk[r] = 0
        elif op == 3:  # move a row (condense / swap_row)
            t = int(rng.integers(0, ROWS))
            bt[[r, t]] = bt[[t, r]]
            nblk[[r, t]] = nblk[[t, r]]
        elif op == 4:  # a fault: one id changed in place
            bt[r, int(rng.integers(0, MAX_BLOCKS))] = int(rng.integers(0, NUM_BLOCKS))
        # op 5: nothing changes this step


@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 2, 16]))
@settings(max_examples=60, deadline=None)
def test_incremental_req_to_token_equals_a_rebuild_every_step(seed: int, b: int) -> None:
    rng = np.random.default_rng(seed)
    bt = np.zeros((ROWS, MAX_BLOCKS), dtype=np.int32)
    nblk = np.zeros(ROWS, dtype=np.int64)
    prep = StepPrep(bt, b, NUM_BLOCKS)
    for _ in range(40):
        _step(rng, bt, nblk)
        num_reqs = int(rng.integers(0, ROWS + 1))
        computed = rng.integers(0, (MAX_BLOCKS + 2) * b, num_reqs).astype(np.int32)
        scheduled = rng.integers(0, b + 1, num_reqs).astype(np.int64)
        slots = rng.integers(-1, NUM_BLOCKS * b, int(scheduled.sum())).astype(np.int64)
        got = _prep_forward(prep, bt, computed, scheduled, slots).req_to_token
        need = int((computed.astype(np.int64) + scheduled).max()) if num_reqs else 0
        nb = max(1, min(-(-need // b), MAX_BLOCKS))  # may ask past the table: clamped
        want = paged_req_to_token(bt, num_reqs, b, nb * b)
        assert got.shape[0] == num_reqs + 1 and got.shape[1] >= nb * b
        assert got.dtype == np.int64 and got.flags.c_contiguous
        np.testing.assert_array_equal(got[:, : nb * b], want)
        assert (prep._owner == -1).all()  # the scratch is clean between calls


def test_incremental_req_to_token_sees_an_edit_of_a_block_it_expanded_before() -> None:
    bt = np.array([[3, 4, 0]], dtype=np.int32)
    prep = StepPrep(bt, 2, 8)
    one = np.ones(1, dtype=np.int64)
    got = _prep_forward(prep, bt, np.array([3]), one, np.array([9])).req_to_token
    assert got[1, :4].tolist() == [6, 7, 8, 9]
    bt[0, 0] = 0  # the null block reads as slot 0
    bt[0, 1] = 5
    got = _prep_forward(prep, bt, np.array([3]), one, np.array([11])).req_to_token
    assert got[1, :4].tolist() == [0, 0, 10, 11]
    assert sorted(prep.tail_blocks.tolist()) == [0, 5] and not prep.cross


def _random_case(rng: np.random.Generator, b: int):
    n = int(rng.integers(1, 5))
    bt = rng.integers(0, 6, (n, 4)).astype(np.int32)  # few blocks: sharing is common
    computed = rng.integers(0, 3 * b, n)
    scheduled = rng.integers(0, b + 1, n)
    slots, ids, pos = [], [], []
    for r in range(n):
        for p in range(int(computed[r]), int(computed[r] + scheduled[r])):
            slots.append(int(bt[r, p // b]) * b + p % b if rng.random() > 0.1 else
                         int(rng.integers(-1, 7 * b)))  # fmt: skip
            ids.append(1 + p)
            pos.append(p)
    return bt, computed, scheduled, np.array(slots, dtype=np.int64), ids, pos


@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 2, 4]))
@settings(max_examples=300, deadline=None)
def test_block_level_wave_test_never_misses_a_split_and_tail_covers_tail(seed: int, b: int) -> None:
    bt, computed, scheduled, slots, ids, pos = _random_case(np.random.default_rng(seed), b)
    n = len(bt)
    prep = StepPrep(bt, b, 6)  # blocks >= 6 are outside the cache
    view = _prep_forward(prep, bt, computed, scheduled, slots, ids, pos)
    r2t = view.req_to_token
    if not prep.cross:
        assert len(split_waves(view)) == 1
    read = {int(s) // b for r in range(n) for s in r2t[r + 1, : computed[r]]}
    read |= {int(s) // b for s in slots if s >= 0}
    assert {x for x in read if x < 6} <= set(prep.tail_blocks.tolist())
    tail = prep.tail_blocks.tolist()
    assert len(tail) == len(set(tail))  # each block once: TAIL's mirror re-gathers each once
    assert not prep._listed.any()  # the scratch is clean between calls
    assert prep.min_slot == min(0, int(slots.min()) if slots.size else 0)


@given(st.integers(0, 2**32 - 1), st.sampled_from([16, 32, 48, 128]), st.integers(2, 3),
       st.integers(0, 2))  # fmt: skip
@settings(max_examples=200, deadline=None)
def test_under_a_verify_stride_tail_lists_the_blocks_its_phase_reads(
    seed: int, b: int, stride: int, phase: int
) -> None:
    """With a verify stride the TAIL block list (what the mirror re-gathers) holds every block
    with a position the phase verifies (`reference.verified`) and every written block, and no
    block the full list lacks; the wave test does not change."""
    phase %= stride
    bt, computed, scheduled, slots, ids, pos = _random_case(np.random.default_rng(seed), b)
    n = len(bt)
    full, thin = StepPrep(bt, b, 6), StepPrep(bt, b, 6)
    _prep_forward(full, bt, computed, scheduled, slots, ids, pos)
    view = _prep_forward(thin, bt, computed, scheduled, slots, ids, pos, stride, phase)
    assert thin.cross == full.cross
    r2t = view.req_to_token
    read = {int(r2t[r + 1, p]) // b for r in range(n) for p in range(int(computed[r]))
            if reference.verified(p, stride, phase)}  # fmt: skip
    read |= {int(s) // b for s in slots if s >= 0}
    tail = thin.tail_blocks.tolist()
    assert {x for x in read if x < 6} <= set(tail) <= set(full.tail_blocks.tolist())
    assert len(tail) == len(set(tail)) and not thin._listed.any()
    skipped = {int(r2t[r + 1, p]) // b for r in range(n) for p in range(int(computed[r]))} - read
    assert not (skipped & set(tail))  # a block no entry reads this step is not re-gathered


def test_walker_array_equals_its_tuples_and_feeds_the_canary() -> None:
    rows = np.array([[3, 0, -1, 0], [5, 1, 3, 1], [2, 4, -2, 0]], dtype=np.int64)
    walker = SnapshotWalker()
    walker.snapshot = BlockSnapshot(rows=rows, block_size=4)
    tuples = list(walker.walk())
    arr = walker_entries(walker)
    assert arr.dtype == np.int64 and arr.shape == (12, 3)
    assert [tuple(e) for e in arr.tolist()] == tuples
    assert tuples[4] == (20, 4, 15) and tuples[8] == (8, 16, 0)
    assert walker.walks == 2
    block_runs = walker_runs(walker)  # what the canary reads first: one run a block
    assert block_runs is not None and block_runs.tolist() == [[12, 0, -1, 4], [20, 4, 15, 4],
                                                              [8, 16, 0, 4]]  # fmt: skip
    assert runs_entries(block_runs).tolist() == arr.tolist() and walker.walks == 3
    walker.snapshot = None
    assert walker_runs(walker).shape == (0, 4) and walker.missed == 1  # type: ignore[union-attr]


@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 2, 16]))
@settings(max_examples=60, deadline=None)
def test_one_call_forward_equals_build_forward_view(seed: int, b: int) -> None:
    """`StepPrep.forward` (the worker's one compiled call) == the batch shape in NumPy and
    `build_forward_view` over a full `req_to_token` rebuild, over steps with growth, garbage
    slots (below -1) and flat arrays shorter than the scheduled count (a bad runner: the canary
    reports the mismatch); its TAIL block list and wave test hold on every step."""
    rng = np.random.default_rng(seed)
    bt = np.zeros((ROWS, MAX_BLOCKS), dtype=np.int32)
    nblk = np.zeros(ROWS, dtype=np.int64)
    fast = StepPrep(bt, b, NUM_BLOCKS)
    for _ in range(30):
        _step(rng, bt, nblk)
        n = int(rng.integers(1, ROWS + 1))
        computed = rng.integers(0, (MAX_BLOCKS + 2) * b, ROWS).astype(np.int32)
        prompt = rng.integers(0, (MAX_BLOCKS + 2) * b, ROWS).astype(np.int32)
        scheduled = rng.integers(0, b + 1, n)
        qsl = np.concatenate([[0], np.cumsum(scheduled), np.zeros(ROWS - n, dtype=np.int64)])
        qsl = qsl.astype(np.int32)
        total = int(qsl[n])
        short = int(rng.integers(0, 2)) * min(total, 1)  # ids one short, now and then
        ids = rng.integers(0, 1000, total - short).astype(np.int32)
        pos = rng.integers(0, 1000, total).astype(np.int64)
        slots = rng.integers(-4, NUM_BLOCKS * b + 3, total).astype(np.int64)
        got = fast.forward(bt, n, qsl, computed, prompt, ids, pos, slots)
        sched = np.diff(qsl[: n + 1]).astype(np.int64)
        end = computed[:n].astype(np.int64) + sched
        nb = max(1, min(-(-int(end.max()) // b), MAX_BLOCKS))  # may ask past the table: clamped
        r2t = paged_req_to_token(bt, n, b, nb * b)
        want = build_forward_view(
            block_table=bt, block_size=b, num_computed=computed[:n], num_scheduled=sched,
            input_ids=ids, positions=pos, slot_mapping=slots, req_to_token=r2t,
        )  # fmt: skip
        for name in ("rows", "prefix_lens", "extend_lens", "input_ids", "positions",
                     "out_slots"):  # fmt: skip
            a, w = getattr(got, name), getattr(want, name)
            assert a.dtype == np.int64, name
            np.testing.assert_array_equal(a, w, err_msg=name)
        np.testing.assert_array_equal(got.req_to_token[:, : nb * b], r2t)
        assert fast.chunked == int((end < prompt[:n]).sum())
        assert got.truth_tokens is None and not got.mutable
        assert fast.min_slot == min(0, int(slots.min()) if slots.size else 0)
        tail = fast.tail_blocks.tolist()
        read = {int(x) // b for r in range(n) for x in r2t[r + 1, : min(computed[r], nb * b)]}
        read |= {int(x) // b for x in slots if x >= 0}
        assert {x for x in read if x < NUM_BLOCKS} <= set(tail) and len(tail) == len(set(tail))
        if not fast.cross:
            assert len(split_waves(got)) == 1
        assert (fast._owner == -1).all() and not fast._listed.any()


def test_forward_cuts_flat_arrays_to_num_tokens_and_keeps_short_ones_short() -> None:
    """`num_tokens` cuts each flat array to its first entries inside the compiled call (the
    runner's buffers are longer than a step), while an array shorter than that keeps its own
    length (the canary then reports the mismatch); the view's buffers grow when a step needs
    more room, and a later step with the old shapes gets a view of the same size again."""
    b = 2
    bt = np.zeros((ROWS, MAX_BLOCKS), dtype=np.int32)
    bt[0, :2] = [3, 4]
    prep = StepPrep(bt, b, NUM_BLOCKS)
    qsl = np.array([0, 2] + [0] * ROWS, dtype=np.int32)
    ids = np.arange(100, 164, dtype=np.int32)  # a whole runner buffer
    pos = np.arange(64, dtype=np.int64)
    slots = np.array([6, 7, 99, 98], dtype=np.int64)
    view = prep.forward(bt, 1, qsl, np.array([0]), np.array([2]), ids, pos, slots, None, 2)
    assert view.input_ids.tolist() == [100, 101] and view.positions.tolist() == [0, 1]
    assert view.out_slots.tolist() == [6, 7]
    short = prep.forward(bt, 1, qsl, np.array([0]), np.array([2]), ids[:1], pos, slots, None, 2)
    assert short.input_ids.tolist() == [100] and len(short.positions) == 2
    wide = prep.forward(bt, 1, qsl, np.array([0]), np.array([2]), ids, pos, slots[:2])
    assert len(wide.input_ids) == 64 and wide.out_slots.tolist() == [6, 7]
    again = prep.forward(bt, 1, qsl, np.array([0]), np.array([2]), ids, pos, slots, None, 2)
    assert again.input_ids.tolist() == [100, 101] and again.out_slots.tolist() == [6, 7]


def test_forward_names_a_batch_the_block_table_or_the_runner_arrays_cannot_hold() -> None:
    """More rows than the block table has, or batch arrays shorter than the rows: one
    `ValueError` naming the count, before anything is written."""
    bt = np.zeros((2, MAX_BLOCKS), dtype=np.int32)
    prep = StepPrep(bt, 2, NUM_BLOCKS)
    one = np.zeros(1, dtype=np.int64)
    qsl = np.zeros(4, dtype=np.int32)
    with pytest.raises(ValueError, match="3 rows exceed the block table's 2"):
        prep.forward(bt, 3, qsl, np.zeros(3), np.zeros(3), one, one, one)
    with pytest.raises(ValueError, match="shorter than its 2 rows"):
        prep.forward(bt, 2, qsl, np.zeros(1), np.zeros(2), one, one, one)
    assert (prep.table == 0).all() and (prep._seen == 0).all()
