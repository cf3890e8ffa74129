"""Paged K/V access: store this forward's K/V into the pool, attend through `req_to_token`.

This is the property the canary relies on (SPEC §2.7, obligation 2): attention reads *every*
key and value, including the ones this forward just wrote, from the pool slots named by the live
`req_to_token` row. A wrong table entry, a wrong `out_slots` entry or a flipped KV byte therefore
changes what the model computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcanary.engine.kv_pool import KvPool
from kvcanary.engine.model import causal_attention

__all__ = ["PagedKv"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedKv:
    """The `KvAccess` of one paged forward over a batch of request chunks.

    Chunk `b` belongs to `req_to_token` row `rows[b]`, has `prefix_lens[b]` tokens already cached
    and computes `extend_lens[b]` new ones, whose flat entries follow the previous chunk's.
    `out_slots[i]` (-1 = skip) is where flat entry `i` stores its K/V.
    """

    pool: KvPool
    req_to_token: torch.Tensor
    out_slots: torch.Tensor
    rows: Sequence[int]
    prefix_lens: Sequence[int]
    extend_lens: Sequence[int]

    def __post_init__(self) -> None:
        if not len(self.rows) == len(self.prefix_lens) == len(self.extend_lens):
            raise ValueError(
                "PagedKv rows, prefix_lens and extend_lens lengths differ: "
                f"{len(self.rows)}, {len(self.prefix_lens)}, {len(self.extend_lens)}"
            )
        total = self.num_tokens
        if self.out_slots.shape[0] < total:
            raise ValueError(
                f"PagedKv chunks need {total} out_slots but only {self.out_slots.shape[0]} given"
            )

    @property
    def num_tokens(self) -> int:
        """Flat token entries computed by this forward."""
        return sum(max(0, n) for n in self.extend_lens)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this forward's K/V (`[T, kv_heads, dim]`) of `layer` to `out_slots`."""
        self.pool.write(layer, self.out_slots[: k.shape[0]], k, v)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store `k`, `v`, then let each chunk's queries attend causally over K/V gathered from
        the pool at `req_to_token[row, :prefix_len + extend_len]`."""
        self.store(layer, k, v)
        out = torch.zeros_like(q)
        start = 0
        for row, prefix_len, extend_len in zip(
            self.rows, self.prefix_lens, self.extend_lens, strict=True
        ):
            if extend_len <= 0:
                continue
            end = start + extend_len
            slots = self.req_to_token[row, : prefix_len + extend_len]
            keys, values = self.pool.gather(layer, slots)
            out[start:end] = causal_attention(q[start:end], keys, values, prefix_len)
            start = end
        return out
