"""`mirror.KvMirror` re-gathers exactly `cache[b].bytes[gather]` for the listed blocks, whatever
the gather (whole elements, an AMX layout's VNNI pairs and token pairs, stray bytes), with the
compiled element gather or NumPy's byte gather (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.adapters.vllm.mirror import KvMirror


def _amx_like(heads: int, block: int, dim: int, es: int, read: int) -> np.ndarray:
    """The byte gather `build_sources` makes for a VNNI layout: K in element pairs, tiles of 16
    tokens (`[D/2, 16, 2]`), then V in token pairs (`[B/2, D, 2]`), `read` bytes a token."""
    k_half, v_half = [], []
    for h in range(heads):
        base = h * block * 2 * dim
        for t in range(block):
            tile, tt = divmod(t, 16)
            el = [base + tile * 16 * dim + (d // 2) * 32 + 2 * tt + d % 2 for d in range(dim)]
            k_half.append(np.array(el)[: read // es])
            vb = base + block * dim
            v_half.append(np.array([vb + (t // 2) * 2 * dim + 2 * d + t % 2
                                    for d in range(dim)])[: read // es])  # fmt: skip
    elems = np.concatenate(k_half + v_half)
    return (elems[:, None] * es + np.arange(es)).ravel()


def _gathers(rng: np.random.Generator, row: int, es: int) -> np.ndarray:
    kind = rng.integers(0, 4)
    if kind == 0:  # whole elements at random, as the probe finds them
        elems = rng.choice(row // es, 6, replace=False)
        return (elems[:, None] * es + np.arange(es)).ravel()
    if kind == 1:  # stray bytes
        return rng.choice(row, int(rng.integers(1, 12)), replace=False)
    if kind == 2:  # 4-byte pieces at random, then a tail of single bytes
        words = rng.choice(row // 4, 3, replace=False)
        tail = rng.choice(row, 3, replace=False)
        return np.concatenate([(words[:, None] * 4 + np.arange(4)).ravel(), tail])
    pairs = rng.choice(row // 2, 5, replace=False)  # 2-byte pieces, odd column count
    return np.concatenate([(pairs[:, None] * 2 + np.arange(2)).ravel(), [int(rng.integers(row))]])


@given(st.integers(0, 2**32 - 1), st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]))
@settings(max_examples=80, deadline=None)
def test_refresh_gathers_exactly_the_listed_blocks(seed: int, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(seed)
    cache = torch.from_numpy(rng.integers(0, 256, (7, 2, 4, 8), dtype=np.uint8)).view(dtype)
    flat = cache.view(torch.uint8).reshape(7, -1).numpy()
    gather = _gathers(rng, flat.shape[1], cache.element_size())
    mirror = KvMirror(cache, gather)
    blocks = rng.integers(-2, 10, 5)  # ids outside the cache are skipped
    mirror.refresh(blocks)
    want = np.zeros((7, len(gather)), dtype=np.uint8)
    inside = blocks[(blocks >= 0) & (blocks < 7)]
    want[inside] = flat[inside][:, gather]
    np.testing.assert_array_equal(mirror.rows.numpy(), want)
    mirror.refresh()
    np.testing.assert_array_equal(mirror.rows.numpy(), flat[:, gather])


@given(st.integers(0, 2**32 - 1), st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]))
@settings(max_examples=60, deadline=None)
def test_refresh_of_two_lists_gathers_exactly_their_union(seed: int, dtype: torch.dtype) -> None:
    """`refresh(blocks, more)` (TAIL's blocks and a sweep's, in one call) leaves the rows that
    `refresh(blocks)` then `refresh(more)` would: `more` a column of snapshot rows (strided),
    ids outside the cache skipped, every other row untouched."""
    rng = np.random.default_rng(seed)
    cache = torch.from_numpy(rng.integers(0, 256, (9, 2, 4, 8), dtype=np.uint8)).view(dtype)
    flat = cache.view(torch.uint8).reshape(9, -1).numpy()
    gather = _gathers(rng, flat.shape[1], cache.element_size())
    blocks = rng.integers(-2, 12, int(rng.integers(0, 6)))
    snapshot_rows = rng.integers(-1, 12, (int(rng.integers(0, 6)), 4))
    more = snapshot_rows[:, 0]
    mirror = KvMirror(cache, gather)
    mirror.refresh(blocks, more)
    want = np.zeros((9, len(gather)), dtype=np.uint8)
    ids = np.concatenate([blocks, more])
    inside = ids[(ids >= 0) & (ids < 9)]
    want[inside] = flat[inside][:, gather]
    np.testing.assert_array_equal(mirror.rows.numpy(), want)


@pytest.mark.parametrize(("es", "read"), [(2, 16), (2, 32), (4, 16)])
def test_a_vnni_gather_is_mirrored_exactly(es: int, read: int) -> None:
    gather = _amx_like(heads=2, block=32, dim=64, es=es, read=read)
    cache = torch.from_numpy(
        np.random.default_rng(es).integers(0, 256, (5, 2, 32, 128 * es), dtype=np.uint8)
    )
    mirror = KvMirror(cache.view(torch.bfloat16 if es == 2 else torch.float32), gather)
    assert mirror._kernel is not None and len(mirror._kernel[3]) == len(gather) // es
    mirror.refresh(np.array([4, 0, 2]))
    flat = cache.reshape(5, -1).numpy()
    np.testing.assert_array_equal(mirror.rows.numpy()[[4, 0, 2]], flat[[4, 0, 2]][:, gather])
    assert not mirror.rows.numpy()[[1, 3]].any()


@given(st.lists(st.integers(0, 4095), min_size=1, max_size=64), st.sampled_from([1, 2, 4, 8]))
@settings(max_examples=100, deadline=None)
def test_prefetched_lines_cover_every_gathered_element_once(offsets: list[int], es: int) -> None:
    """The gather's prefetch hints name each 64-byte line it reads, each once, by the offset
    (in elements) of the line's first element."""
    from kvcanary.adapters.vllm.mirror import _line_offsets

    gather = np.array(offsets, dtype=np.int64)
    lines = _line_offsets(gather, es)
    assert len(set(lines.tolist())) == len(lines)
    assert set((lines * es // 64).tolist()) == set((gather * es // 64).tolist())
    assert ((lines * es) % 64 == 0).all()
