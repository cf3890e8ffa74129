"""RealKvSource and BufferGroupSpec validation texts (SPEC §2.4; conformance item 27)."""

from __future__ import annotations

import pytest
import torch

from kvcanary.contract import BufferGroupSpec, GroupKind, RealKvSource

T = torch.zeros(4, 64, dtype=torch.uint8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tensor=T, page_size=0, num_bytes_per_token=32, read_bytes=16),
         "kv-canary: RealKvSource.page_size must be >= 1, got 0"),
        (dict(tensor=T, page_size=1, num_bytes_per_token=24, read_bytes=16),
         "kv-canary: RealKvSource.num_bytes_per_token must be a positive multiple of 16, got 24"),
        (dict(tensor=T, page_size=1, num_bytes_per_token=32, read_bytes=48),
         "kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in (0, num_bytes_per_token=32], got 48"),
        (dict(tensor=T, page_size=1, num_bytes_per_token=32, read_bytes=8),
         "kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in (0, num_bytes_per_token=32], got 8"),
        (dict(tensor=torch.zeros(64, dtype=torch.uint8), page_size=1, num_bytes_per_token=32, read_bytes=16),
         "kv-canary: RealKvSource.tensor must be at least 2-D, got shape (64,)"),
        (dict(tensor=torch.zeros(4, 72, dtype=torch.uint8)[:, :40], page_size=1, num_bytes_per_token=32, read_bytes=16),
         "kv-canary: RealKvSource.tensor row stride must be a multiple of 16 bytes, got 72 bytes (shape=(4, 40), strides=(72, 1), dtype=torch.uint8)"),
        (dict(tensor=T, page_size=4, num_bytes_per_token=32, read_bytes=16),
         "kv-canary: RealKvSource row is too narrow for its slot layout: dim-1 is 64 bytes but page_size=4 x num_bytes_per_token=32 needs 128"),
    ],
)  # fmt: skip
def test_real_kv_source_messages(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as err:
        RealKvSource(**kwargs)  # type: ignore[arg-type]
    assert str(err.value) == message


def test_validation_order_page_size_first() -> None:
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        RealKvSource(torch.zeros(3), 0, 24, 8)


def test_fifth_source_is_rejected() -> None:
    src = RealKvSource(T, 1, 32, 16)
    with pytest.raises(ValueError) as err:
        BufferGroupSpec(kind=GroupKind.FULL, num_slots=4, k_sources=(src,) * 5)
    assert (
        str(err.value)
        == "kv-canary: at most 4 RealKvSource entries supported per buffer half, got 5"
    )


def test_swa_group_needs_lut_and_window() -> None:
    with pytest.raises(ValueError, match="needs full_to_swa and window"):
        BufferGroupSpec(kind=GroupKind.SWA, num_slots=4)
    lut = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(ValueError, match="only valid for a SWA group"):
        BufferGroupSpec(kind=GroupKind.FULL, num_slots=4, full_to_swa=lut, window=2)


def test_multi_dim_bfloat16_source_is_viewed_as_bytes() -> None:
    k = torch.zeros(10, 2, 8, dtype=torch.bfloat16)
    src = RealKvSource(k, 1, 32, 32)
    assert src.row_bytes == 32 and src.row_stride_bytes == 32 and src.num_slots == 10
