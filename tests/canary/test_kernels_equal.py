"""The numba kernels are byte-equal to the plain reference on random batches.

Covers padding rows, slot -1 writes, slot 0, SWA windows and LUTs with evicted (0) entries, up to
four real-KV sources of different layouts, verify overflow and a filling ring.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcanary.canary.config import RealDataMode
from kvcanary.canary.kernels import fast, reference
from kvcanary.canary.sources import FoldSources
from kvcanary.contract import RealKvSource

#: the fast kernels' one-thread twins, under the names `run` calls
FAST_SERIAL = SimpleNamespace(
    build_plan=fast.build_plan, verify=fast.verify_serial, write=fast.write_serial
)
#: a stage's verify and write in one call (`run` calls `stage` when a namespace has one)
FAST_STAGE = SimpleNamespace(build_plan=fast.build_plan, stage=fast.stage_serial)
REFERENCE_STAGE = SimpleNamespace(build_plan=reference.build_plan, stage=reference.stage_serial)


@st.composite
def batches(draw: st.DrawFn) -> dict[str, Any]:
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n_full = draw(st.integers(2, 48))
    use_lut = draw(st.booleans())
    n_group = draw(st.integers(2, 48)) if use_lut else n_full
    nrows_table, ncols = draw(st.integers(2, 6)), draw(st.integers(1, 12))
    r2t = rng.integers(0, n_full, size=(nrows_table, ncols)).astype(
        draw(st.sampled_from([np.int32, np.int64]))
    )
    n_active = draw(st.integers(0, nrows_table - 1))
    rows = list(rng.permutation(np.arange(1, nrows_table))[:n_active]) + [0] * draw(
        st.integers(0, 2)
    )
    prefix, extend = [], []
    for row in rows:
        p = int(rng.integers(0, ncols + 1)) if row else int(rng.integers(0, 5))
        prefix.append(p)
        extend.append(int(rng.integers(-1, ncols - p + 1)) if row else int(rng.integers(-1, 3)))
    wl = sum(max(e, 0) for r, e in zip(rows, extend, strict=True) if r)
    num_tokens = wl + draw(st.integers(0, 3))
    # Distinct positive write slots per forward (an engine never writes one slot twice), plus -1 and 0.
    fresh = list(rng.permutation(np.arange(1, n_full)))
    out = [
        int(rng.choice([-1, 0])) if rng.random() < 0.2 or not fresh else int(fresh.pop())
        for _ in range(num_tokens)
    ]
    lut = np.zeros(0, dtype=np.int64)
    if use_lut:
        targets = rng.permutation(np.arange(1, max(n_group, n_full + 1)))[:n_full] % n_group
        lut = np.where(rng.random(n_full) < 0.25, 0, targets).astype(np.int64)
        lut[0] = 0
        # injective on nonzero values so two writes never land on one SWA slot
        _, first = np.unique(lut, return_index=True)
        keep = np.zeros(n_full, dtype=bool)
        keep[first] = True
        lut[~keep] = 0
        if draw(st.integers(0, 9)) == 0:
            lut = lut[: n_full // 2]  # the upper full slots fall outside the table: an error
    n_sources = draw(st.integers(0, 4))
    sources = []
    for _ in range(n_sources):
        page = draw(st.integers(1, 3))
        nbpt = draw(st.sampled_from([16, 32]))
        extra = draw(st.sampled_from([0, 16]))
        rows_needed = (n_group + page - 1) // page
        tensor = torch.from_numpy(
            rng.integers(0, 256, size=(rows_needed, page * nbpt + extra), dtype=np.uint8)
        )
        sources.append(RealKvSource(tensor, page, nbpt, draw(st.sampled_from([16, nbpt]))))
    mode = draw(st.sampled_from([RealDataMode.PARTIAL, RealDataMode.ALL]))
    truth_w = draw(st.integers(0, ncols))
    return {
        "rows": np.array(rows, dtype=np.int64),
        "prefix": np.array(prefix, dtype=np.int64),
        "extend": np.array(extend, dtype=np.int64),
        "r2t": r2t,
        "out": np.array(out, dtype=np.int64),
        "lut": lut,
        "use_lut": use_lut,
        "window": draw(st.sampled_from([1 << 62, 1, 2, 5])) if use_lut else 1 << 62,
        "num_slots": n_group,
        # int32: an engine's own token table, passed to the plan builder as it is (TruthTable)
        "truth": rng.integers(0, 50, size=(len(rows) + draw(st.integers(0, 2)), truth_w)).astype(
            draw(st.sampled_from([np.int32, np.int64]))
        ),
        "truth_lens": rng.integers(0, truth_w + 2, size=len(rows)).astype(np.int64),
        "offset": draw(st.sampled_from([0, 1])),
        "verify_capacity": draw(st.sampled_from([10_000, 3])),
        "records": rng.integers(0, 2**63, size=(n_group, 4), dtype=np.int64)
        % draw(st.sampled_from([4, 2**62])),
        "ids": rng.integers(0, 6, size=num_tokens).astype(np.int64),
        "positions": rng.integers(0, 6, size=num_tokens).astype(np.int64),
        "exp_tok": rng.integers(0, 6, size=num_tokens).astype(np.int64),
        "exp_pos": rng.integers(0, 6, size=num_tokens).astype(np.int64),
        "write_assert": draw(st.booleans()),
        "chain_position": draw(st.booleans()),
        "sources": FoldSources.build(sources, mode),
        "ring_capacity": draw(st.integers(1, 40)),
        "tag": draw(st.sampled_from([2, 8])),
        **stride_and_phase(draw),
    }


def stride_and_phase(draw: st.DrawFn) -> dict[str, int]:
    """A verify stride (mostly 1, the default) and one of its phases."""
    stride = draw(st.sampled_from([1, 1, 2, 3]))
    return {"stride": stride, "phase": draw(st.integers(0, stride - 1))}


def run(kernels: Any, b: dict[str, Any]) -> dict[str, Any]:
    plan = kernels.build_plan(
        b["rows"], b["prefix"], b["extend"], b["r2t"], b["out"], b["lut"], b["use_lut"],
        b["window"], b["num_slots"], b["truth"], b["truth_lens"], b["offset"], b["verify_capacity"],
        np.full(b["num_slots"], -1, dtype=np.int64), b["stride"], b["phase"],
    )  # fmt: skip
    if int(plan[9][0]) != 0:
        return {"error": np.asarray(plan[9]).tolist()}  # arrays are unspecified on error
    result: dict[str, Any] = {"plan": [np.asarray(x).tolist() for x in plan]}
    ro, seeds, ws, vs, vp, vpos, vt, _total, overflow, _err, shadowed = plan
    buf = b["records"].copy().view(np.uint64)
    ring = np.zeros((b["ring_capacity"], 8), dtype=np.int64)
    state = np.zeros(1, dtype=np.int64)
    src = b["sources"]
    words, ring_words = (*src.words, src.params, src.count), ring.view(np.uint64)
    if hasattr(kernels, "stage"):
        result["verified"] = int(kernels.stage(
            buf, vs, vp, vpos, vt, not overflow, seeds, ro, ws, shadowed, b["ids"], b["positions"],
            b["write_assert"], b["exp_tok"], b["exp_pos"], b["chain_position"], *words, b["tag"],
            ring_words, state,
        ))  # fmt: skip
    else:
        if not overflow:
            kernels.verify(buf, vs, vp, vpos, vt, *words, b["tag"], ring_words, state)
        result["verified"] = int(state[0])  # the write index after the verify pass
        kernels.write(
            buf, seeds, ro, ws, shadowed, b["ids"], b["positions"], b["write_assert"], b["exp_tok"],
            b["exp_pos"], b["chain_position"], *words, b["tag"], ring_words, state,
        )  # fmt: skip
    # Row 0 may be written by several requests in one forward; it is never read.
    result.update(buf=buf[1:].tobytes(), ring=ring.tobytes(), state=int(state[0]))
    return result


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_fast_and_reference_kernels_are_byte_equal(b: dict[str, Any]) -> None:
    expected = run(reference, b)
    assert run(fast, b) == expected
    assert run(FAST_SERIAL, b) == expected
    assert run(FAST_STAGE, b) == expected  # one call: the same buffer, ring and verify rows
    assert run(REFERENCE_STAGE, b) == expected


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_packed_plan_holds_the_plan_arrays(b: dict[str, Any]) -> None:
    """`build_plan_packed` (the runtime's call) is `build_plan` with its seven arrays laid end
    to end, for both implementations: same arrays, scalars, error and records-written count."""
    args = (b["rows"], b["prefix"], b["extend"], b["r2t"], b["out"], b["lut"], b["use_lut"],
            b["window"], b["num_slots"], b["truth"], b["truth_lens"], b["offset"],
            b["verify_capacity"])  # fmt: skip
    thin = (b["stride"], b["phase"])
    for kernels in (fast, reference):
        plan = kernels.build_plan(*args, np.full(b["num_slots"], -1, dtype=np.int64), *thin)
        buf, nr, nw, nv, total_v, overflow, kind, value, shadowed, writes = (
            kernels.build_plan_packed(*args, np.full(b["num_slots"], -1, dtype=np.int64), *thin)
        )
        assert [int(kind), int(value)] == np.asarray(plan[9]).astype(int).tolist()
        if kind != 0:
            continue  # arrays are unspecified on error
        arrays = [np.asarray(a).tolist() for a in plan[:7]]
        assert (nr, nw, nv) == (len(arrays[1]), len(arrays[2]), len(arrays[3]))
        assert np.asarray(buf).tolist() == [x for a in arrays for x in a]
        assert (int(total_v), bool(overflow), bool(shadowed)) == (plan[7], plan[8], plan[10])
        assert int(writes) == sum(1 for s in arrays[2] if s >= 0)


def test_generator_reaches_the_interesting_cases() -> None:
    """Guard against a vacuous property: the strategy produces violations, overflows and errors."""
    seen = {"violations": 0, "overflow": 0, "error": 0, "ring_full": 0, "uniform": 0,
            "per_source": 0}  # fmt: skip

    @settings(max_examples=300, deadline=None, database=None, derandomize=True)
    @given(batches())
    def probe(b: dict[str, Any]) -> None:
        r = run(fast, b)
        if b["sources"].count:  # both fold paths of the kernels (`FoldSources` params column 4)
            seen["uniform" if b["sources"].params[0, 4] else "per_source"] += 1
        if "error" in r:
            seen["error"] += 1
            return
        seen["overflow"] += bool(r["plan"][8])
        seen["violations"] += r["state"] > 0
        seen["ring_full"] += r["state"] > b["ring_capacity"]

    probe()
    assert all(v > 0 for v in seen.values()), seen


@settings(max_examples=100, deadline=None)
@given(
    pages=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    nbpts=st.lists(st.sampled_from([16, 32]), min_size=4, max_size=4),
    reads=st.lists(st.sampled_from([16, 32]), min_size=4, max_size=4),
    mode=st.sampled_from([RealDataMode.PARTIAL, RealDataMode.ALL]),
)
def test_sources_take_the_one_geometry_fold_exactly_when_they_share_it(
    pages: list[int], nbpts: list[int], reads: list[int], mode: RealDataMode
) -> None:
    """`params[:, 4]` (the kernels' one-page-geometry fold) is 1 exactly when every source has
    one power-of-two page size and 16 bytes are read; words per token may differ."""
    sources = [
        RealKvSource(torch.zeros(4, page * nbpt, dtype=torch.uint8), page, nbpt, min(read, nbpt))
        for page, nbpt, read in zip(pages, nbpts, reads, strict=False)
    ]
    params = FoldSources.build(sources, mode).params
    reads_16 = [16 if mode is RealDataMode.PARTIAL else s.read_bytes for s in sources]
    same = len(set(pages)) == 1 and set(reads_16) == {16}
    expected = same and pages[0] & (pages[0] - 1) == 0
    assert params[:, 4].tolist() == [int(expected)] * len(params)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(1, 4), page=st.sampled_from([1, 2, 32]),
       entries=st.integers(1, 700), corrupt=st.integers(0, 3),
       widths=st.lists(st.sampled_from([16, 32, 128]), min_size=4, max_size=4))  # fmt: skip
def test_one_geometry_fold_equals_the_per_source_fold(
    seed: int, count: int, page: int, entries: int, corrupt: int, widths: list[int]
) -> None:
    """Verify and write with `count` sources of one page geometry (vLLM's heads of one layer;
    on CPU a 16-byte K mirror beside token-major V heads, so bytes per token differ): the
    kernels' one-page-geometry path leaves the buffers and rings the reference leaves, over
    hundreds of entries (the four-at-a-time loops) with a few corrupted KV bytes."""
    rng = np.random.default_rng(seed)
    num_slots = 1 + entries + int(rng.integers(0, 40))
    rows = (num_slots + page - 1) // page
    widths = widths[:count]
    tensors = [torch.from_numpy(rng.integers(0, 256, size=(rows, page * w), dtype=np.uint8))
               for w in widths]  # fmt: skip
    src = FoldSources.build(
        [RealKvSource(t, page, w, w) for t, w in zip(tensors, widths, strict=True)],
        RealDataMode.PARTIAL,
    )
    assert src.params[0, 4] == 1
    slots = rng.permutation(np.arange(1, num_slots))[:entries].astype(np.int64)
    zeros, ones = np.zeros(1, dtype=np.int64), np.full(1, -1, dtype=np.int64)
    outputs = []
    for kernels in (reference, fast, FAST_SERIAL):
        buf = np.zeros((num_slots, 4), dtype=np.uint64)
        ring = np.zeros((8, 8), dtype=np.uint64)
        state = np.zeros(1, dtype=np.int64)
        args = (*src.words, src.params, src.count, 2, ring, state)
        ids, pos = slots % 97, np.arange(len(slots), dtype=np.int64)
        kernels.write(buf, ones, np.array([0, len(slots)]), slots, False, ids, pos, False, zeros,
                      zeros, False, *args)  # fmt: skip
        for t, w in zip(tensors[:corrupt], widths, strict=False):  # flip a tile byte after write
            s = int(slots[len(slots) // 2])
            t[s // page, (s % page) * w] ^= 1
        prevs = np.concatenate([[-1], slots[:-1]])
        kernels.verify(buf, slots, prevs, pos, ids, *args)
        for t, w in zip(tensors[:corrupt], widths, strict=False):
            s = int(slots[len(slots) // 2])
            t[s // page, (s % page) * w] ^= 1
        outputs.append((buf.tobytes(), ring.tobytes(), int(state[0])))
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
    assert outputs[0][2] == min(corrupt, 1)  # one entry's fold differs when any source changed


def verify_rings(
    buf: np.ndarray, slots: np.ndarray, prevs: np.ndarray, pos: np.ndarray, tok: np.ndarray,
    src: FoldSources, *, ring_rows: int,
) -> list[tuple[bytes, int]]:  # fmt: skip
    """(ring bytes, violations) of one verify pass (tag 2) by the reference, the fast and the
    fast serial kernel, in that order, each into a fresh ring of `ring_rows` rows."""
    rings = []
    for verify in (reference.verify, fast.verify, fast.verify_serial):
        ring = np.zeros((ring_rows, 8), dtype=np.uint64)
        state = np.zeros(1, dtype=np.int64)
        verify(buf, slots, prevs, pos, tok, *src.words, src.params, src.count, 2, ring, state)
        rings.append((ring.tobytes(), int(state[0])))
    return rings


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), entries=st.integers(1, 600), sources=st.integers(0, 2))
def test_a_strided_record_buffer_verifies_like_the_reference(
    seed: int, entries: int, sources: int
) -> None:
    """A record buffer that is a strided view (not the canary's own C-contiguous layout, where
    the verify loops index one flat array) gives the reference's ring."""
    rng = np.random.default_rng(seed)
    num_slots = entries + 8
    wide = rng.integers(0, 4, size=(num_slots, 5)).astype(np.uint64)  # words 0..3: few values
    buf = wide[:, :4]
    assert not buf.flags.c_contiguous
    tensors = [torch.from_numpy(rng.integers(0, 256, size=(num_slots, 32), dtype=np.uint8))
               for _ in range(sources)]  # fmt: skip
    src = FoldSources.build([RealKvSource(t, 1, 32, 16) for t in tensors], RealDataMode.PARTIAL)
    slots = rng.integers(0, num_slots, size=entries).astype(np.int64)
    prevs = np.where(rng.random(entries) < 0.3, rng.integers(-1, 1, size=entries),
                     np.concatenate([[-1], slots[:-1]])).astype(np.int64)  # fmt: skip
    pos = rng.integers(0, 4, size=entries).astype(np.int64)
    tok = rng.integers(-1, 4, size=entries).astype(np.int64)
    rings = verify_rings(buf, slots, prevs, pos, tok, src, ring_rows=700)
    assert rings[1] == rings[0] and rings[2] == rings[0]


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), entries=st.integers(2, 900),
       fault=st.sampled_from(["token", "position", "chain", "real_kv", "head"]),
       consecutive=st.booleans(), data=st.data())  # fmt: skip
