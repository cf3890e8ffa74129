"""`HostViews.prefix` is `t[:n].numpy()`, whatever sequence of tensors a runner hands in."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.adapters.vllm.host_views import HostViews


@settings(max_examples=200, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.integers(0, 2),  # which persistent buffer
            # which view of it; "again": the previous call's tensor object (vLLM hands the
            # same slice in while its batch keeps its shape); "moved": that object `set_`
            # onto another buffer in place (its identity stays, its memory does not)
            st.sampled_from(["prefix", "offset", "strided", "as_int32", "again", "moved"]),
            st.integers(0, 40),  # the tensor's length
            st.integers(0, 48),  # n (may exceed the tensor)
            st.integers(-(2**31), 2**31 - 1),  # a value the runner writes before the call
        ),
        min_size=1,
        max_size=30,
    )
)
def test_prefix_equals_torch_slice_numpy(calls: list[tuple[int, str, int, int, int]]) -> None:
    """Same values, same memory, same length as `t[:n].numpy()`: over prefixes of several
    buffers (the cache's hit), views at an offset, strided and re-typed views of the same
    address (its misses), the same tensor object again or moved in place onto other memory,
    and writes the runner makes in between (a view, never a copy)."""
    buffers = [torch.zeros(40, dtype=d) for d in (torch.int64, torch.int64, torch.int32)]
    host = HostViews()
    t = buffers[0][:0]
    for which, kind, length, n, value in calls:
        buf = buffers[which]
        if kind == "again":
            pass
        elif kind == "moved":
            if buf.dtype == t.dtype:
                t.set_(buf.untyped_storage(), which, (min(length, 40 - which),), (1,))
        elif kind == "prefix":
            t = buf[:length]
        elif kind == "offset":
            t = buf[1 : 1 + length]
        elif kind == "strided":
            t = buf[: 2 * (length // 2) : 2]
        else:  # the same address seen as another dtype
            t = buf.view(torch.int32)[:length] if buf.dtype == torch.int64 else buf[:length]
        if len(t):
            t[0] = value if t.dtype == torch.int64 else np.int32(value)
        got = host.prefix(t, n)
        want = t[:n].numpy()
        assert got.dtype == want.dtype
        assert got.shape == want.shape
        assert np.array_equal(got, want)
        if len(want):
            assert np.shares_memory(got, want)


def test_prefix_reads_what_the_runner_writes_later() -> None:
    """A cached view follows the buffer: the next step's prefix holds the new values."""
    buf = torch.arange(16, dtype=torch.int64)
    host = HostViews()
    first = host.prefix(buf[:4], 4).copy()
    buf[:8] = torch.arange(100, 108)
    assert first.tolist() == [0, 1, 2, 3]
    assert host.prefix(buf[:8], 8).tolist() == list(range(100, 108))


def test_other_devices_and_shapes_take_the_plain_path() -> None:
    """A 2-D tensor is sliced by torch, as before (rows, not elements)."""
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    assert HostViews().prefix(t, 2).tolist() == t[:2].numpy().tolist()
