"""A hand-driven stand-in for an engine: slots, req_to_token, a K tensor and ForwardViews.

Only what canary tests need; the real engine lives in `kvcanary.engine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcanary.contract import BufferGroupSpec, ForwardView, GroupKind, RealKvSource

BYTES_PER_TOKEN = 32


@dataclass
class HandPool:
    """Bump-allocated slots (slot 0 reserved), a zeroed req_to_token and one K byte tensor."""

    num_slots: int = 64
    num_rows: int = 8
    max_len: int = 32
    next_slot: int = 1
    r2t: torch.Tensor = field(init=False)
    k: torch.Tensor = field(init=False)
    lengths: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.r2t = torch.zeros(self.num_rows, self.max_len, dtype=torch.int32)
        self.k = torch.zeros(self.num_slots, BYTES_PER_TOKEN, dtype=torch.uint8)

    def alloc(self, n: int) -> list[int]:
        """`n` fresh slots."""
        out = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        return out

    def share(self, src_row: int, dst_row: int, n: int) -> None:
        """Give `dst_row` the first `n` slots of `src_row` (a radix hit)."""
        self.r2t[dst_row, :n] = self.r2t[src_row, :n]
        self.lengths[dst_row] = n
        self.tokens[dst_row] = self.tokens[src_row][:n]

    def view(self, batch: list[tuple[int, list[int]]], pad_rows: int = 0) -> ForwardView:
        """A forward extending each `(row, tokens)` by `tokens` at fresh slots."""
        rows, prefix, extend, ids, pos, out = [], [], [], [], [], []
        truth = []
        for row, toks in batch:
            start = self.lengths.get(row, 0)
            slots = self.alloc(len(toks))
            self.r2t[row, start : start + len(toks)] = torch.tensor(slots, dtype=torch.int32)
            rows.append(row)
            prefix.append(start)
            extend.append(len(toks))
            ids += toks
            pos += list(range(start, start + len(toks)))
            out += slots
            self.lengths[row] = start + len(toks)
            self.tokens[row] = self.tokens.get(row, []) + toks
            truth.append(tuple(self.tokens[row]))
        rows += [0] * pad_rows
        prefix += [0] * pad_rows
        extend += [0] * pad_rows

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64)

        return ForwardView(
            rows=t(rows), prefix_lens=t(prefix), extend_lens=t(extend), input_ids=t(ids),
            positions=t(pos), out_slots=t(out), req_to_token=self.r2t, truth_tokens=truth,
        )  # fmt: skip

    def write_kv(self, view: ForwardView) -> None:
        """What the model would do: deterministic K bytes for every written slot."""
        for slot, tok, p in zip(
            view.out_slots.tolist(), view.input_ids.tolist(), view.positions.tolist(), strict=True
        ):
            if slot > 0:
                self.k[slot] = (torch.arange(BYTES_PER_TOKEN) * 7 + tok * 13 + p) % 251

    def group(self, read_bytes: int | None = 16) -> BufferGroupSpec:
        """The FULL group with the K tensor as its only source (none when read_bytes is None)."""
        sources = (
            () if read_bytes is None else (RealKvSource(self.k, 1, BYTES_PER_TOKEN, read_bytes),)
        )
        return BufferGroupSpec(
            kind=GroupKind.FULL, num_slots=self.num_slots, has_v=False, k_sources=sources
        )
