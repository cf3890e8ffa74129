"""SPEC §14.4: sidecar export/import between two canaries, and the receiver's landing verify."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcanary.canary import Canary, CanarySidecars
from kvcanary.contract import (
    CanaryContractError,
    NullSidecars,
    SidecarRecords,
    fail_reason_labels,
    layered_transfer_order,
    tag_name,
)
from tests.canary.conftest import MakeCanary, forward
from tests.canary.handpool import HandPool

PROMPT = [5, 7, 11, 13, 17, 19]


def _sender(make_canary: MakeCanary) -> tuple[HandPool, Canary, list[int]]:
    pool, canary = make_canary()
    forward(pool, canary, pool.view([(1, PROMPT)]))
    assert canary.drain_violations() == []
    return pool, canary, pool.r2t[1, : len(PROMPT)].tolist()


def _land(
    src: HandPool, src_canary: Canary, src_slots: list[int], dst: HandPool, dst_canary: Canary,
    dst_slots: list[int], *, row: int = 1, start: int = 0,
) -> SidecarRecords:  # fmt: skip
    """Copy KV and sidecars of `src_slots` (positions start..) into `dst_slots`, map them in
    `dst`'s row; returns the records as they travelled."""
    records = CanarySidecars(src_canary).export_sidecars(group="full", slots=src_slots)
    wire = SidecarRecords.from_bytes(records.to_bytes())
    dst.k[dst_slots] = src.k[src_slots]
    CanarySidecars(dst_canary).import_sidecars(records=wire, slots=dst_slots)
    n = len(dst_slots)
    dst.r2t[row, start : start + n] = torch.tensor(dst_slots, dtype=torch.int32)
    dst.lengths[row] = start + n
    dst.tokens[row] = dst.tokens.get(row, [])[:start] + PROMPT[start : start + n]
    return records