def test_a_lone_violation_among_clean_entries_is_found_in_every_verify_path(
    seed: int, entries: int, fault: str, consecutive: bool, data: st.DataObject
) -> None:
    """One bad entry among hundreds of clean ones, in scattered or consecutive slots (the
    gather and unit-stride loops): the fast kernels only count violations in parallel and
    record them in a second pass, so a loop that misses the lone one records nothing."""
    rng = np.random.default_rng(seed)
    num_slots = entries + 2
    order = np.arange(1, entries + 1) if consecutive else rng.permutation(entries) + 1
    slots = order.astype(np.int64)
    prevs = np.concatenate([[-1], slots[:-1]]).astype(np.int64)
    pos = np.arange(entries, dtype=np.int64)
    tok = rng.integers(0, 1000, size=entries).astype(np.int64)
    buf = np.zeros((num_slots, 4), dtype=np.uint64)
    ring = np.zeros((4, 8), dtype=np.uint64)
    state = np.zeros(1, dtype=np.int64)
    src = FoldSources.empty()
    z = np.zeros(entries, dtype=np.int64)
    reference.write(buf, np.full(1, -1, dtype=np.int64), np.array([0, entries]), slots, False,
                    tok, pos, False, z, z, False, *src.words, src.params, src.count, 2, ring,
                    state)  # fmt: skip
    assert int(state[0]) == 0
    i = data.draw(st.integers(0, entries - 1), label="bad entry")
    if fault == "token":
        tok = tok.copy()
        tok[i] += 1
    elif fault == "position":
        pos = pos.copy()
        pos[i] += 1
    elif fault == "chain":  # the predecessor's record changed: entry i's chain hash fails
        i = max(i, 1)
        buf[slots[i - 1], 0] ^= np.uint64(1 << 40)
    elif fault == "real_kv":
        buf[slots[i], 3] = np.uint64(7)
    else:  # a chain head whose stored PREV_HASH is not HEAD_HASH
        i = 0
        buf[slots[0], 2] ^= np.uint64(1)
    rings = verify_rings(buf, slots, prevs, pos, tok, src, ring_rows=4)
    assert rings[0][1] >= 1  # the fault is a violation
    assert rings[1] == rings[0] and rings[2] == rings[0]


