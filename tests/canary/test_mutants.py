"""Tests aimed at detector bugs the rest of the suite would not notice (issue 12):

(a) raise mode raising again after it tripped, with room left in the ring;
(b) exactly one wrong entry in a long consecutive run, for every shape the fast kernel's
    vectorised consecutive-slot verify path takes (so the batch has no other violation and does
    not fall back to the exact path for another reason), and one chain-position gap in each
    lockstep variant of the fast write;
(c) PARTIAL hashing exactly the first 16 bytes of each tile (a flip at bytes 16-31 is not
    reported; the stored hash is the fold of bytes 0-15).
"""

from __future__ import annotations

import logging
from typing import Any

import numba
import numpy as np
import pytest

from kvcanary.canary import CanaryMode, CanaryViolationError
from kvcanary.canary.hashing import MASK64, mix3, splitmix64
from kvcanary.canary.kernels import fast, reference
from kvcanary.canary.sources import FoldSources
from tests.canary.conftest import MakeCanary, forward
from tests.canary.handpool import BYTES_PER_TOKEN

# ------------------------------------------------------------------------------ (a) raise once


def test_raise_mode_raises_once_even_with_room_in_the_ring(
    make_canary: MakeCanary, caplog: pytest.LogCaptureFixture
) -> None:
    pool, canary = make_canary(mode=CanaryMode.RAISE, ring_capacity=64, read_bytes=None)
    forward(pool, canary, pool.view([(1, [1, 2, 3, 4])]))
    head = canary.group("full").buffer("head", "k")
    head[2, 8] ^= 1  # position of slot 2
    with pytest.raises(CanaryViolationError) as err:
        canary.pre_forward(view=pool.view([(1, [5])]))
    first = canary.total_violations
    assert str(err.value).count("kv_canary violation:") == first >= 1
    head[3, 8] ^= 1  # a second, different violation, with plenty of free rows in the ring
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        forward(pool, canary, pool.view([(2, [7])]))  # tripped: must not raise again
        canary.pre_forward(view=pool.view([(1, [6])]))  # row 1's prefix holds both violations
    assert first < canary.total_violations < canary.ring.capacity
    logged = [m for m in caplog.messages if m.startswith("kv_canary violation:")]
    assert len(logged) == canary.total_violations - first
    assert any("slot_idx=3 " in m for m in logged)


# ------------------------------------------------------------------- (b) one wrong entry, fast path

CHUNK = 256  # fast_verify._CHUNK


def clean_run(n: int, first_slot: int, head_prev: int) -> dict[str, Any]:
    """A buffer with one request's chain of `n` records at consecutive slots from `first_slot`,
    written by the fast kernel, and the verify entries of that chain (prev = slot before, the
    head's prev `head_prev`: -1 for a chain head, 0 for an unreachable predecessor)."""
    num_slots = first_slot + n + 3
    buf = np.zeros((num_slots, 4), dtype=np.uint64)
    slots = np.arange(first_slot, first_slot + n, dtype=np.int64)
    tokens = (np.arange(n, dtype=np.int64) * 7919) % 50_000 + 1
    positions = np.arange(n, dtype=np.int64)
    src = FoldSources.empty()
    ring = np.zeros((4, 8), dtype=np.uint64)
    state = np.zeros(1, dtype=np.int64)
    fast.write(
        buf, np.array([-1]), np.array([0, n]), slots, False, tokens, positions, False, tokens,
        positions, True, *src.words, src.params, src.count, 2, ring, state,
    )  # fmt: skip
    assert int(state[0]) == 0
    prev = np.concatenate([[head_prev], slots[:-1]]).astype(np.int64)
    return {"buf": buf, "slot": slots, "prev": prev, "pos": positions, "tok": tokens.copy()}