def _verify(dst: HandPool, canary: Canary, row: int, start: int, n: int, **kw: object) -> int:
    slots = dst.r2t[row, start : start + n].tolist()
    prevs = [int(dst.r2t[row, p - 1]) if p > 0 else -1 for p in range(start, start + n)]
    return CanarySidecars(canary).verify_landed(
        group="full", slots=slots, positions=list(range(start, start + n)), prev_slots=prevs,
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _rows(canary: Canary) -> set[tuple[str, int, str]]:
    return {
        (tag_name(v.kernel_kind), v.slot_idx, "+".join(fail_reason_labels(v.fail_reason_bits)))
        for v in canary.drain_violations()
    }


def test_relocated_landing_verifies_and_decodes_clean(make_canary: MakeCanary) -> None:
    src, src_canary, src_slots = _sender(make_canary)
    dst, dst_canary = make_canary(pool=HandPool(next_slot=40))
    dst_slots = dst.alloc(len(PROMPT))
    _land(src, src_canary, src_slots, dst, dst_canary, dst_slots)
    assert _verify(dst, dst_canary, 1, 0, len(PROMPT), tokens=PROMPT) == 0
    forward(dst, dst_canary, dst.view([(1, [23])]))  # the first decode reads the landed pages
    assert dst_canary.drain_violations() == []


def test_landing_after_a_local_prefix_links_the_chain(make_canary: MakeCanary) -> None:
    """The receiver computed positions 0..2 itself (its prefix cache); only 3.. travel."""
    src, src_canary, src_slots = _sender(make_canary)
    dst, dst_canary = make_canary(pool=HandPool(next_slot=30))
    forward(dst, dst_canary, dst.view([(1, PROMPT[:3])]))
    _land(src, src_canary, src_slots[3:], dst, dst_canary, dst.alloc(3), start=3)
    assert _verify(dst, dst_canary, 1, 3, 3) == 0
    forward(dst, dst_canary, dst.view([(1, [29])]))
    assert dst_canary.drain_violations() == []


def test_export_round_trip_is_byte_equal(make_canary: MakeCanary) -> None:
    _src, src_canary, src_slots = _sender(make_canary)
    records = CanarySidecars(src_canary).export_sidecars(group="full", slots=src_slots)
    g = src_canary.group("full")
    assert records.head[0] == g.buffer("head", "k")[src_slots].tobytes()
    assert records.tail[0] == g.buffer("tail", "k")[src_slots].tobytes()
    assert SidecarRecords.from_bytes(records.to_bytes()) == records
    assert records.slice(2, 4).tail[0] == g.buffer("tail", "k")[src_slots[2:4]].tobytes()


def test_bit_flip_in_transit_is_real_kv(make_canary: MakeCanary) -> None:
    src, src_canary, src_slots = _sender(make_canary)
    dst, dst_canary = make_canary(pool=HandPool(next_slot=40))
    dst_slots = dst.alloc(len(PROMPT))
    _land(src, src_canary, src_slots, dst, dst_canary, dst_slots)
    dst.k[dst_slots[2], 0] ^= 0xFF  # the bytes that actually landed differ
    assert _verify(dst, dst_canary, 1, 0, len(PROMPT)) == 1
    assert _rows(dst_canary) == {("TAIL_K_FULL", dst_slots[2], "verify_real_kv_hash")}


def test_pages_in_wrong_slots_break_chain_and_position(make_canary: MakeCanary) -> None:
    src, src_canary, src_slots = _sender(make_canary)
    dst, dst_canary = make_canary(pool=HandPool(next_slot=40))
    dst_slots = dst.alloc(len(PROMPT))
    swapped = [dst_slots[0], dst_slots[2], dst_slots[1], *dst_slots[3:]]
    _land(src, src_canary, src_slots, dst, dst_canary, swapped)
    dst.r2t[1, : len(PROMPT)] = torch.tensor(dst_slots, dtype=torch.int32)  # the receiver's map
    assert _verify(dst, dst_canary, 1, 0, len(PROMPT)) > 0
    rows = _rows(dst_canary)
    assert {s for _, s, _ in rows} <= {dst_slots[1], dst_slots[2], dst_slots[3]}
    assert any("verify_position" in r for _, _, r in rows)


def test_records_never_landed_are_reported(make_canary: MakeCanary) -> None:
    """KV landed without its records: the slots' old (zero) records stay and fail."""
    src, _src_canary, src_slots = _sender(make_canary)
    dst, dst_canary = make_canary(pool=HandPool(next_slot=40))
    dst_slots = dst.alloc(len(PROMPT))
    dst.k[dst_slots] = src.k[src_slots]
    dst.r2t[1, : len(PROMPT)] = torch.tensor(dst_slots, dtype=torch.int32)
    assert _verify(dst, dst_canary, 1, 0, len(PROMPT)) > 0
    assert {s for _, s, _ in _rows(dst_canary)} == set(dst_slots)


def test_partial_layer_transfer_leaves_head_and_tail_disagreeing(make_canary: MakeCanary) -> None:
    order = layered_transfer_order(3)
    assert order[0] == "head" and order[-1] == "tail" and order[1:-1] == (0, 1, 2)
    src, src_canary, src_slots = _sender(make_canary)
    dst, dst_canary = make_canary(pool=HandPool(next_slot=40))
    dst_slots = dst.alloc(len(PROMPT))
    records = CanarySidecars(src_canary).export_sidecars(group="full", slots=src_slots)
    head_only = SidecarRecords(
        "full",
        records.halves,
        records.head,
        tuple(
            dst_canary.group("full").buffer("tail", "k")[dst_slots].tobytes()
            for _ in records.halves
        ),
    )  # the transfer stopped before its last entry: TAIL keeps the slots' old records
    dst.k[dst_slots] = src.k[src_slots]
    CanarySidecars(dst_canary).import_sidecars(records=head_only, slots=dst_slots)
    dst.r2t[1, : len(PROMPT)] = torch.tensor(dst_slots, dtype=torch.int32)
    assert _verify(dst, dst_canary, 1, 0, len(PROMPT)) > 0
    tags = {t for t, _, _ in _rows(dst_canary)}
    assert tags == {"TAIL_K_FULL"}  # HEAD landed and verifies; TAIL did not


def test_verify_token_when_known(make_canary: MakeCanary) -> None:
    src, src_canary, src_slots = _sender(make_canary)
    dst, dst_canary = make_canary(pool=HandPool(next_slot=40))
    dst_slots = dst.alloc(len(PROMPT))
    _land(src, src_canary, src_slots, dst, dst_canary, dst_slots)
    wrong = [*PROMPT[:4], 99, PROMPT[5]]
    assert _verify(dst, dst_canary, 1, 0, len(PROMPT), tokens=wrong) == 2  # HEAD and TAIL
    assert {r for _, _, r in _rows(dst_canary)} == {"verify_token"}


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        ([0, 1], "slot 0 is outside the full group's 64 slots"),
        ([64], "slot 64 is outside the full group's 64 slots"),
        ([-3], "slot -3 is outside"),
        ([3, 3], "lists slot 3 twice"),
        ([1.5], "must hold ints"),
        ([[1, 2]], "must be a flat list"),
    ],
)
def test_bad_slot_lists_are_contract_errors(
    make_canary: MakeCanary, slots: list[object], message: str
) -> None:
    _, canary = make_canary()
    sidecars = CanarySidecars(canary)
    with pytest.raises(CanaryContractError, match=message):
        sidecars.export_sidecars(group="full", slots=slots)  # type: ignore[arg-type]


