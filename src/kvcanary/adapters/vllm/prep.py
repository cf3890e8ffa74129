"""The worker's per-step preparation in one compiled pass (numba): the view's int64 arrays from
the runner's buffers, the persistent `req_to_token` synced with the block table, whether the
forward needs canary waves, and the cache blocks the TAIL stage reads.

One call replaces some fifty small NumPy calls per step (each a few microseconds on a busy
CPU): the work is proportional to the block-table entries and the scheduled tokens, with one
dispatch as its constant. Every input is untrusted: an id outside the cache never indexes
anything here (it only turns the wave test conservative and is left to the canary's range
checks, which report it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from numba import njit

from kvcanary.canary.config import VERIFY_STRIDE_SPAN
from kvcanary.canary.kernels.fast import stride_verifies
from kvcanary.contract import ForwardView, TruthTable

__all__ = ["StepPrep"]

I64 = npt.NDArray[np.int64]


@njit(cache=True)
def _verified_block(c, b, p, stride, phase):  # type: ignore[no-untyped-def]
    """Whether a stride's `phase` verifies a position of block `c` (positions `[c * b,
    min((c + 1) * b, p))`) of a row with `p` computed tokens: the canary's own rule
    (`stride_verifies`, docs/spec.md §5.5) at the first position of each unit the block
    touches."""
    first = c * b // VERIFY_STRIDE_SPAN
    last = (min((c + 1) * b, p) - 1) // VERIFY_STRIDE_SPAN
    for u in range(first, last + 1):
        if stride_verifies(u * VERIFY_STRIDE_SPAN, stride, phase):
            return True
    return False


@njit(cache=True)
def _prep(  # type: ignore[no-untyped-def]
    bt, num_reqs, nblocks, computed, scheduled, slots, b, table, seen, owner, listed, tail,
    stride, phase,
):  # fmt: skip
    """Returns `(tail entries, cross, min slot)`; see `StepPrep.forward`."""
    n_cache = owner.shape[0]
    width = min(bt.shape[1], seen.shape[1])
    for r in range(num_reqs):  # 1. req_to_token rows r + 1: only the block ids that changed
        for c in range(nblocks):
            v = np.int64(bt[r, c])
            if v != seen[r, c]:
                seen[r, c] = v
                for j in range(b):
                    table[r + 1, c * b + j] = v * b + j if v != 0 else 0
    cross = False
    k = 0
    t = 0
    low = np.int64(0)
    for r in range(num_reqs):  # 2. the blocks this forward writes, and their writer rows
        for _ in range(max(np.int64(scheduled[r]), 0)):
            if t >= slots.shape[0]:
                break
            s = slots[t]
            t += 1
            low = min(low, s)
            if s < 0:
                continue
            blk = s // b
            if blk >= n_cache:
                cross = True  # not a cache slot: let the exact test and the canary decide
                continue
            if s > 0:
                if owner[blk] == -1:
                    owner[blk] = r
                elif owner[blk] != r:
                    cross = True  # two rows write one block
            if not listed[blk]:  # each block once: a prefill chunk writes 32 slots of a block
                listed[blk] = True
                tail[k] = blk
                k += 1
    for r in range(num_reqs):  # 3. prefix blocks: TAIL verifies them; a cross-row hit?
        p = np.int64(computed[r])
        nb = min((p + b - 1) // b, width) if p > 0 else 0
        for c in range(nb):
            v = np.int64(bt[r, c])
            if v < 0 or v >= n_cache:
                cross = True
                continue
            w = owner[v]
            if w != -1 and w != r:
                cross = True
            if stride > 1 and not _verified_block(c, b, p, stride, phase):
                continue  # TAIL reads none of its slots this step (written blocks are listed)
            if not listed[v]:  # shared prefix blocks, and a row's own last (written) block
                listed[v] = True
                tail[k] = v
                k += 1
    for i in range(k):
        listed[tail[i]] = False
    t = 0
    for r in range(num_reqs):  # 4. reset the scratch
        for _ in range(max(np.int64(scheduled[r]), 0)):
            if t >= slots.shape[0]:
                break
            s = slots[t]
            t += 1
            if s > 0 and s // b < n_cache:
                owner[s // b] = -1
    return k, cross, low


@njit(cache=True)
def _shape_into(qsl, computed, prompt, num_reqs, ids, pos, slots, out):  # type: ignore[no-untyped-def]
    """`out[:]` = rows | prefix lens | extend lens | ids | positions | slots (below -1 as -1),
    all int64; returns `(need, chunked)`: the longest row's end (computed + scheduled), and the rows
    still inside their prompt after this forward."""
    n = num_reqs
    need = np.int64(0)
    chunked = 0
    for r in range(n):
        c = np.int64(computed[r])
        e = np.int64(qsl[r + 1]) - np.int64(qsl[r])
        out[r] = r + 1
        out[n + r] = c
        out[2 * n + r] = e
        need = max(need, c + e)
        chunked += c + e < np.int64(prompt[r])
    k = 3 * n
    for i in range(ids.shape[0]):
        out[k + i] = ids[i]
    k += ids.shape[0]
    for i in range(pos.shape[0]):
        out[k + i] = pos[i]
    k += pos.shape[0]
    for i in range(slots.shape[0]):
        out[k + i] = max(np.int64(slots[i]), np.int64(-1))
    return need, chunked


#: `_forward` statuses: done; a buffer is too small (grow, call again); the table is too narrow
#: (grow it, call again); the batch has more rows than the block table; a batch array is shorter
#: than the batch's rows. Nothing is written on any status but `_DONE` and `_GROW_TABLE`
#: (which only filled the view's buffer, rewritten by the next call).
_DONE, _GROW_BUFFERS, _GROW_TABLE, _TOO_MANY_ROWS, _SHORT_ARRAYS = 0, 1, 2, 3, 4


@njit(cache=True)
def _forward(  # type: ignore[no-untyped-def]
    bt, qsl, computed, prompt, num_reqs, ids, pos, slots, num_tokens, b, out, table, seen, owner,
    listed, tail, stride, phase,
):  # fmt: skip
    """`StepPrep.forward`'s checks, the cut of the flat arrays to `num_tokens` (-1: whole),
    `_shape_into`, then `_prep`. Returns `(status, chunked, nblocks, tail entries, cross, min
    slot, ids, positions, slots)`, the last three the cut lengths."""
    n = num_reqs
    if n > seen.shape[0]:
        return _TOO_MANY_ROWS, 0, 0, 0, False, np.int64(0), 0, 0, 0
    if min(qsl.shape[0] - 1, computed.shape[0], prompt.shape[0]) < n:
        return _SHORT_ARRAYS, 0, 0, 0, False, np.int64(0), 0, 0, 0
    ni, npos, ns = ids.shape[0], pos.shape[0], slots.shape[0]
    if num_tokens >= 0:
        ni, npos, ns = min(ni, num_tokens), min(npos, num_tokens), min(ns, num_tokens)
    if 3 * n + ni + npos + ns > out.shape[0] or n * bt.shape[1] + ns > tail.shape[0]:
        return _GROW_BUFFERS, 0, 0, 0, False, np.int64(0), ni, npos, ns
    cut = slots[:ns]
    need, chunked = _shape_into(qsl, computed, prompt, n, ids[:ni], pos[:npos], cut, out)
    nblocks = max(np.int64(1), min(-(-need // b), np.int64(bt.shape[1])))
    if nblocks > seen.shape[1]:
        return _GROW_TABLE, chunked, nblocks, 0, False, np.int64(0), ni, npos, ns
    k, cross, low = _prep(bt, n, nblocks, out[n : 2 * n], out[2 * n : 3 * n], cut, b, table,
                          seen, owner, listed, tail, stride, phase)  # fmt: skip
    return _DONE, chunked, nblocks, k, cross, low, ni, npos, ns


class StepPrep:
    """Per-worker state of the compiled pass: the persistent `req_to_token` (row `r + 1` is
    persistent-batch row `r`, as `view.paged_req_to_token` builds it), the block ids it expands,
    two per-cache-block scratches (all -1 and all False between calls), and the buffers the
    view's arrays and the TAIL block list live in (kept across calls: a view is valid until the
    next `forward`)."""

    def __init__(self, block_table: npt.NDArray[np.integer[Any]], block_size: int,
                 num_cache_blocks: int) -> None:  # fmt: skip
        self.block_size = block_size
        self._rows = block_table.shape[0]
        self._grow(1)
        self._owner = np.full(num_cache_blocks, -1, dtype=np.int64)
        self._listed = np.zeros(num_cache_blocks, dtype=np.bool_)
        self._out: I64 = np.zeros(0, dtype=np.int64)  # the view's arrays, back to back
        self._tail: I64 = np.zeros(0, dtype=np.int64)
        self._view: ForwardView | None = None  # the last view and what it was cut for
        self._view_key: tuple[Any, ...] = ()
        self.tail_blocks: I64 = np.zeros(0, dtype=np.int64)
        self.cross = False
        self.min_slot = 0
        self.chunked = 0  # after `forward`: rows still inside their prompt

    def _grow(self, cols: int) -> None:
        """Room for `cols` blocks per row (the table starts small and doubles: its memory follows
        the longest context seen, not `max_model_len`); a new table is rebuilt on first use."""
        self.table = np.zeros((self._rows + 1, cols * self.block_size), dtype=np.int64)
        self._seen = np.zeros((self._rows, cols), dtype=np.int64)

    def _make_room(self, status: int, n: int, cols: int, flat: int, ns: int,
                   nblocks: int) -> None:  # fmt: skip
        """What a `_forward` status other than `_DONE` asks for: larger buffers, a wider table,
        or (rows the table or the batch arrays do not have) a `ValueError`."""
        if status == _TOO_MANY_ROWS:
            raise ValueError(f"kv-canary: {n} rows exceed the block table's "
                             f"{self._seen.shape[0]}")  # fmt: skip
        if status == _SHORT_ARRAYS:
            raise ValueError(f"kv-canary: the runner's batch arrays are shorter than its "
                             f"{n} rows")  # fmt: skip
        if status == _GROW_BUFFERS:
            self._out = np.empty(max(3 * n + flat, 2 * len(self._out)), dtype=np.int64)
            self._tail = np.empty(max(n * cols + ns, 2 * len(self._tail)), dtype=np.int64)
        else:  # wider than the table so far
            self._grow(min(cols, max(nblocks, 2 * self._seen.shape[1])))
        self._view_key = ()

    def forward(self, block_table: npt.NDArray[np.integer[Any]], num_reqs: int,
                query_start_loc: npt.NDArray[np.integer[Any]],
                num_computed: npt.NDArray[np.integer[Any]],
                num_prompt: npt.NDArray[np.integer[Any]], input_ids: npt.NDArray[np.integer[Any]],
                positions: npt.NDArray[np.integer[Any]],
                slots: npt.NDArray[np.integer[Any]],
                truth_tokens: TruthTable | None = None,
                num_tokens: int | None = None, stride: int = 1,
                phase: int = 0) -> ForwardView:  # fmt: skip
        """The view `view.build_forward_view` makes from the same inputs, with the batch's shape
        and `run` in one compiled call: rows `1..num_reqs`, their computed and scheduled token
        counts, the flat arrays as int64 (cut to their first `num_tokens` entries when given;
        slots below -1 as -1; each keeps its own length, the canary checks them) and
        `req_to_token` (rows `1..num_reqs` synced over the blocks this forward reaches).
        Afterwards `tail_blocks` lists the cache blocks TAIL reads (each row's `[0, computed)`,
        with a verify stride only the blocks holding a position its `phase` verifies, and the
        written slots' blocks; each block once), `cross` is False only when no row's
        prefix block is written by another row in this forward (then the forward is one canary
        wave), `min_slot` is the smallest slot (0 if none below) and `chunked` counts the rows
        still inside their prompt after this forward.

        The view's arrays are this object's buffers, overwritten by the next call; a call with
        the same shapes and truth table returns the same view object, refilled."""
        n = num_reqs
        cut = -1 if num_tokens is None else num_tokens
        while True:  # one call unless a buffer or the table must grow first
            status, chunked, nblocks, k, cross, low, ni, npos, ns = _forward(
                block_table, query_start_loc, num_computed, num_prompt, n, input_ids, positions,
                slots, cut, self.block_size, self._out, self.table, self._seen, self._owner,
                self._listed, self._tail, stride, phase,
            )  # fmt: skip
            if status == _DONE:
                break
            self._make_room(status, n, block_table.shape[1], ni + npos + ns, ns, nblocks)
        out = self._out
        self.tail_blocks, self.cross, self.min_slot = self._tail[:k], bool(cross), int(low)
        self.chunked = int(chunked)
        key = (n, ni, npos, ns, truth_tokens)
        if key == self._view_key and self._view is not None:
            return self._view  # the same slices of the same buffers, refilled in place
        f = 3 * n + ni
        self._view = ForwardView(
            rows=out[:n], prefix_lens=out[n : 2 * n], extend_lens=out[2 * n : 3 * n],
            input_ids=out[3 * n : f], positions=out[f : f + npos],
            out_slots=out[f + npos : f + npos + ns], req_to_token=self.table[: n + 1],
            truth_tokens=truth_tokens, mutable=False,
        )  # fmt: skip
        self._view_key = key
        return self._view
