"""RadixCache against a naive dict-of-prefixes model, plus walker and LRU specifics."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.contract import PrefixCacheWalker
from kvcanary.engine.radix_cache import RadixCache, RadixHandle
from kvcanary.engine.slot_allocator import SlotAllocator

Tokens = tuple[int, ...]


class Model:
    """Naive prefix cache: every cached prefix -> the slot of its last token."""

    def __init__(self) -> None:
        self.slot_of: dict[Tokens, int] = {}
        self.locks: list[tuple[RadixHandle, Tokens]] = []

    def longest(self, tokens: Tokens) -> int:
        n = 0
        while n < len(tokens) and tokens[: n + 1] in self.slot_of:
            n += 1
        return n

    def locked(self, key: Tokens) -> bool:
        return any(path[: len(key)] == key and len(key) <= len(path) for _, path in self.locks)


def check_against_model(cache: RadixCache, alloc: SlotAllocator, model: Model) -> None:
    cache.check_integrity()
    alloc.check_integrity()
    assert cache.cached_tokens == len(model.slot_of)
    assert alloc.num_held == len(model.slot_of), "a slot leaked or was freed early"
    key_of = {slot: key for key, slot in model.slot_of.items()}
    seen: set[int] = set()
    for slot, pos, prev in cache.walk():
        key = key_of[slot]
        assert pos == len(key) - 1
        assert prev == (model.slot_of[key[:-1]] if pos else -1)
        assert prev == -1 or prev in seen, "walk is not depth-first from the root"
        seen.add(slot)
    assert seen == set(key_of)
    unlocked = {slot for slot, _, _ in cache.walk(unlocked_only=True)}
    assert unlocked == {s for k, s in model.slot_of.items() if not model.locked(k)}
    assert cache.evictable_tokens == len(unlocked)
    assert {s for s, _, _ in cache.walk(swa_resident_only=True)} == seen


token_lists = st.lists(st.integers(0, 2), min_size=0, max_size=7).map(tuple)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), token_lists, st.booleans()),
        st.tuples(st.just("match"), token_lists, st.booleans()),
        st.tuples(st.just("unlock"), st.integers(0, 10), st.booleans()),
        st.tuples(st.just("evict"), st.integers(0, 12), st.booleans()),
    ),
    max_size=40,
)


@settings(max_examples=250, deadline=None)
@given(ops=ops)
def test_radix_cache_matches_naive_model(ops: list[tuple[str, object, bool]]) -> None:
    alloc = SlotAllocator(64)
    cache = RadixCache(alloc)
    model = Model()
    for op, arg, flag in ops:
        if op == "insert":
            assert isinstance(arg, tuple)
            # flag: reuse the matched prefix's slots (as a request does) instead of fresh ones
            matched, _ = cache.match_prefix(arg) if flag else ([], None)
            alloc.incref(matched)
            fresh = alloc.alloc(len(arg) - len(matched))
            if fresh is None:
                alloc.decref(matched)
                continue
            slots = [*matched, *fresh]
            already = model.longest(arg)
            assert cache.insert(arg, slots) == already
            for i in range(already, len(arg)):
                model.slot_of[arg[: i + 1]] = slots[i]
        elif op == "match":
            assert isinstance(arg, tuple)
            slots, handle = cache.match_prefix(arg)
            n = model.longest(arg)
            assert handle.length == n
            assert slots == [model.slot_of[arg[: i + 1]] for i in range(n)]
            if flag:
                cache.lock(handle)
                model.locks.append((handle, arg[:n]))
        elif op == "unlock" and model.locks:
            assert isinstance(arg, int)
            handle, _ = model.locks.pop(arg % len(model.locks))
            cache.unlock(handle)
        elif op == "evict":
            assert isinstance(arg, int)
            before = dict(model.slot_of)
            freed = cache.evict(arg)
            present = {s for s, _, _ in cache.walk()}
            removed = {k for k, s in before.items() if s not in present}
            for key in removed:
                del model.slot_of[key]
                assert not model.locked(key), "evicted a locked node"
            assert all(k[: i + 1] not in removed for k in model.slot_of for i in range(len(k)))
            assert freed == len(removed)
            assert freed >= arg or cache.evictable_tokens == 0
        check_against_model(cache, alloc, model)
    for handle, _ in model.locks:
        cache.unlock(handle)
    cache.evict(10**6)
    assert cache.cached_tokens == 0 and alloc.num_held == 0


def test_walk_after_split_keeps_positions_and_prev() -> None:
    alloc = SlotAllocator(32)
    cache = RadixCache(alloc)
    a = alloc.alloc(5)
    assert a is not None
    cache.insert([1, 2, 3, 4, 5], a)
    b = alloc.alloc(4)
    assert b is not None
    alloc.incref(a[:2])  # the caller holds the shared prefix, as a request does
    assert cache.insert([1, 2, 9, 9], [a[0], a[1], *b[2:]]) == 2  # consumes those refs
    alloc.decref(b[:2])  # the caller's unused fresh slots
    assert all(alloc.refcount(s) == 1 for s in [*a, *b[2:]]) and alloc.num_held == 7
    walk = cache.walk()
    assert walk == [
        (a[0], 0, -1),
        (a[1], 1, a[0]),
        (a[2], 2, a[1]),
        (a[3], 3, a[2]),
        (a[4], 4, a[3]),
        (b[2], 2, a[1]),
        (b[3], 3, b[2]),
    ]
    slots, handle = cache.match_prefix([1, 2, 3, 7])
    assert slots == a[:3] and handle.length == 3
    assert cache.walk() == walk  # the split in the middle of [3, 4, 5] changes nothing visible
    walker: PrefixCacheWalker = cache
    assert list(walker.walk(unlocked_only=True)) == walk


def test_lru_evicts_least_recently_used_leaf_first() -> None:
    alloc = SlotAllocator(32)
    cache = RadixCache(alloc)
    slots: dict[int, list[int]] = {}
    for t in (1, 2, 3):
        got = alloc.alloc(2)
        assert got is not None
        slots[t] = got
        cache.insert([t, t], got)
    cache.match_prefix([1, 1])  # refresh [1, 1]: [2, 2] is now the oldest, then [3, 3]

    def cached() -> set[int]:
        return {s for s, _, _ in cache.walk()}

    assert cache.evict(1) == 1  # only the tail of the oldest leaf goes
    assert cached() == {*slots[1], *slots[3], slots[2][0]}
    assert cache.evict(2) == 2  # what is left of [2, 2], then the tail of [3, 3]
    assert cached() == {*slots[1], slots[3][0]}


def test_locked_path_survives_eviction_and_parent_follows_leaf() -> None:
    alloc = SlotAllocator(32)
    cache = RadixCache(alloc)
    base = alloc.alloc(3)
    assert base is not None
    cache.insert([5, 6, 7], base)
    _, handle = cache.match_prefix([5, 6])
    cache.lock(handle)
    assert cache.evict(100) == 1  # only the unlocked tail [7]
    assert cache.protected_tokens == 2 and cache.evictable_tokens == 0
    cache.unlock(handle)
    assert cache.evict(100) == 2
    assert alloc.num_held == 0
    cache.check_integrity()