def test_bad_imports_and_verifies_are_contract_errors(make_canary: MakeCanary) -> None:
    _src, src_canary, src_slots = _sender(make_canary)
    sidecars = CanarySidecars(src_canary)
    records = sidecars.export_sidecars(group="full", slots=src_slots)
    with pytest.raises(CanaryContractError, match="6 records for 2 landing slots"):
        sidecars.import_sidecars(records=records, slots=[40, 41])
    with pytest.raises(CanaryContractError, match="group 'swa'"):
        sidecars.export_sidecars(group="swa", slots=[1])
    kv = SidecarRecords("full", ("k", "v"), records.head * 2, records.tail * 2)
    with pytest.raises(CanaryContractError, match="halves"):
        sidecars.import_sidecars(records=kv, slots=list(range(40, 46)))
    with pytest.raises(CanaryContractError, match="lengths differ"):
        sidecars.verify_landed(group="full", slots=[1, 2], positions=[0], prev_slots=[-1])
    with pytest.raises(CanaryContractError, match="prev slot -1 at position 1"):
        sidecars.verify_landed(group="full", slots=[2], positions=[1], prev_slots=[-1])
    with pytest.raises(CanaryContractError, match="prev slot 0 at position 1"):
        sidecars.verify_landed(group="full", slots=[2], positions=[1], prev_slots=[0])
    with pytest.raises(CanaryContractError, match="sidecar group"):
        SidecarRecords("any", ("k",), (b"",), (b"",))
    with pytest.raises(CanaryContractError, match="whole number of 32-byte"):
        SidecarRecords("full", ("k",), (b"x" * 31,), (b"x" * 31,))


def test_landed_bytes_with_another_checksum_are_tail_real_kv(make_canary: MakeCanary) -> None:
    """A transfer checksum over bytes the fingerprint does not read (another layer, say): only
    the slots whose sums differ are reported, as TAIL real-KV rows carrying both sums."""
    src, src_canary, src_slots = _sender(make_canary)
    dst, dst_canary = make_canary(pool=HandPool(next_slot=40))
    dst_slots = dst.alloc(len(PROMPT))
    _land(src, src_canary, src_slots, dst, dst_canary, dst_slots)
    sidecars = CanarySidecars(dst_canary)
    sums = [11, 22, 33, 44, 55, 66]
    same = sidecars.report_landed_bytes(group="full", slots=dst_slots, positions=list(range(6)),
                                        landed=sums, expected=sums, tokens=PROMPT)  # fmt: skip
    assert same == 0 and dst_canary.drain_violations() == []
    got = [*sums[:2], -7, -8, *sums[4:]]
    assert sidecars.report_landed_bytes(group="full", slots=dst_slots, positions=list(range(6)),
                                        landed=got, expected=sums) == 2  # fmt: skip
    rows = dst_canary.drain_violations()
    assert {(tag_name(v.kernel_kind), v.slot_idx, v.position) for v in rows} == {
        ("TAIL_K_FULL", dst_slots[2], 2),
        ("TAIL_K_FULL", dst_slots[3], 3),
    }
    assert {"+".join(fail_reason_labels(v.fail_reason_bits)) for v in rows} == {
        "verify_real_kv_hash"
    }
    assert [(v.stored_chain_hash, v.expected_aux) for v in rows] == [(-7, 33), (-8, 44)]
    with pytest.raises(CanaryContractError, match="lengths differ"):
        sidecars.report_landed_bytes(group="full", slots=dst_slots, positions=list(range(6)),
                                     landed=sums[:5], expected=sums)  # fmt: skip
    with pytest.raises(CanaryContractError, match="outside"):
        sidecars.report_landed_bytes(group="full", slots=[10**6], positions=[0], landed=[1],
                                     expected=[2])  # fmt: skip
    assert NullSidecars().report_landed_bytes(group="full", slots=[1], positions=[0],
                                              landed=[1], expected=[2]) == 0  # fmt: skip