def verify_rows(kernels: Any, case: dict[str, Any]) -> list[list[int]]:
    src = FoldSources.empty()
    ring = np.zeros((8, 8), dtype=np.uint64)
    state = np.zeros(1, dtype=np.int64)
    kernels.verify(
        case["buf"], case["slot"], case["prev"], case["pos"], case["tok"], *src.words,
        src.params, src.count, 8, ring, state,
    )  # fmt: skip
    return ring[: int(state[0])].astype(np.int64).tolist()


# Shapes of the consecutive path: one chunk or several, a full or a partial last chunk, runs
# starting at slot 1 (row 0 is then the row before) or higher, a chain head (prev -1) or an
# unreachable head (prev 0).
SHAPES = [
    (CHUNK, 1, -1),
    (CHUNK, 9, 0),
    (3 * CHUNK, 1, -1),
    (3 * CHUNK + 77, 5, -1),
    (2 * CHUNK + 1, 2, 0),
    (CHUNK + 200, 300, -1),
]
WHERE = ["first", "second", "middle", "chunk_end", "chunk_start", "last"]
FIELDS = ["chain", "position", "token", "real_kv", "expected_pos", "expected_tok", "prev_wrong"]


def entry_index(n: int, where: str) -> int:
    return {
        "first": 0,
        "second": 1,
        "middle": n // 2,
        "chunk_end": min(CHUNK - 1, n - 1),
        "chunk_start": CHUNK if n > CHUNK else n - 1,
        "last": n - 1,
    }[where]


def plant(case: dict[str, Any], k: int, field: str) -> None:
    """Make entry `k` (and only it) wrong through `field`."""
    slot = int(case["slot"][k])
    buf = case["buf"]
    if field == "chain":  # the stored chain hash; entry k+1 hashes row k, so change the hash only
        buf[slot, 2] ^= np.uint64(1 << 40)
        if k + 1 < len(case["slot"]):
            # keep entry k+1 valid: its stored prev hash follows row k's new content
            nxt = int(case["slot"][k + 1])
            buf[nxt, 2] = np.uint64(mix3(int(buf[slot, 2]), int(buf[slot, 0]), int(buf[slot, 1])))
            if k + 2 < len(case["slot"]):
                case["prev"][k + 2] = 0  # row k+1 changed too: stop the chain check after it
    elif field == "position":
        buf[slot, 1] += np.uint64(1)
        if k + 1 < len(case["slot"]):
            case["prev"][k + 1] = 0
    elif field == "token":
        buf[slot, 0] += np.uint64(1)
        if k + 1 < len(case["slot"]):
            case["prev"][k + 1] = 0
    elif field == "real_kv":
        buf[slot, 3] = np.uint64(5)  # no sources: the fold is 0
    elif field == "expected_pos":
        case["pos"][k] += 1
    elif field == "expected_tok":
        case["tok"][k] += 1
    else:  # prev names the wrong row, still inside the group (not consecutive: exact path)
        case["prev"][k] = int(case["slot"][k]) + 1


@pytest.mark.parametrize(("n", "first", "head_prev"), SHAPES)
@pytest.mark.parametrize("field", FIELDS)
def test_one_wrong_entry_in_a_long_consecutive_run(
    n: int, first: int, head_prev: int, field: str
) -> None:
    base = clean_run(n, first, head_prev)
    assert verify_rows(fast, base) == [] == verify_rows(reference, base)
    for where in WHERE:
        if field == "chain" and head_prev == 0 and where == "first":
            continue  # an unreachable head's chain hash is never checked (SPEC §5.3)
        case = {k: v.copy() for k, v in base.items()}
        k = entry_index(n, where)
        plant(case, k, field)
        rows = verify_rows(reference, case)
        assert len(rows) == 1 and rows[0][1] == int(case["slot"][k]), (where, rows)
        assert verify_rows(fast, case) == rows, where


