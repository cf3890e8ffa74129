"""KvPool: storage round trip, slot -1 skips, and the RealKvSource byte views of layer 0."""

from __future__ import annotations

import pytest
import torch

from kvcanary.contract import GroupKind
from kvcanary.engine.kv_pool import KvPool


def make_pool(dtype: torch.dtype = torch.float32, num_slots: int = 16) -> KvPool:
    return KvPool(num_slots=num_slots, num_layers=2, num_kv_heads=2, head_dim=16, dtype=dtype)


def random_kv(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen)


def test_pool_is_zeroed_with_slot_zero_present() -> None:
    pool = make_pool()
    assert pool.num_slots == 16 and pool.num_layers == 2
    assert pool.k(0).shape == (16, 2, 16) and pool.v(1).shape == (16, 2, 16)
    assert not pool.k(0).any() and not pool.v(1).any()
    assert pool.num_bytes_per_token == 2 * 16 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_then_read_round_trips_and_leaves_other_layers(dtype: torch.dtype) -> None:
    pool = make_pool(dtype)
    gen = torch.Generator().manual_seed(1)
    k, v = random_kv(3, gen)
    slots = torch.tensor([5, 2, 9])
    pool.write(1, slots, k, v)
    assert torch.equal(pool.k(1)[slots], k.to(dtype))
    assert torch.equal(pool.v(1)[slots], v.to(dtype))
    gathered_k, gathered_v = pool.gather(1, slots.to(torch.int32))
    assert torch.equal(gathered_k, k.to(dtype)) and torch.equal(gathered_v, v.to(dtype))
    assert not pool.k(0).any() and not pool.v(0).any()
    untouched = [s for s in range(16) if s not in (5, 2, 9)]
    assert not pool.k(1)[untouched].any()


def test_write_skips_slot_minus_one() -> None:
    pool = make_pool()
    k, v = random_kv(3, torch.Generator().manual_seed(2))
    pool.write(0, torch.tensor([3, -1, 4]), k, v)
    assert torch.equal(pool.k(0)[3], k[0]) and torch.equal(pool.k(0)[4], k[2])
    assert torch.equal(pool.v(0)[4], v[2])
    assert not pool.k(0)[[0, 1, 2, 5]].any() and not pool.k(0)[-1].any()


def test_write_rejects_mismatched_shapes() -> None:
    pool = make_pool()
    k, v = random_kv(2, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="disagree"):
        pool.write(0, torch.tensor([1, 2, 3]), k, v)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_slots": 1}, "slot 0"),
        ({"num_kv_heads": 1, "head_dim": 2}, "multiple of 16"),
        ({"dtype": torch.float16}, "float32 or bfloat16"),
        ({"num_layers": 0}, "positive"),
    ],
)
def test_pool_validation(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"num_slots": 8, "num_layers": 1, "num_kv_heads": 2, "head_dim": 16}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        KvPool(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_kv_sources_are_live_byte_views_of_layer_zero(dtype: torch.dtype) -> None:
    pool = make_pool(dtype)
    k, v = random_kv(2, torch.Generator().manual_seed(4))
    pool.write(0, torch.tensor([7, 8]), k, v)
    k_src, v_src = pool.real_kv_sources(read_bytes=16)
    nbpt = 2 * 16 * (4 if dtype == torch.float32 else 2)
    for src, half in ((k_src, pool.k(0)), (v_src, pool.v(0))):
        assert src.page_size == 1 and src.num_bytes_per_token == nbpt and src.read_bytes == 16
        assert src.tensor.dtype == torch.uint8 and src.tensor.shape == (16, nbpt)
        assert src.tensor.data_ptr() == half.data_ptr()
        assert torch.equal(src.tensor[7], half[7].contiguous().view(torch.uint8).flatten())
    # Flip one byte through the source view: the pool's K (and nothing else) changes.
    before_k, before_v = pool.k(0).clone(), pool.v(0).clone()
    k_src.tensor[8, 0] ^= 0xFF
    assert not torch.equal(pool.k(0)[8], before_k[8])
    assert torch.equal(pool.k(0)[7], before_k[7]) and torch.equal(pool.v(0), before_v)
    # The byte at row s, column 0 is the first byte of slot s's first K element.
    assert int(pool.k(0)[8].contiguous().view(torch.uint8).flatten()[0]) == int(k_src.tensor[8, 0])


def test_real_kv_sources_ignore_other_layers() -> None:
    pool = make_pool()
    k_src, _ = pool.real_kv_sources(read_bytes=pool.num_bytes_per_token)
    k, v = random_kv(1, torch.Generator().manual_seed(5))
    pool.write(1, torch.tensor([3]), k, v)
    assert not k_src.tensor.any()


def test_buffer_group_modes() -> None:
    pool = make_pool()
    none = pool.buffer_group("none")
    assert none.kind is GroupKind.FULL and none.num_slots == 16 and none.has_v
    assert none.k_sources == () and none.v_sources == ()
    partial = pool.buffer_group(" PARTIAL ")
    assert [s.read_bytes for s in (*partial.k_sources, *partial.v_sources)] == [16, 16]
    full = pool.buffer_group("all")
    assert [s.read_bytes for s in (*full.k_sources, *full.v_sources)] == [128, 128]
    assert full.k_sources[0].tensor.data_ptr() == pool.k(0).data_ptr()
    assert full.v_sources[0].tensor.data_ptr() == pool.v(0).data_ptr()
    assert full.full_to_swa is None and full.kv_token_id_vs_position_offset == 0
    with pytest.raises(ValueError, match="none/partial/all"):
        pool.buffer_group("some")
