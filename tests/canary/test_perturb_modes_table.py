"""Metadata modes fired once at p = 1 (SPEC §11.2, conformance 44): req_to_token, double_alloc,
position_off_by_one, swa_lut_tamper."""

from __future__ import annotations

from kvcanary.contract import LaunchTag
from tests.canary.perturb_checks import CP, RKV, WRITE_POSITION, Expect, assert_attributed, tag
from tests.canary.perturb_engine import SimEngine, two_decoders

HEAD_TAIL_FULL = (tag("head", "full"), tag("tail", "full"))
HEAD_TAIL_SWA = (tag("head", "swa"), tag("tail", "swa"))


def test_clean_baselines_have_no_rows() -> None:
    for kw in ({}, {"swa_window": 3}):
        e = two_decoders(SimEngine(**kw))  # type: ignore[arg-type]
        assert e.rows == [] and e.spy.injections() == []
    e = SimEngine()
    e.canary.mark_init_finished()
    assert two_decoders(e).rows == []


def test_req_to_token() -> None:
    e = two_decoders(SimEngine(probs={"req_to_token": 1.0}))
    (rec,) = e.spy.injections()
    x = rec.extras
    assert (rec.mode, rec.step, rec.group, set(x)) == (
        "req_to_token", 2, "full", {"req_row", "half", "original_slot"})  # fmt: skip
    row, pos, orig = int(x["req_row"]), rec.position, int(x["original_slot"])  # type: ignore[call-overload]
    assert pos < e.prefix[2][row] and orig not in e.written[2] and rec.slot not in e.written[2]
    assert [d[2:] for d in e.spy.diffs] == [("req_to_token", (row, pos), orig, rec.slot)]
    assert e.slot_at(row, pos) == rec.slot  # not undone
    expect = Expect(rec).need(HEAD_TAIL_FULL, rec.slot, CP, 0)
    expect.allow(HEAD_TAIL_FULL, e.slot_at(row, pos + 1), 1)  # chain at the successor
    assert_attributed(e.rows, [expect])


def test_double_alloc() -> None:
    e = two_decoders(SimEngine(probs={"double_alloc": 1.0}))
    (rec,) = e.spy.injections()
    x = rec.extras
    assert {"req_row", "half", "displaced_slot"} <= set(x) and rec.group == "full"
    row, displaced = int(x["req_row"]), int(x["displaced_slot"])  # type: ignore[call-overload]
    owner, owner_pos = int(x["owner_req_row"]), int(x["owner_position"])  # type: ignore[call-overload]
    assert owner != row and e.slot_at(owner, owner_pos) == rec.slot
    assert rec.slot not in e.written[2] and displaced in e.written[2]
    index = e.written[2].index(displaced)
    assert sorted(d[2:] for d in e.spy.diffs) == [
        ("out_slots", (index,), displaced, rec.slot),
        ("req_to_token", (row, rec.position), displaced, rec.slot),
    ]
    expect = Expect(rec).need((tag("tail", "full"),), rec.slot, RKV, 0)
    expect.need(HEAD_TAIL_FULL, rec.slot, CP, 1)
    expect.allow(HEAD_TAIL_FULL, e.slot_at(owner, owner_pos + 1), 1)
    assert_attributed(e.rows, [expect])


def test_position_off_by_one() -> None:
    e = SimEngine(probs={"position_off_by_one": 1.0})
    e.canary.mark_init_finished()
    two_decoders(e)
    (rec,) = e.spy.injections()
    assert (rec.step, rec.group, set(rec.extras)) == (2, "full", {"req_row", "half"})
    row = int(rec.extras["req_row"])  # type: ignore[call-overload]
    index = e.written[2].index(rec.slot)
    assert [d[2:] for d in e.spy.diffs] == [("positions", (index,), rec.position, rec.position + 1)]
    expect = Expect(rec).need(HEAD_TAIL_FULL, rec.slot, WRITE_POSITION, 0)
    expect.need((LaunchTag.HEAD_K_FULL,), rec.slot, 2, 1).allow(HEAD_TAIL_FULL, rec.slot, 2)
    # the next write is seeded by the shifted record: one more write_position at the successor
    expect.allow(HEAD_TAIL_FULL, e.slot_at(row, rec.position + 1), WRITE_POSITION)
    assert_attributed(e.rows, [expect])
    write_rows = [
        v for v in e.rows if v.fail_reason_bits == WRITE_POSITION and v.slot_idx == rec.slot
    ]
    assert write_rows and all(v.expected_aux == rec.position for v in write_rows)


def test_position_off_by_one_skips_before_init_finished() -> None:
    e = two_decoders(SimEngine(probs={"position_off_by_one": 1.0}))
    assert e.spy.injections() == [] and e.rows == []


def test_swa_lut_tamper() -> None:
    e = two_decoders(SimEngine(probs={"swa_lut_tamper": 1.0}, swa_window=3))
    (rec,) = e.spy.injections()
    x = rec.extras
    assert (rec.step, rec.group) == (2, "swa") and {"req_row", "half", "full_slot"} <= set(x)
    row, full, orig = int(x["req_row"]), int(x["full_slot"]), int(x["original_slot"])  # type: ignore[call-overload]
    assert e.prefix[2][row] - 3 <= rec.position < e.prefix[2][row]  # in window
    assert full == e.slot_at(row, rec.position) and full not in e.written[2]
    assert [d[2:] for d in e.spy.diffs] == [("lut", (full,), orig, rec.slot)]
    expect = Expect(rec).need(HEAD_TAIL_SWA, rec.slot, CP, 0)
    expect.allow(HEAD_TAIL_SWA, e.slot_at(row, rec.position + 1, "swa"), 1)
    assert_attributed(e.rows, [expect])
    assert not any(v.tag in HEAD_TAIL_FULL for v in e.rows)  # FULL silent