@st.composite
def chain_runs(draw: st.DrawFn) -> dict[str, Any]:
    """Requests whose write slots run consecutively for hundreds of entries (the kernels' lockstep
    and vectorized paths, across 256-entry chunks), mixed with scattered slots, -1, slot 0 and
    chain-position gaps; the verify entries follow the chains, with a few corrupted records."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    num_slots = draw(st.integers(2, 3000))
    free = np.arange(1, num_slots)
    start = int(rng.integers(0, 3))
    nreq = draw(st.integers(1, 9))
    p_hole = draw(st.sampled_from([0.0, 0.01]))
    slots: list[list[int]] = []
    for _ in range(nreq):
        n = int(rng.integers(0, 1200))
        if rng.random() < 0.7:  # a consecutive run
            run = [int(s) for s in free[start : start + n]]
            start += n + int(rng.integers(0, 3))
        else:  # scattered slots above the runs
            run = [int(s) for s in rng.permutation(free[start:])[: n // 8]]
            free = np.setdiff1d(free, run)
        for k in range(len(run)):
            if rng.random() < p_hole:
                run[k] = int(rng.choice([-1, 0]))
        slots.append(run)
    lens = [len(r) for r in slots]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    total = int(offsets[-1])
    pos = np.concatenate([np.arange(n) + int(rng.integers(0, 50)) for n in lens]).astype(np.int64)
    if draw(st.booleans()):
        pos[rng.random(total) < 0.01] += 2  # chain-position violations
    records = rng.integers(0, 2**63, size=(num_slots, 4), dtype=np.int64)
    if draw(st.booleans()):
        records[:] = 0
    seeds = np.where(rng.random(nreq) < 0.5, -1, rng.integers(1, num_slots, size=nreq))
    return {
        "records": records,
        "seeds": seeds.astype(np.int64),
        "offsets": offsets,
        "w_slots": np.array([s for r in slots for s in r], dtype=np.int64),
        "ids": rng.integers(0, 1 << 17, size=total).astype(np.int64),
        "positions": pos,
        "write_assert": draw(st.integers(0, 4)) == 0,
        "chain_position": draw(st.booleans()),
        "corrupt": draw(st.sampled_from([0, 0, 0, 1, 5])),
        "wrong": draw(st.sampled_from([0, 1, 1, 3])),
        "ring_capacity": draw(st.integers(1, 40)),
    }


def run_chains(kernels: Any, b: dict[str, Any]) -> tuple[bytes, bytes, int]:
    """Write the chains, corrupt a few records (the same ones for both kernels), verify them."""
    buf = b["records"].copy().view(np.uint64)
    ring = np.zeros((b["ring_capacity"], 8), dtype=np.int64)
    state = np.zeros(1, dtype=np.int64)
    src = FoldSources.empty()
    exp = b["ids"] + (np.arange(len(b["ids"])) % 7 == 0)  # some write-assert mismatches
    kernels.write(
        buf, b["seeds"], b["offsets"], b["w_slots"], False, b["ids"], b["positions"], b["write_assert"],
        exp, b["positions"], b["chain_position"], *src.words, src.params, src.count, 2,
        ring.view(np.uint64), state,
    )  # fmt: skip
    rng = np.random.default_rng(len(b["ids"]))
    for _ in range(b["corrupt"]):
        buf[rng.integers(1, len(buf)), rng.integers(0, 4)] ^= np.uint64(1)
    # Verify entries: each chain's slots in order, prev = the slot before (-1 or 0 first); 0 and -1
    # prevs (no violation) every 97th entry; then `wrong` entries get a wrong position, token or
    # prev. With one wrong entry it is the batch's only violation (the fast kernels only count
    # violations in parallel, so a miss shows only when nothing else is found).
    v_slot, v_prev, v_pos, v_tok = [], [], [], []
    for r in range(len(b["seeds"])):
        prev = -1 if b["seeds"][r] == -1 else 0  # a seeded chain's head is not checked
        for i in range(int(b["offsets"][r]), int(b["offsets"][r + 1])):
            slot = int(b["w_slots"][i])
            if slot < 0:
                continue
            v_slot.append(slot)
            v_prev.append({5: 0, 9: -1}.get(i % 97, prev))
            v_pos.append(int(b["positions"][i]))
            v_tok.append(-1 if i % 5 == 0 else int(b["ids"][i]))
            prev = slot
    for _ in range(b["wrong"] if v_slot else 0):
        k = int(rng.integers(0, len(v_slot)))
        field = (v_pos, v_tok, v_prev)[int(rng.integers(0, 3))]
        field[k] = max(field[k] - 2, 0) if field is v_prev else field[k] + 1
    kernels.verify(
        buf, *(np.array(x, dtype=np.int64) for x in (v_slot, v_prev, v_pos, v_tok)), *src.words,
        src.params, src.count, 8, ring.view(np.uint64), state,
    )  # fmt: skip
    return buf[1:].tobytes(), ring.tobytes(), int(state[0])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain_runs())
def test_fast_and_reference_kernels_agree_on_consecutive_runs(b: dict[str, Any]) -> None:
    expected = run_chains(reference, b)
    assert run_chains(fast, b) == expected
    assert run_chains(FAST_SERIAL, b) == expected
