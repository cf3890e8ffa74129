"""Engine-neutral pieces of the vLLM adapter: paged tables to a ForwardView (SPEC §2.2, §2.6).

NumPy and torch only (no vLLM import), so they can be exercised without vLLM installed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvcanary.contract.view import ForwardView

__all__ = ["build_forward_view", "paged_req_to_token", "split_waves"]

I64 = npt.NDArray[np.int64]


def paged_req_to_token(
    block_table: npt.NDArray[np.integer], num_reqs: int, block_size: int, width: int
) -> I64:
    """`req_to_token` for batch rows `0..num_reqs-1` of a paged block table (SPEC §2.6).

    Row `r` of the block table becomes row `r + 1` of the result (row 0 stays the reserved
    all-zero row). Entry `[r + 1, p]` is `block_table[r, p // B] * B + p % B`, except that every
    slot of the reserved null block 0 is presented as slot 0. `width` (tokens) is rounded up to a
    whole number of blocks.
    """
    nblocks = max(1, -(-width // block_size))
    nblocks = min(nblocks, block_table.shape[1])
    out = np.zeros((num_reqs + 1, nblocks * block_size), dtype=np.int64)
    if num_reqs == 0:
        return out
    blocks = block_table[:num_reqs, :nblocks].astype(np.int64)
    slots = blocks[:, :, None] * block_size + np.arange(block_size, dtype=np.int64)
    slots[blocks == 0] = 0
    out[1:] = slots.reshape(num_reqs, -1)
    return out


def build_forward_view(
    *,
    block_table: npt.NDArray[np.integer],
    block_size: int,
    num_computed: npt.NDArray[np.integer],
    num_scheduled: npt.NDArray[np.integer],
    input_ids: npt.NDArray[np.integer],
    positions: npt.NDArray[np.integer],
    slot_mapping: npt.NDArray[np.integer],
    truth_tokens: Sequence[Sequence[int]] | None = None,
    req_to_token: npt.NDArray[np.integer] | None = None,
    total: int | None = None,
    min_slot: int | None = None,
) -> ForwardView:
    """One ForwardView for a vLLM-style batch: request `i` (persistent-batch row `i`) becomes view
    row `i + 1`; `prefix_lens` are the computed tokens and `extend_lens` the scheduled ones.

    The flat arrays are truncated to the scheduled token count (views of the caller's arrays
    where they already are int64; the canary snapshots them); slots below -1 become -1 (a copy).
    `req_to_token` is derived from the block table at call time (or passed in, built by
    `prep.StepPrep` from the same table), so the view is not `mutable` (fault injection that
    edits engine tables skips). Slots in the null block are passed through unchanged in
    `out_slots` (a write there is itself a bug the TAIL stage records). `total` (the scheduled
    token count) and `min_slot` (the smallest slot, or 0) save a pass when the caller knows them.
    """
    num_reqs = len(num_scheduled)
    if total is None:
        total = int(np.asarray(num_scheduled, dtype=np.int64).sum())
    # the canary snapshots what it reads: int64 arrays are passed as views
    prefix = np.asarray(num_computed[:num_reqs], dtype=np.int64)
    extend = np.asarray(num_scheduled, dtype=np.int64)
    if req_to_token is None:
        width = int((prefix + extend).max()) if num_reqs else 0
        req_to_token = paged_req_to_token(block_table, num_reqs, block_size, width)
    slots = np.asarray(slot_mapping[:total], dtype=np.int64)
    if min_slot is None:
        min_slot = int(slots.min()) if slots.size else 0
    if min_slot < -1:
        slots = slots.copy()
        slots[slots < 0] = -1
    # NumPy arrays, not tensors: the canary takes both, and a tensor wrapper per array is a
    # microsecond each way on every forward
    return ForwardView(
        rows=np.arange(1, num_reqs + 1, dtype=np.int64),
        prefix_lens=prefix,
        extend_lens=extend,
        input_ids=np.asarray(input_ids[:total], dtype=np.int64),
        positions=np.asarray(positions[:total], dtype=np.int64),
        out_slots=slots,
        req_to_token=np.asarray(req_to_token),
        truth_tokens=truth_tokens,
        mutable=False,
    )


def split_waves(view: ForwardView) -> list[ForwardView]:
    """Split one engine forward into canary "waves" by intra-forward prefix sharing.

    vLLM registers a block in its prefix cache when it is *scheduled*, so a request scheduled
    later in the same step can hit blocks that an earlier request of the same batch computes in
    this very forward (attention writes every token's KV before it attends, so vLLM is right).
    The canary's HEAD stage verifies every row before writing any, so such a row would see
    unwritten records. A row goes to wave `1 + max(wave of the rows that write a slot in its
    verify range)`; wave 0 runs around the model forward, later waves run after it (their HEAD
    checks then happen after the model, still before sampling). One wave: `[view]` unchanged.
    """
    rows = np.asarray(view.rows)
    n = len(rows)
    if n < 2:
        return [view]
    prefix = np.asarray(view.prefix_lens)
    extend = np.maximum(np.asarray(view.extend_lens), 0)
    starts = np.concatenate(([0], np.cumsum(extend)[:-1]))
    out_slots = np.asarray(view.out_slots)
    r2t = np.asarray(view.req_to_token)
    written = out_slots[out_slots > 0]
    in_prefix = np.arange(r2t.shape[1]) < prefix[:, None]
    if written.size == 0 or not np.isin(r2t[rows][in_prefix], written).any():
        return [view]  # the common case, decided without a Python loop over slots
    writer: dict[int, int] = {}
    for i in range(n):
        for s in out_slots[starts[i] : starts[i] + extend[i]]:
            if s > 0:
                writer[int(s)] = i
    deps: list[set[int]] = []
    for i in range(n):
        used = r2t[rows[i], : prefix[i]] if rows[i] != 0 else r2t[0, :0]
        deps.append({writer[int(s)] for s in used if int(s) in writer} - {i})
    if not any(deps):
        return [view]
    wave = [0] * n
    for _ in range(n):  # longest-path relaxation; n rounds suffice for an acyclic graph
        changed = False
        for i in range(n):
            w = 1 + max((wave[j] for j in deps[i]), default=-1)
            if w > wave[i]:
                wave[i], changed = w, True
        if not changed:
            break
    views = []
    for w in sorted(set(wave)):  # a cycle (two rows writing each other's prefix) skips levels
        sel = [i for i in range(n) if wave[i] == w]
        tok = np.concatenate([np.arange(starts[i], starts[i] + extend[i]) for i in sel])
        tpick = tok.astype(np.int64)
        pick = np.asarray(sel, dtype=np.int64)
        truth = view.truth_tokens
        views.append(
            ForwardView(
                rows=rows[pick],
                prefix_lens=prefix[pick],
                extend_lens=np.asarray(view.extend_lens)[pick],
                input_ids=np.asarray(view.input_ids)[tpick],
                positions=np.asarray(view.positions)[tpick],
                out_slots=out_slots[tpick],
                req_to_token=view.req_to_token,
                truth_tokens=None if truth is None else [truth[i] for i in sel],
                mutable=False,
            )
        )
    return views
