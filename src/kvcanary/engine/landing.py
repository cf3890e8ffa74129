"""Moving KV pages between pools: read them with their sidecars, land them, verify them.

Every path that moves KV into a pool (a host-tier restore, a prefill->decode transfer) goes
through `land_pages`, so the order of a layer-wise transfer and the receiver's verify are the
same everywhere (SPEC §2.7 item 3, §14.4):

1. the HEAD sidecars land first, then layers 0..n-1 of K and V, then the TAIL sidecars, so a
   transfer that stops part-way leaves HEAD and TAIL disagreeing;
2. before any forward reads the landed slots, the receiver's canary verifies them: chain to the
   receiver's own predecessor slot, position, token and the real-KV fingerprint of the bytes
   that landed. The caller treats a failed landing as a miss (it frees the slots and
   recomputes), like a checksum mismatch in a storage tier.

The transfer faults of `engine.transfer_faults` hook in here (self-test only).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from kvcanary.contract import SidecarRecords, SidecarTransfer, layered_transfer_order
from kvcanary.engine.kv_pool import KvPool
from kvcanary.engine.transfer_faults import TransferFaults

__all__ = ["KvPages", "land_pages", "read_pages"]

_POS_CHAIN = slice(8, 24)  # POSITION and PREV_HASH of a 32-byte record


@dataclass(frozen=True, slots=True)
class KvPages:
    """The KV of consecutive positions `start .. start + n - 1` of one sequence.

    `k` and `v` are `[num_layers, n, heads, dim]` copies; `records` the sidecars of the same
    slots (None when the sender has no canary); `tokens[j]` the token at `start + j`.
    """

    k: torch.Tensor
    v: torch.Tensor
    records: SidecarRecords | None
    start: int
    tokens: tuple[int, ...]

    @property
    def num_pages(self) -> int:
        """Positions carried."""
        return int(self.k.shape[1])

    def slice(self, a: int, b: int) -> KvPages:
        """Pages `[a, b)` (positions `start + a ..`)."""
        recs = None if self.records is None else self.records.slice(a, b)
        return KvPages(self.k[:, a:b].clone(), self.v[:, a:b].clone(), recs, self.start + a,
                       self.tokens[a:b])  # fmt: skip


def read_pages(
    pool: KvPool, sidecars: SidecarTransfer, slots: list[int], start: int, tokens: tuple[int, ...]
) -> KvPages:
    """Copy the KV of `slots` (positions `start ..`) out of `pool`, with their sidecars."""
    index = torch.tensor(slots, dtype=torch.int64)
    ks = torch.stack([pool.k(layer)[index] for layer in range(pool.num_layers)])
    vs = torch.stack([pool.v(layer)[index] for layer in range(pool.num_layers)])
    return KvPages(ks, vs, sidecars.export_sidecars(group="full", slots=slots), start, tokens)


def _differs(current: SidecarRecords, incoming: SidecarRecords, j: int) -> bool:
    """Whether landing record j would change the slot's TAIL POSITION or PREV_HASH (only then
    can a fault that leaves the old record in place be told apart from a correct landing)."""
    a, b = j * 32, (j + 1) * 32
    return current.tail[0][a:b][_POS_CHAIN] != incoming.tail[0][a:b][_POS_CHAIN]


def land_pages(
    pool: KvPool,
    sidecars: SidecarTransfer,
    slots: list[int],
    pages: KvPages,
    *,
    prev_slot: int,
    faults: TransferFaults | None = None,
) -> int:
    """Land `pages` at the receiver's `slots` (page j at `slots[j]`), layer by layer between the
    two sidecar entries, then verify them. `prev_slot` is the receiver's slot of position
    `pages.start - 1` (-1 when `start` is 0). Returns the violations the verify recorded."""
    n = len(slots)
    if n != pages.num_pages:
        raise ValueError(f"land_pages: {pages.num_pages} pages for {n} slots")
    dest, written, stop_after = list(slots), list(range(n)), pool.num_layers
    k, v = pages.k, pages.v
    if faults is not None and pages.records is not None and sidecars.carries_sidecars:
        dest, written, stop_after, k = _inject(pool, sidecars, slots, pages, faults)
    landing = [dest[j] for j in written]
    for entry in layered_transfer_order(pool.num_layers):
        if entry == "head" and pages.records is not None and landing:
            current = sidecars.export_sidecars(group="full", slots=landing)
            head = pages.records.slice(0, n)
            picked = _pick(head, written)
            assert current is not None
            sidecars.import_sidecars(records=replace(picked, tail=current.tail), slots=landing)
        elif isinstance(entry, int):
            if entry >= stop_after:
                break  # the transfer stopped here: later layers and the TAIL entry never land
            idx = torch.tensor(written, dtype=torch.int64)
            pool.write(
                entry, torch.tensor(landing, dtype=torch.int64), k[entry][idx], v[entry][idx]
            )
        elif entry == "tail" and pages.records is not None and landing:
            sidecars.import_sidecars(records=_pick(pages.records, written), slots=landing)
    prevs = [prev_slot, *slots[:-1]]
    return sidecars.verify_landed(
        group="full", slots=slots, positions=list(range(pages.start, pages.start + n)),
        prev_slots=prevs, tokens=list(pages.tokens),
    )  # fmt: skip


def _pick(records: SidecarRecords, rows: list[int]) -> SidecarRecords:
    """Records `rows` (in that order) of `records`."""

    def take(buf: bytes) -> bytes:
        return b"".join(buf[j * 32 : (j + 1) * 32] for j in rows)

    return SidecarRecords(records.group, records.halves, tuple(take(b) for b in records.head),
                          tuple(take(b) for b in records.tail))  # fmt: skip


def _inject(
    pool: KvPool,
    sidecars: SidecarTransfer,
    slots: list[int],
    pages: KvPages,
    faults: TransferFaults,
) -> tuple[list[int], list[int], int, torch.Tensor]:
    """Apply at most one armed landing fault; returns (destinations, pages written, layers
    landed, K in transit). A firing journals the damaged receiver slots and their successors
    (whose chain check then fails too)."""
    n, layers = len(slots), pool.num_layers
    dest, written, k = list(slots), list(range(n)), pages.k
    assert pages.records is not None
    current = sidecars.export_sidecars(group="full", slots=slots)
    assert current is not None
    differs = [j for j in range(n) if _differs(current, pages.records, j)]
    pos = [pages.start + j for j in range(n)]

    def record(
        name: str, damaged: Iterable[int], description: str, extra: Iterable[int] = ()
    ) -> None:
        idx = sorted(set(damaged) | {j + 1 for j in damaged if j + 1 < n})
        faults.record(name, [*(slots[j] for j in idx), *extra], [pos[j] for j in idx], description)

    if faults.armed("wrong_slots") and n >= 2:
        i, j = sorted(faults.rng("wrong_slots").sample(range(n), 2))
        dest[i], dest[j] = dest[j], dest[i]
        record(
            "wrong_slots",
            (i, j),
            f"pages of positions {pos[i]} and {pos[j]} landed in each other's slots",
        )
    elif faults.armed("page_never_written") and differs:
        j = faults.rng("page_never_written").choice(differs)
        written.remove(j)
        record(
            "page_never_written",
            (j,),
            f"page of position {pos[j]} never written to slot {slots[j]}; landing reported complete",
        )
    elif faults.armed("partial_layers") and differs:
        stop = faults.rng("partial_layers").randrange(layers)
        record(
            "partial_layers",
            differs,
            f"transfer stopped after {stop} of {layers} layers: TAIL sidecars never landed",
        )
        return dest, written, stop, k
    elif faults.armed("bit_flip_in_transit"):
        j = faults.rng("bit_flip_in_transit").randrange(n)
        k = k.clone()
        k[0, j].view(-1).view(torch.uint8)[0] ^= 0xFF
        record(
            "bit_flip_in_transit",
            (j,),
            f"byte 0 of layer-0 K of position {pos[j]} flipped in transit",
        )
    return dest, written, layers, k
