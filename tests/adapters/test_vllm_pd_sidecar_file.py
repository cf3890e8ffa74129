"""`ExampleSidecars._read`: a sidecar comes from another process or a stale storage folder, so
anything malformed, foreign or of the wrong size is refused (None, logged), never a crash; a
well-formed one round-trips byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.adapters.vllm.pd_sidecar import ExampleSidecars, _write_atomically
from kvcanary.contract import SidecarRecords


def _records(n: int, group: str = "full") -> SidecarRecords:
    body = bytes(range(256)) * (n * 32 // 256 + 1)
    return SidecarRecords(group, ("k", "v"), (body[: n * 32],) * 2, (body[1 : n * 32 + 1],) * 2)


def test_a_well_formed_sidecar_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _write_atomically(str(path), _records(64).to_bytes())
    assert ExampleSidecars._read(str(path), 64) == _records(64)
    assert [p.name for p in tmp_path.iterdir()] == ["s"]  # no temporary file left behind


@pytest.mark.parametrize("why", ["missing", "wrong size", "swa group"])
def test_refused_sidecars(tmp_path: Path, why: str) -> None:
    path = tmp_path / "s"
    if why == "wrong size":
        path.write_bytes(_records(32).to_bytes())
    elif why == "swa group":
        path.write_bytes(_records(64, "swa").to_bytes())
    assert ExampleSidecars._read(str(path), 64) is None


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=4096), cut=st.integers(min_value=0, max_value=4096))
def test_garbage_or_truncated_sidecars_are_refused(tmp_path_factory: pytest.TempPathFactory,
                                                   data: bytes, cut: int) -> None:  # fmt: skip
    path = tmp_path_factory.mktemp("s") / "s"
    good = _records(64).to_bytes()
    path.write_bytes(data if data else good[: min(cut, len(good) - 1)])
    assert ExampleSidecars._read(str(path), 64) is None


@settings(max_examples=100, deadline=None)
@given(nblocks=st.integers(min_value=1, max_value=5), first=st.integers(1, 1000),
       fault=st.sampled_from(["wrong_slots", "dropped_block"]))  # fmt: skip
def test_every_slot_fault_really_moves_kv(nblocks: int, first: int, fault: str) -> None:
    # a fault that moves nothing would be a "miss" the canary could never catch
    import torch

    from kvcanary.app.vllm.pd_faults import faulty_slot_mapping

    bs = 32
    slots = torch.arange(first * bs, (first + nblocks) * bs)
    out = faulty_slot_mapping(slots, fault, bs)
    assert len(out) == len(slots) and int((out != slots).sum()) >= bs // 2
    assert torch.equal(faulty_slot_mapping(slots, "none", bs), slots)
    if fault == "wrong_slots":  # a permutation of the landing: every slot written once
        assert sorted(out.tolist()) == slots.tolist()
