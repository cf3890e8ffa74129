"""Radix prefix cache: token-id sequences -> KV slots (ints only).

Each non-root node holds a run of tokens (`key`) and the slots of their KV (`slots`, same
length). A path from the root spells a cached sequence; position `p` of that sequence lives in
the slot found at depth `p`. The tree owns one allocator reference per slot it stores.

Ownership rules, as seen by a caller:

| call | references |
|---|---|
| `match_prefix` | none taken; the caller increfs the returned slots if it keeps them |
| `insert` | consumes the caller's reference on every slot passed: new tokens are adopted, slots of the already-cached part are decref'd |
| `evict` | drops the tree's reference on each evicted slot |

`lock(handle)` adds one lock count on every node from the handle's node up to the root; locked
nodes are never evicted. Matches split nodes so that a handle always ends on a node boundary,
hence "locked" means exactly "a prefix of some locked match".
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvcanary.contract import walk_node_slots
from kvcanary.engine.plants import PlantSet
from kvcanary.engine.slot_allocator import SlotAllocator

__all__ = ["RadixCache", "RadixHandle"]


class _Node:
    """One run of tokens; internal to the cache."""

    __slots__ = (
        "children",
        "detached",
        "key",
        "last_access",
        "lock_ref",
        "node_id",
        "parent",
        "slots",
    )

    def __init__(
        self, key: list[int], slots: list[int], parent: _Node | None, node_id: int
    ) -> None:
        self.key = key
        self.slots = slots
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.node_id = node_id
        self.detached = False  # cut out of the tree by `evict_containing`; handles may remain


@dataclass(frozen=True, slots=True)
class RadixHandle:
    """Opaque result of a match: the node ending the match and the matched length."""

    node: _Node
    length: int


class RadixCache:
    """Radix tree over token ids with LRU eviction of unlocked leaves.

    Satisfies `kvcanary.contract.PrefixCacheWalker` through `walk`.
    """

    __slots__ = (
        "_allocator", "_cached", "_clock", "_ids", "_plants", "_protected", "_root",
        "evict_listener",
    )  # fmt: skip

    def __init__(self, allocator: SlotAllocator, plants: PlantSet | None = None) -> None:
        """An empty cache returning evicted slots to `allocator`; `plants` (tests and self-test
        campaigns only) may switch planted eviction bugs on."""
        self._allocator = allocator
        self._plants = plants if plants is not None else PlantSet()
        self._ids = itertools.count()
        self._root = _Node([], [], None, next(self._ids))
        self._root.lock_ref = 1  # the root is never evicted
        self._clock = 0
        self._cached = 0
        self._protected = 0
        #: called as `(path tokens, node tokens, node slots)` just before an evicted node's slots
        #: are released (a host tier backs the node up); None = no listener
        self.evict_listener: Callable[[list[int], list[int], list[int]], None] | None = None

    @property
    def cached_tokens(self) -> int:
        """Slots held by the tree."""
        return self._cached

    @property
    def protected_tokens(self) -> int:
        """Slots in locked nodes (not evictable)."""
        return self._protected

    @property
    def evictable_tokens(self) -> int:
        """Slots in unlocked nodes."""
        return self._cached - self._protected

    def match_prefix(self, tokens: Sequence[int]) -> tuple[list[int], RadixHandle]:
        """The slots of the longest cached prefix of `tokens`, and a handle for `lock`.

        Splits a node when the match ends inside it; refreshes LRU times along the path. Takes
        no reference: the slots stay valid only while the handle is locked.
        """
        node, pos, slots = self._descend(tokens)
        return slots, RadixHandle(node, pos)

    def insert(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        """Cache `tokens` -> `slots`, consuming the caller's reference on every slot.

        Slots of the part already cached are decref'd (the tree keeps its own); the rest become
        the tree's. Returns the length of the part that was already cached.
        """
        if len(tokens) != len(slots):
            raise ValueError(f"RadixCache.insert: {len(tokens)} tokens but {len(slots)} slots")
        node, pos, _ = self._descend(tokens)
        self._allocator.decref(slots[:pos])
        if pos < len(tokens):
            leaf = _Node(list(tokens[pos:]), list(slots[pos:]), node, next(self._ids))
            leaf.last_access = self._clock
            node.children[leaf.key[0]] = leaf
            self._cached += len(leaf.key)
        return pos

    def _descend(self, tokens: Sequence[int]) -> tuple[_Node, int, list[int]]:
        """Follow `tokens` down from the root: split a node the path ends inside, refresh LRU
        times along the way; returns the deepest node, the matched length and its slots."""
        self._clock += 1
        node, pos, slots = self._root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._clock
            slots.extend(child.slots)
            node, pos = child, pos + n
        return node, pos, slots

    def lock(self, handle: RadixHandle) -> None:
        """Protect the handle's path from eviction (counted; pair with `unlock`)."""
        node: _Node | None = handle.node
        while node is not None and node is not self._root:
            if node.lock_ref == 0:
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: RadixHandle) -> None:
        """Undo one `lock` of the same handle."""
        node: _Node | None = handle.node
        while node is not None and node is not self._root:
            if node.lock_ref <= 0:
                raise ValueError("RadixCache.unlock: node is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0 and not node.detached:
                self._protected -= len(node.key)
            node = node.parent

    def evict(self, num_slots: int) -> int:
        """Evict least-recently-used unlocked leaves until `num_slots` slots were freed or none
        is left; returns the number of slots freed. The last leaf may lose only its tail."""
        freed = 0
        if num_slots > 0 and self._plants.armed("radix_evict_locked"):
            freed += self._plant_evict_locked()
        heap = [(n.last_access, n.node_id, n) for n in self._nodes() if _evictable_leaf(n)]
        heapq.heapify(heap)
        while freed < num_slots and heap:
            _, _, leaf = heapq.heappop(heap)
            need = num_slots - freed
            if len(leaf.key) > need:  # evict only the tail; the prefix stays cached
                self._split(leaf, len(leaf.key) - need)
            if self._plants.enabled("prefix_reused_slots"):
                done = self._plant_evict_keep_linked(leaf)
                if done is not None:
                    freed += done
                    continue
            parent = leaf.parent
            assert parent is not None
            if self.evict_listener is not None:
                self.evict_listener(_path_tokens(leaf), leaf.key, leaf.slots)
            del parent.children[leaf.key[0]]
            self._cached -= len(leaf.key)
            freed += self._allocator.decref(leaf.slots)
            if parent is not self._root and _evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def evict_containing(self, slots: Sequence[int]) -> int:
        """Cut every node holding one of `slots` out of the tree, with all its descendants,
        locked or not (SPEC §14.3: failing slots and every node at or below them leave the
        cache). The tree drops its reference on their slots; requests holding them keep their
        own, and their handles stay valid for `unlock`. Returns the slots removed."""
        bad = {s for s in slots if s > 0}
        if not bad:
            return 0
        hits = [n for n in self._nodes() if not bad.isdisjoint(n.slots)]
        removed = 0
        for node in hits:
            if node.detached:
                continue  # already cut as a descendant of an earlier hit
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            stack = [node]
            while stack:
                n = stack.pop()
                n.detached = True
                self._cached -= len(n.key)
                if n.lock_ref > 0:
                    self._protected -= len(n.key)
                removed += len(n.slots)
                self._allocator.decref(n.slots)
                stack.extend(n.children.values())
        return removed

    def walk(
        self, *, unlocked_only: bool = False, swa_resident_only: bool = False
    ) -> list[tuple[int, int, int]]:
        """Every cached slot as `(slot, position, prev_slot)`, depth-first from the root
        (SPEC §2.5). `swa_resident_only` is accepted and ignored: this cache has no SWA part."""
        del swa_resident_only
        out: list[tuple[int, int, int]] = []
        stack: list[tuple[_Node, int, int]] = [(self._root, 0, -1)]
        while stack:
            node, depth, parent_last = stack.pop()
            if not (unlocked_only and node.lock_ref > 0):
                out.extend(walk_node_slots(node.slots, depth, parent_last))
            last = node.slots[-1] if node.slots else parent_last
            for child in reversed(node.children.values()):
                stack.append((child, depth + len(node.slots), last))
        return out

    def check_integrity(self) -> None:
        """Raise AssertionError on a malformed tree, wrong counters or a slot the allocator does
        not hold."""
        seen: set[int] = set()
        cached = protected = 0
        for node in self._nodes():
            assert node.key and len(node.key) == len(node.slots), "empty or ragged node"
            parent = node.parent
            assert parent is not None and parent.children.get(node.key[0]) is node, "bad parent"
            assert node.lock_ref >= 0, "negative lock count"
            assert parent is self._root or parent.lock_ref >= node.lock_ref, "lock not on path"
            for slot in node.slots:
                assert slot not in seen, f"slot {slot} cached twice"
                assert self._allocator.refcount(slot) >= 1, f"cached slot {slot} is free"
                seen.add(slot)
            cached += len(node.key)
            protected += len(node.key) if node.lock_ref > 0 else 0
        assert cached == self._cached, f"cached_tokens {self._cached} != {cached}"
        assert protected == self._protected, f"protected_tokens {self._protected} != {protected}"

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child` after `n` tokens; the new upper node is returned, `child` keeps the tail
        (so handles to `child` stay valid) and both keep its lock count."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = _Node(child.key[:n], child.slots[:n], parent, next(self._ids))
        if child.node_id in self._plants.ghost_nodes:
            self._plants.ghost_nodes.add(upper.node_id)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[upper.key[0]] = upper
        child.key, child.slots, child.parent = child.key[n:], child.slots[n:], upper
        upper.children[child.key[0]] = child
        return upper

    # ---- planted bugs (engine/plants.py); reached only when a plant is configured -----------

    def _plant_evict_locked(self) -> int:
        """`radix_evict_locked`: evict a locked leaf as if its lock were 0, and free its slots
        although running requests still read them. Returns the slots freed (0 when no leaf
        locked by a running request exists; then nothing fires)."""
        plants = self._plants
        # held by requests already running: not touched by the match of the admission that
        # is asking for slots now (evicting that one would harm nobody)
        locked = sorted(
            (
                n
                for n in self._nodes()
                if not n.children and n.lock_ref > 0 and n.last_access < self._clock
            ),
            key=lambda n: n.node_id,
        )
        if not locked:
            return 0
        leaf = plants.rng("radix_evict_locked").choice(locked)
        depth = _depth(leaf)
        positions = list(range(depth, depth + len(leaf.slots)))
        row = plants.find_row(leaf.slots[0], depth)
        plants.record(
            "radix_evict_locked",
            slots=leaf.slots,
            row=row,
            positions=positions,
            description=f"evicted radix node {leaf.node_id} with lock_ref={leaf.lock_ref} and "
            f"freed its {len(leaf.slots)} slots (depth {depth}) while row {row} still maps them",
        )
        parent = leaf.parent
        assert parent is not None
        del parent.children[leaf.key[0]]
        self._cached -= len(leaf.key)
        return plants.force_free(leaf.slots)

    def _plant_evict_keep_linked(self, leaf: _Node) -> int | None:
        """`prefix_reused_slots`: free `leaf`'s slots but leave it linked, like a host-backed
        node whose device slots were evicted, so a later match (and every sweep) returns freed,
        reused slots. Returns the slots freed, or None when the normal eviction should run (the
        plant is not armed). A node left linked earlier is skipped (its slots are gone)."""
        plants = self._plants
        if leaf.node_id in plants.ghost_nodes:
            return 0
        if not plants.armed("prefix_reused_slots"):
            return None
        depth = _depth(leaf)
        positions = list(range(depth, depth + len(leaf.slots)))
        plants.record(
            "prefix_reused_slots",
            slots=leaf.slots,
            row=0,
            positions=positions,
            description=f"freed the {len(leaf.slots)} slots of radix leaf {leaf.node_id} (depth "
            f"{depth}) but left it linked: matches and sweeps still return them",
        )
        plants.ghost_nodes.add(leaf.node_id)
        plants.ghost_slots.update(zip(leaf.slots, positions, strict=True))
        return self._allocator.decref(leaf.slots)

    def _nodes(self) -> Iterator[_Node]:
        """Every non-root node, depth-first."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _common_len(key: Sequence[int], tokens: Sequence[int], start: int) -> int:
    """Length of the common prefix of `key` and `tokens[start:]`."""
    n = min(len(key), len(tokens) - start)
    i = 0
    while i < n and key[i] == tokens[start + i]:
        i += 1
    return i


def _depth(node: _Node) -> int:
    """Position of the node's first token: the key lengths of its ancestors, summed."""
    depth, parent = 0, node.parent
    while parent is not None:
        depth += len(parent.key)
        parent = parent.parent
    return depth


def _path_tokens(node: _Node) -> list[int]:
    """The tokens of the node's ancestors, root first (the sequence above the node)."""
    parts: list[list[int]] = []
    parent = node.parent
    while parent is not None:
        parts.append(parent.key)
        parent = parent.parent
    return [t for key in reversed(parts) for t in key]


def _evictable_leaf(node: _Node) -> bool:
    return not node.children and node.lock_ref == 0
