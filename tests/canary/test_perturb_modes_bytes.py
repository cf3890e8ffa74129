"""Real-KV byte-flip modes fired once at p = 1 (SPEC §11.2, conformance 44): real_kv_used,
real_kv_unused_cache, real_kv_post_forward, on the FULL and the SWA group."""

from __future__ import annotations

import pytest

from kvcanary.canary import PerturbRecord
from tests.canary.perturb_checks import RKV, Expect, assert_attributed, tag
from tests.canary.perturb_engine import (
    BPT,
    PAGE,
    SimEngine,
    cached_then_decode,
    two_decoders,
)

GROUPS = [("full", None), ("swa", 3)]
BYTE_KEYS = {"req_row", "half", "source_idx", "row", "col", "original_byte", "new_byte"}


def engine(mode: str, group: str, window: int | None, **kw: object) -> SimEngine:
    return SimEngine(probs={mode: 1.0}, target_group=group, swa_window=window, **kw)  # type: ignore[arg-type]


def assert_one_flip(e: SimEngine, rec: PerturbRecord, hook: str) -> None:
    """The journal names exactly the byte that changed: byte 0 of the slot's tile, XOR 0xFF."""
    x = rec.extras
    assert set(x) >= BYTE_KEYS and x["half"] == "k" and x["source_idx"] == 0
    assert (x["row"], x["col"]) == (rec.slot // PAGE, (rec.slot % PAGE) * BPT)
    original = int(str(x["original_byte"]), 16)
    assert x["new_byte"] == f"0x{original ^ 0xFF:02x}"
    assert [d[:3] + d[3:] for d in e.spy.diffs] == [
        (hook, rec.step, f"k_{rec.group}", (x["row"], x["col"]), original, original ^ 0xFF)
    ]
    if rec.group == "swa":
        assert int(e.lut[int(x["full_slot"])]) == rec.slot  # type: ignore[call-overload]


@pytest.mark.parametrize(("group", "window"), GROUPS)
def test_real_kv_used(group: str, window: int | None) -> None:
    assert two_decoders(SimEngine(swa_window=window)).rows == []
    e = two_decoders(engine("real_kv_used", group, window))
    (rec,) = e.spy.injections()
    assert (rec.mode, rec.step, rec.group) == ("real_kv_used", 2, group)
    assert_one_flip(e, rec, "before_plan")
    row = int(rec.extras["req_row"])  # type: ignore[call-overload]
    start = 0 if window is None else e.prefix[2][row] - window
    assert start <= rec.position < e.prefix[2][row]
    assert e.slot_at(row, rec.position) not in e.written[2]
    expect = Expect(rec).need((tag("tail", group),), rec.slot, RKV, 0)  # never HEAD
    assert_attributed(e.rows, [expect])


@pytest.mark.parametrize(("group", "window"), GROUPS)
def test_real_kv_unused_cache(group: str, window: int | None) -> None:
    assert cached_then_decode(SimEngine(swa_window=window, sweep_interval=1)).rows == []
    e = cached_then_decode(engine("real_kv_unused_cache", group, window, sweep_interval=1))
    (rec,) = e.spy.injections()
    assert (rec.step, rec.group, rec.extras["req_row"]) == (2, group, -1)
    assert_one_flip(e, rec, "at_end_step")
    (node,) = e.walker.nodes
    full = node[rec.position]
    assert rec.slot == (full if group == "full" else int(e.lut[full]))
    expect = Expect(rec).need((tag("sweep", group),), rec.slot, RKV, 0)
    assert_attributed(e.rows, [expect])


def test_real_kv_unused_cache_waits_for_a_due_sweep() -> None:
    e = cached_then_decode(engine("real_kv_unused_cache", "full", None, sweep_interval=10))
    assert e.spy.injections() == []  # the only due sweep (step 0) was inside the warm-up


@pytest.mark.parametrize(("group", "window"), GROUPS)
def test_real_kv_post_forward(group: str, window: int | None) -> None:
    e = two_decoders(engine("real_kv_post_forward", group, window))
    (rec,) = e.spy.injections()
    assert (rec.step, rec.group) == (2, group)
    assert_one_flip(e, rec, "after_tail")
    row = int(rec.extras["req_row"])  # type: ignore[call-overload]
    assert e.slot_at(row, rec.position) in e.written[2]  # written this forward, by design
    assert rec.position == e.prefix[2][row]
    expect = Expect(rec).need((tag("tail", group),), rec.slot, RKV, 1)
    assert_attributed(e.rows, [expect])
