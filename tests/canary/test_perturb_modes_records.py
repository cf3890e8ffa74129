"""Record and stale-content modes fired once at p = 1 (SPEC §11.2, conformance 44):
canary_tamper, late_write, stale_prefix, plus next_token_swap at sampler exit."""

from __future__ import annotations

import pytest

from kvcanary.canary.records import read_record
from tests.canary.perturb_checks import CP, RKV, WRITE_TOKEN, Expect, assert_attributed, tag
from tests.canary.perturb_engine import (
    BPT,
    PAGE,
    SimEngine,
    cached_then_decode,
    freed_then_reused,
    two_decoders,
)

GROUPS = [("full", None), ("swa", 3)]
FIELD_BITS = {"position": 2, "prev_hash": 1, "real_kv_hash": RKV}
FIELDS = ("token", "position", "prev_hash", "real_kv_hash")


def engine(mode: str, group: str, window: int | None, **kw: object) -> SimEngine:
    return SimEngine(probs={mode: 1.0}, target_group=group, swa_window=window, **kw)  # type: ignore[arg-type]


def tile_keys(slot: int, nbytes: int) -> set[tuple[int, int]]:
    return {(slot // PAGE, (slot % PAGE) * BPT + b) for b in range(nbytes)}


@pytest.mark.parametrize(("group", "window"), GROUPS)
def test_canary_tamper_every_field(group: str, window: int | None) -> None:
    seen = set()
    for seed in range(40):
        e = two_decoders(engine("canary_tamper", group, window, seed=seed))
        (rec,) = e.spy.injections()
        stage, name = rec.extras["buffer"], str(rec.extras["field"])
        seen.add((stage, name))
        assert {"req_row", "half", "buffer", "field"} <= set(rec.extras)
        row = int(rec.extras["req_row"])  # type: ignore[call-overload]
        assert e.slot_at(row, rec.position, group) == rec.slot and rec.step == 2
        assert rec.slot not in {e.slot_at(row, p, group) for p in range(e.prefix[2][row], 6)}
        (diff,) = e.spy.diffs  # one bit of one field in one stage
        assert diff[2:4] == (f"{stage}_{group}", (rec.slot, FIELDS.index(name) * 8))
        assert diff[4] ^ diff[5] == 1
        t = (tag(str(stage), group),)
        succ = e.slot_at(row, rec.position + 1, group)
        expect = Expect(rec).allow(t, rec.slot, CP | RKV).allow(t, succ, 1)
        if name == "token":
            assert rec.position + 1 < e.prefix[2][row]
            expect.need(t, succ, 1, 0)
        else:
            expect.need(t, rec.slot, FIELD_BITS[name], 0)
        assert_attributed(e.rows, [expect])  # only the tampered stage reports
    assert seen == {(s, f) for s in ("head", "tail") for f in FIELDS} - {("head", "real_kv_hash")}


@pytest.mark.parametrize(("group", "window"), GROUPS)
def test_late_write(group: str, window: int | None) -> None:
    assert freed_then_reused(SimEngine(swa_window=window)).rows == []
    e = freed_then_reused(engine("late_write", group, window))
    (rec,) = e.spy.injections()
    x = rec.extras
    assert (rec.step, rec.group) == (2, group) and {"req_row", "half"} <= set(x)
    row = int(x["req_row"])  # type: ignore[call-overload]
    assert e.slot_at(row, rec.position, group) == rec.slot and rec.position < 3  # c's prefill
    g = e.canary.group(group)
    stale = read_record(g.buffer("head", "k"), rec.slot)
    assert stale.position == x["stale_position"] and stale.token == x["stale_token"]
    # the restore touched only S: its two records and the first 16 bytes of its tile
    for hook, step, name, key, _, _ in e.spy.diffs:
        assert (hook, step) == ("after_tail", 2)
        if name.startswith("k_"):
            assert name == f"k_{group}" and key in tile_keys(rec.slot, 16)
        else:
            assert name in (f"head_{group}", f"tail_{group}") and key[0] == rec.slot
    both = (tag("head", group), tag("tail", group))
    expect = Expect(rec).need(both, rec.slot, CP, 1)
    expect.allow(both, e.slot_at(row, rec.position + 1, group), 1)
    assert_attributed(e.rows, [expect])


@pytest.mark.parametrize(("group", "window"), GROUPS)
def test_stale_prefix(group: str, window: int | None) -> None:
    assert cached_then_decode(SimEngine(swa_window=window, sweep_interval=1)).rows == []
    e = cached_then_decode(engine("stale_prefix", group, window, sweep_interval=1))
    (rec,) = e.spy.injections()
    x = rec.extras
    assert (rec.step, rec.group) == (2, group) and {"req_row", "half", "source_slot"} <= set(x)
    (node,) = e.walker.nodes
    local = [int(e.lut[s]) if group == "swa" else s for s in node]
    assert local[rec.position] == rec.slot  # an unlocked cached slot
    donor = int(x["source_slot"])  # type: ignore[call-overload]
    assert donor == e.slot_at(int(x["req_row"]), 5, group)  # type: ignore[call-overload]
    g = e.canary.group(group)
    assert (g.buffer("tail", "k")[rec.slot] == g.buffer("tail", "k")[donor]).all()
    for _, _, name, key, _, _ in e.spy.diffs:
        if name.startswith("k_"):
            assert key in tile_keys(rec.slot, BPT)
        else:
            assert key[0] == rec.slot
    expect = Expect(rec).need((tag("sweep", group),), rec.slot, CP, 1)
    if rec.position + 1 < len(local):
        expect.allow((tag("sweep", group),), local[rec.position + 1], 1)
    assert_attributed(e.rows, [expect])


def test_next_token_swap() -> None:
    assert two_decoders(SimEngine(write_assert=True)).rows == []
    e = two_decoders(SimEngine(probs={"next_token_swap": 1.0}, write_assert=True))
    (rec,) = e.spy.injections()
    x = rec.extras
    assert (rec.step, rec.slot, rec.group) == (2, -1, "full")
    assert {"req_row", "half"} <= set(x) and x["original_token"] != x["new_token"]
    rows = [(int(x["req_row"]), rec.position), (int(x["other_req_row"]), int(x["other_position"]))]  # type: ignore[call-overload]
    assert all(p == e.prefix[2][r] + 1 for r, p in rows)  # the sampled token's position p+1
    by_row = {req.row: req for req in e.reqs.values()}
    assert by_row[rows[0][0]].tokens[rows[0][1]] == x["new_token"]
    expect = Expect(rec)
    for r, p in rows:  # write_token at both rows' next forward, on HEAD and TAIL
        expect.need((tag("head", "full"), tag("tail", "full")), e.slot_at(r, p), WRITE_TOKEN, 1)
    assert_attributed(e.rows, [expect])
    assert all(not (v.fail_reason_bits & (CP | RKV | 32)) for v in e.rows)
