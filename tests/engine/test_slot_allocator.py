"""SlotAllocator, RowAllocator and ListReqToTokenTable."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.engine.req_rows import RowAllocator
from kvcanary.engine.slot_allocator import SlotAllocator
from kvcanary.engine.table import ListReqToTokenTable


def test_slot_zero_is_never_handed_out() -> None:
    alloc = SlotAllocator(5)
    got = alloc.alloc(4)
    assert got is not None and sorted(got) == [1, 2, 3, 4]
    assert alloc.alloc(1) is None
    alloc.check_integrity()


def test_alloc_failure_changes_nothing() -> None:
    alloc = SlotAllocator(4)
    assert alloc.alloc(4) is None
    assert alloc.num_free == 3 and alloc.num_held == 0


def test_shared_slot_is_freed_by_last_reference() -> None:
    alloc = SlotAllocator(4)
    slots = alloc.alloc(2)
    assert slots is not None
    alloc.incref(slots[:1])
    assert alloc.decref(slots) == 1
    assert alloc.refcount(slots[0]) == 1 and alloc.refcount(slots[1]) == 0
    alloc.incref(slots[:1])
    with pytest.raises(ValueError, match="shared"):
        alloc.free(slots[:1])
    alloc.decref(slots[:1])
    alloc.free(slots[:1])
    assert alloc.num_held == 0
    alloc.check_integrity()


@pytest.mark.parametrize("op", ["incref", "decref", "free"])
def test_unheld_slot_raises(op: str) -> None:
    alloc = SlotAllocator(4)
    with pytest.raises(ValueError, match="not held"):
        getattr(alloc, op)([2])
    with pytest.raises(ValueError, match="outside"):
        getattr(alloc, op)([0])


def test_seeded_order_is_deterministic_and_fifo() -> None:
    a, b = SlotAllocator(32, seed=7), SlotAllocator(32, seed=7)
    assert a.alloc(10) == b.alloc(10)
    plain = SlotAllocator(6)
    first = plain.alloc(2)
    assert first == [1, 2]
    plain.decref(first)
    assert plain.alloc(5) == [3, 4, 5, 1, 2]


@settings(max_examples=150, deadline=None)
@given(
    num_slots=st.integers(2, 24),
    seed=st.none() | st.integers(0, 3),
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "incref", "decref"]), st.integers(0, 8)), max_size=60
    ),
)
def test_allocator_matches_a_refcount_model(
    num_slots: int, seed: int | None, ops: list[tuple[str, int]]
) -> None:
    alloc = SlotAllocator(num_slots, seed=seed)
    model: dict[int, int] = {}
    for op, arg in ops:
        held = sorted(model)
        if op == "alloc":
            got = alloc.alloc(arg)
            if arg > num_slots - 1 - len(model):
                assert got is None
            else:
                assert got is not None and len(set(got)) == arg
                assert not set(got) & set(model) and 0 not in got
                model.update(dict.fromkeys(got, 1))
        elif held:
            slot = held[arg % len(held)]
            if op == "incref":
                alloc.incref([slot])
                model[slot] += 1
            else:
                freed = alloc.decref([slot])
                model[slot] -= 1
                assert freed == (model[slot] == 0)
                if model[slot] == 0:
                    del model[slot]
        alloc.check_integrity()
        assert alloc.num_held == len(model)
        assert alloc.num_free + alloc.num_held == num_slots - 1
        assert all(alloc.refcount(s) == r for s, r in model.items())


def test_row_allocator_lowest_first_and_integrity() -> None:
    rows = RowAllocator(4)
    assert [rows.alloc(), rows.alloc(), rows.alloc(), rows.alloc()] == [1, 2, 3, None]
    rows.free(2)
    assert rows.alloc() == 2
    with pytest.raises(ValueError, match="not in use"):
        rows.free(0)
    rows.free(1)
    with pytest.raises(ValueError, match="not in use"):
        rows.free(1)
    rows.check_integrity()
    assert rows.num_free == 1 and rows.num_used == 2
    with pytest.raises(ValueError, match="num_rows"):
        RowAllocator(1)


def test_list_table_write_read_clear() -> None:
    table = ListReqToTokenTable(3, 6)
    table.write(1, 2, [7, 8])
    assert table.read(1, 6) == [0, 0, 7, 8, 0, 0]
    assert table.nonzero_rows() == [1]
    with pytest.raises(IndexError):
        table.write(0, 0, [1])
    with pytest.raises(IndexError):
        table.write(2, 5, [1, 2])
    table.clear(1)
    assert table.nonzero_rows() == [] and table.shape == (3, 6)


def test_allocations_count_every_hand_out_of_a_slot() -> None:
    a = SlotAllocator(3)
    assert [a.allocations(s) for s in (1, 2)] == [0, 0]
    (s,) = a.alloc(1) or []
    a.incref([s])
    assert a.allocations(s) == 1  # a second reference is not a new owner
    a.decref([s])
    a.decref([s])
    a.reuse_first([s])
    assert a.alloc(1) == [s] and a.allocations(s) == 2