def lockstep_case(streamed: bool, track: bool, gap_lane: int) -> dict[str, Any]:
    """Four requests of 300 entries per thread (all four lanes of each task advance in lockstep),
    consecutive or scattered slots, chain-position assert on (`track`: seeded chains) or off,
    and one position gap in lane `gap_lane`."""
    nreq, per = 4 * numba.get_num_threads(), 300
    total = nreq * per
    rng = np.random.default_rng(7)
    slots = np.arange(1, total + 1, dtype=np.int64)
    if not streamed:
        slots = rng.permutation(slots)
    num_slots = total + nreq + 2
    buf = np.zeros((num_slots, 4), dtype=np.uint64)
    seeds = np.full(nreq, -1, dtype=np.int64)
    positions = np.tile(np.arange(per, dtype=np.int64), nreq)
    if track:  # seeded chains: seed slot s holds position -1 + start
        seeds[:] = np.arange(total + 1, total + 1 + nreq)
        for r in range(nreq):
            buf[seeds[r], 1] = np.uint64(100 * r + 9)
            positions[r * per : (r + 1) * per] += 100 * r + 10
    positions[gap_lane * per + 150] += 3
    return {
        "buf": buf,
        "seeds": seeds,
        "offsets": np.arange(0, total + 1, per, dtype=np.int64),
        "slots": slots,
        "ids": rng.integers(0, 1000, size=total).astype(np.int64),
        "positions": positions,
    }


def write_rows(kernels: Any, case: dict[str, Any]) -> tuple[bytes, list[list[int]]]:
    buf = case["buf"].copy()
    src = FoldSources.empty()
    ring = np.zeros((8, 8), dtype=np.uint64)
    state = np.zeros(1, dtype=np.int64)
    kernels.write(
        buf, case["seeds"], case["offsets"], case["slots"], False, case["ids"],
        case["positions"], False, case["ids"], case["positions"], True, *src.words, src.params,
        src.count, 2, ring, state,
    )  # fmt: skip
    return buf.tobytes(), ring[: int(state[0])].astype(np.int64).tolist()


@pytest.mark.parametrize("streamed", [True, False])
@pytest.mark.parametrize("gap_lane", [0, 3])
def test_one_chain_position_gap_in_each_lockstep_variant(streamed: bool, gap_lane: int) -> None:
    for track in (True, False):
        case = lockstep_case(streamed, track, gap_lane)
        got = write_rows(fast, case)
        assert got == write_rows(reference, case)
        assert len(got[1]) == (2 if track else 0)  # the gap and the entry after it


# --------------------------------------------------------------------- (c) PARTIAL is 16 bytes


def fold16(tile: bytes) -> int:
    """SPEC §4's fold_sources over one source under PARTIAL: bytes 0-15 only."""
    lo, hi = int.from_bytes(tile[0:8], "little"), int.from_bytes(tile[8:16], "little")
    one = splitmix64(splitmix64(lo) ^ hi)
    return splitmix64(one) & MASK64


@pytest.mark.parametrize("flip", [16, 23, 31])
def test_partial_ignores_bytes_16_to_31_and_stores_the_16_byte_fold(
    make_canary: MakeCanary, flip: int
) -> None:
    assert BYTES_PER_TOKEN == 32
    pool, canary = make_canary(read_bytes=32)  # the source offers 32 bytes; PARTIAL reads 16
    forward(pool, canary, pool.view([(1, [1, 2, 3])]))
    tail = canary.group("full").buffer("tail", "k").view(np.uint64)
    for slot in (1, 2, 3):
        assert int(tail[slot, 3]) == fold16(bytes(pool.k[slot].tolist()))
    pool.k[2, flip] ^= 0x40  # outside PARTIAL's window: not hashed, not reported
    forward(pool, canary, pool.view([(1, [4])]))
    assert canary.total_violations == 0
    pool.k[2, flip - 16] ^= 0x40  # the same flip inside the window is caught
    forward(pool, canary, pool.view([(1, [5])]))
    assert canary.total_violations == 1
    assert canary.drain_violations()[0].slot_idx == 2


def test_fold16_matches_the_spec_vector() -> None:
    assert fold16(bytes(range(16)) + bytes(16)) == 0xD6D75024DFD6C30C  # SPEC §4.1 V4b
