"""`KvMirror`: a token-major copy of the KV bytes the canary folds, for layouts that are not.

vLLM's CPU attention stores some heads transposed or VNNI-packed (`layout.calibrate` maps
where every token element lands). The canary folds a token's first bytes as one contiguous run,
so for those heads the adapter keeps a mirror: row `b` holds, column by column, bytes
`gather[c]` of cache block `b`, re-gathered right before every check that reads it.

After a model forward a decode step's re-gather (about 1 us a block) waits on memory: a block's
pieces are a few bytes on each of a few dozen cache lines, which the hardware prefetcher does
not foresee. The gather therefore requests the lines of the blocks two ahead (`_AHEAD`):
measured inside vLLM on an AMX machine (8 rows, four mirrored sources), 31.6-31.9 -> 24.7-25.9 us
a step. Measured and not kept: moving the AMX layout's K in 4-byte VNNI pairs (a quarter fewer
loads) made a re-gather of 88 blocks 32 -> 25 us in a loop but nothing inside vLLM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from numba import njit

from kvcanary.canary.kernels.fast import prefetch_element

__all__ = ["KvMirror"]

_INT64 = np.dtype(np.int64)
_AHEAD = 2  # blocks: a block's lines are requested this far ahead of its gather


@njit(cache=True)
def _prefetch_block(src, stride, lines, b, n):  # type: ignore[no-untyped-def]
    if 0 <= b < n:
        for j in range(lines.shape[0]):
            prefetch_element(src, b * stride + lines[j])


@njit(cache=True)
def _gather_rows(dst, src, stride, gather, lines, blocks):  # type: ignore[no-untyped-def]
    """`dst[b, g] = src[b * stride + gather[g]]` for each listed block `b` inside `dst`; `lines`
    (offsets in `src` elements of the cache lines a block's gather reads) are prefetched
    `_AHEAD` blocks ahead."""
    n = dst.shape[0]
    m = blocks.shape[0]
    for i in range(min(_AHEAD, m)):  # the first blocks' lines, then each later block's
        _prefetch_block(src, stride, lines, blocks[i], n)
    for i in range(m):
        b = blocks[i]
        if i + _AHEAD < m:
            _prefetch_block(src, stride, lines, blocks[i + _AHEAD], n)
        if b < 0 or b >= n:
            continue
        base = b * stride
        row = dst[b]
        for g in range(gather.shape[0]):
            row[g] = src[base + gather[g]]


def _int64(blocks: npt.NDArray[np.integer]) -> npt.NDArray[np.int64]:
    """`blocks` as int64; the adapter's own int64 lists as they are (no conversion call: each
    NumPy call is cold after a forward)."""
    if type(blocks) is np.ndarray and blocks.dtype == _INT64:
        return blocks
    return np.asarray(blocks, dtype=np.int64)


@njit(cache=True)
def _gather_two(dst, src, stride, gather, lines, blocks, more):  # type: ignore[no-untyped-def]
    """`_gather_rows` of `blocks`, then of `more`, in one call (one dispatch after a forward,
    where each costs ~10 us of cold caches)."""
    _gather_rows(dst, src, stride, gather, lines, blocks)
    _gather_rows(dst, src, stride, gather, lines, more)


def _line_offsets(gather: npt.NDArray[np.int64], es: int) -> npt.NDArray[np.int64]:
    """The first element offset of each 64-byte line that element offsets `gather` touch."""
    return np.unique(gather * es // 64) * 64 // es


def _element_gather(
    gather: npt.NDArray[np.int64], stride: int, es: int
) -> npt.NDArray[np.int64] | None:
    """`gather` (byte offsets) as element offsets when it takes whole, aligned `es`-byte
    elements in order (the folded bytes of a head are whole elements), else None."""
    if es <= 1 or len(gather) % es or stride % es:
        return None
    g = gather.reshape(-1, es)
    if (g[:, 0] % es).any() or (g != g[:, :1] + np.arange(es)).any():
        return None
    return g[:, 0] // es


class KvMirror:
    """A token-major copy of the folded bytes of several non-token-major sources.

    Column `c` of mirror row `b` is byte `gather[c]` of cache block `b`. `refresh(blocks)`
    re-gathers those rows from the live cache; the adapter calls it right before each canary
    stage that reads them, so a mirror row is the cache's bytes at check time.
    """

    def __init__(self, cache: torch.Tensor, gather: npt.NDArray[np.int64]) -> None:
        n = cache.shape[0]
        self._bytes = cache.view(torch.uint8).view(n, -1).numpy()  # shares the cache's memory
        self._gather = gather.astype(np.int64)
        self._flat = self._bytes.reshape(-1) if self._bytes.flags.c_contiguous else None
        self._stride = self._bytes.shape[1]
        self.rows = torch.zeros((n, len(gather)), dtype=torch.uint8)
        self._rows = self.rows.numpy()
        # the compiled gather moves whole elements where it can (2 or 4 bytes a load)
        self._kernel: (
            tuple[
                npt.NDArray[Any],
                npt.NDArray[Any],
                int,
                npt.NDArray[np.int64],
                npt.NDArray[np.int64],
            ]
            | None
        )
        self._kernel = None
        if self._flat is not None:
            es = cache.element_size()
            elems = _element_gather(self._gather, self._stride, es)
            utype = {2: np.uint16, 4: np.uint32, 8: np.uint64}.get(es)
            if elems is not None and utype is not None:
                self._kernel = (self._rows.view(utype), self._flat.view(utype),
                                self._stride // es, elems, _line_offsets(elems, es))  # fmt: skip
            else:
                self._kernel = (self._rows, self._flat, self._stride, self._gather,
                                _line_offsets(self._gather, 1))  # fmt: skip

    def refresh(self, blocks: npt.NDArray[np.integer] | None = None,
                more: npt.NDArray[np.integer] | None = None) -> None:  # fmt: skip
        """Re-gather `blocks` (all blocks when None; repeats are fine; ids outside the cache are
        skipped: they come from a bad table or slot, which the canary's range checks report),
        then `more` when given (a second list, gathered in the same compiled call). NumPy fancy
        indexing over one flat view where there is no compiled gather (torch's 2-D advanced
        indexing is about 100x slower here)."""
        kernel = self._kernel
        if kernel is not None and blocks is not None:
            if more is None:
                _gather_rows(*kernel, _int64(blocks))  # skips ids outside the cache
            else:
                _gather_two(*kernel, _int64(blocks), _int64(more))
            return
        n = len(self._rows)
        if kernel is not None:
            _gather_rows(*kernel, np.arange(n))
            if more is not None:
                _gather_rows(*kernel, _int64(more))
            return
        if more is not None:
            self.refresh(blocks)
            blocks = more
        if blocks is None:
            idx = np.arange(n)
        else:
            idx = np.asarray(blocks, dtype=np.int64)
            if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
                idx = idx[(idx >= 0) & (idx < n)]
        if self._flat is not None:
            self._rows[idx] = self._flat[idx[:, None] * self._stride + self._gather[None, :]]
        else:
            self._rows[idx] = np.take(self._bytes[idx], self._gather, axis=1)

    @contextlib.contextmanager
    def flips_written_back(self, blocks: npt.NDArray[np.integer]) -> Iterator[None]:
        """Re-gather `blocks`, run the body (a fault injector), then store into the cache every
        byte of those mirror rows that the body changed.

        Fault injection only: an injector that flips a byte of a mirrored source flips this copy,
        which the next `refresh` would overwrite unseen; written back, the flip is in the cache,
        where the forward reads it and TAIL finds it. Bytes the body changed in the cache itself
        are left alone (only mirror bytes that differ from their re-gather are stored)."""
        n = len(self._rows)
        idx = np.asarray(blocks, dtype=np.int64)
        idx = np.unique(idx[(idx >= 0) & (idx < n)])
        self.refresh(idx)
        before = self._rows[idx]  # a copy (fancy indexing)
        yield
        rows, cols = np.nonzero(self._rows[idx] != before)
        if len(rows):
            self._bytes[idx[rows], self._gather[cols]] = self._rows[idx[rows], cols]
