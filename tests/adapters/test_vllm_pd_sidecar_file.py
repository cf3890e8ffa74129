"""`ExampleSidecars._read`: a sidecar comes from another process or a stale storage folder, so
anything malformed, foreign or of the wrong size is refused (None, logged), never a crash; a
well-formed one round-trips byte for byte."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.adapters.vllm.pd_sidecar import ExampleSidecars, _write_atomically
from kvcanary.adapters.vllm.transfer_checksum import block_checksums, pack_sidecar
from kvcanary.contract import SidecarRecords

SUMS = np.arange(-1, 1, dtype=np.int64)  # two blocks of 32 slots


def _records(n: int, group: str = "full") -> SidecarRecords:
    body = bytes(range(256)) * (n * 32 // 256 + 1)
    return SidecarRecords(group, ("k", "v"), (body[: n * 32],) * 2, (body[1 : n * 32 + 1],) * 2)


def test_a_well_formed_sidecar_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _write_atomically(str(path), pack_sidecar(_records(64), SUMS))
    records, sums = ExampleSidecars._read(str(path), 64, 2) or (None, None)
    assert records == _records(64) and sums is not None and sums.tolist() == SUMS.tolist()
    assert [p.name for p in tmp_path.iterdir()] == ["s"]  # no temporary file left behind


@pytest.mark.parametrize("why", ["missing", "wrong size", "swa group", "checksums",
                                 "bare records"])  # fmt: skip
def test_refused_sidecars(tmp_path: Path, why: str) -> None:
    path = tmp_path / "s"
    if why == "wrong size":
        path.write_bytes(pack_sidecar(_records(32), SUMS))
    elif why == "swa group":
        path.write_bytes(pack_sidecar(_records(64, "swa"), SUMS))
    elif why == "checksums":
        path.write_bytes(pack_sidecar(_records(64), SUMS[:1]))
    elif why == "bare records":  # the previous format: no checksums
        path.write_bytes(_records(64).to_bytes())
    assert ExampleSidecars._read(str(path), 64, 2) is None


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=4096), cut=st.integers(min_value=0, max_value=4096))
def test_garbage_or_truncated_sidecars_are_refused(tmp_path_factory: pytest.TempPathFactory,
                                                   data: bytes, cut: int) -> None:  # fmt: skip
    path = tmp_path_factory.mktemp("s") / "s"
    good = pack_sidecar(_records(64), SUMS)
    path.write_bytes(data if data else good[: min(cut, len(good) - 1)])
    assert ExampleSidecars._read(str(path), 64, 2) is None


@settings(max_examples=100, deadline=None)
@given(layers=st.integers(1, 3), nblocks=st.integers(2, 6), seed=st.integers(0, 2**32 - 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))  # fmt: skip
def test_a_block_checksum_sees_every_bit_of_every_layer(layers: int, nblocks: int, seed: int,
                                                        dtype: torch.dtype) -> None:  # fmt: skip
    # vLLM CPU caches: [num_blocks, kv_heads, block_size, 2 * head_size]
    gen = torch.Generator().manual_seed(seed)
    caches = [torch.randn(nblocks, 2, 4, 8, generator=gen).to(dtype) for _ in range(layers)]
    blocks = np.arange(nblocks, dtype=np.int64)
    before = block_checksums(caches, blocks)
    rng = np.random.default_rng(seed)
    layer, block = int(rng.integers(layers)), int(rng.integers(nblocks))
    raw = caches[layer][block].view(torch.uint8).view(-1)
    byte, bit = int(rng.integers(raw.numel())), int(rng.integers(8))
    raw[byte] ^= 1 << bit  # one bit of one layer of one block
    after = block_checksums(caches, blocks)
    assert (after != before).tolist() == [b == block for b in range(nblocks)]
    # a block's checksum is its own bytes': another block's bytes (a swap) change it
    assert block_checksums(caches, blocks[::-1]).tolist() == after[::-1].tolist()


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