@pytest.mark.parametrize(
    "data",
    [b"", b"KVCS", b"XXXX" + bytes(12), b"KVCS\x00\x01\x00\x00" + (1).to_bytes(8, "little")],
)
def test_malformed_wire_payloads_are_contract_errors(data: bytes) -> None:
    with pytest.raises(CanaryContractError, match="sidecar payload"):
        SidecarRecords.from_bytes(data)


def test_null_sidecars_carry_nothing() -> None:
    null = NullSidecars()
    assert not null.carries_sidecars
    assert null.export_sidecars(group="full", slots=[1]) is None
    assert null.verify_landed(group="full", slots=[1], positions=[0], prev_slots=[-1]) == 0


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    perm=st.permutations(list(range(1, 64))),
    n=st.integers(1, len(PROMPT)),
    corrupt=st.sampled_from(["none", "flip", "swap", "record", "drop"]),
    data=st.data(),
)
def test_relocation_and_corruption_property(
    make_canary: MakeCanary, perm: list[int], n: int, corrupt: str, data: st.DataObject
) -> None:
    """Any relocation verifies clean; each corruption of the landing is detected."""
    src, src_canary, src_slots = _sender(make_canary)
    dst, dst_canary = make_canary(pool=HandPool())
    dst_slots = perm[:n]
    records = CanarySidecars(src_canary).export_sidecars(group="full", slots=src_slots[:n])
    wire = bytearray(records.to_bytes())
    dst.k[dst_slots] = src.k[src_slots[:n]]
    j = data.draw(st.integers(0, n - 1))
    if corrupt == "flip":
        dst.k[dst_slots[j], data.draw(st.integers(0, 15))] ^= 1 << data.draw(st.integers(0, 7))
    elif corrupt == "record":
        field = data.draw(st.sampled_from([8, 16]))  # POSITION or PREV_HASH of record j (TAIL)
        off = 16 + 32 * n + 32 * j + field + data.draw(st.integers(0, 7))
        wire[off] ^= 1 << data.draw(st.integers(0, 7))
    landing = list(dst_slots)
    if corrupt == "swap" and n >= 2:
        k = data.draw(st.integers(0, n - 1).filter(lambda x: x != j))
        landing[j], landing[k] = landing[k], landing[j]
        dst.k[landing] = src.k[src_slots[:n]]
    got = SidecarRecords.from_bytes(bytes(wire))
    if corrupt != "drop":
        CanarySidecars(dst_canary).import_sidecars(records=got, slots=landing)
        # byte equality: what landed is exactly what travelled, only the indices changed
        assert CanarySidecars(dst_canary).export_sidecars(group="full", slots=landing) == got
    prevs = [-1, *dst_slots[:-1]]
    found = CanarySidecars(dst_canary).verify_landed(
        group="full", slots=dst_slots, positions=list(range(n)), prev_slots=prevs
    )
    if corrupt == "none" or (corrupt == "swap" and n < 2):
        assert found == 0
    else:
        assert found > 0
