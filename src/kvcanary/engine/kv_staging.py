"""KV staging pages in a shared byte buffer: how KV crosses from a prefill to a decode process.

The buffer (e.g. a `multiprocessing.shared_memory.SharedMemory`) holds `num_pages` staging
pages; page `p` holds one token's K and V of every layer, `[2, num_layers, heads, dim]` in the
pool's dtype. The decode side owns the page allocator (`StagingPages`) and tells the prefill side
which pages to fill, much as a decode engine hands its destination indices to the prefill
writer. Sidecar records travel beside, in the control message (`SidecarRecords.to_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcanary.contract import SidecarRecords
from kvcanary.engine.landing import KvPages

__all__ = ["KvStaging", "StagingPages", "staging_bytes"]


def staging_bytes(num_pages: int, num_layers: int, heads: int, dim: int, dtype: torch.dtype) -> int:
    """Bytes a staging buffer of `num_pages` pages needs."""
    return num_pages * 2 * num_layers * heads * dim * torch.empty((), dtype=dtype).element_size()


class KvStaging:
    """A typed view `[num_pages, 2, num_layers, heads, dim]` over a shared byte buffer."""

    __slots__ = ("_pages",)

    def __init__(
        self, buffer: memoryview, *, num_pages: int, num_layers: int, heads: int, dim: int,
        dtype: torch.dtype,
    ) -> None:  # fmt: skip
        """View `buffer` (at least `staging_bytes(...)` long; shared, never copied)."""
        need = staging_bytes(num_pages, num_layers, heads, dim, dtype)
        if len(buffer) < need:
            raise ValueError(f"KvStaging: buffer of {len(buffer)} bytes, need {need}")
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=need)
        self._pages = flat.view(dtype).view(num_pages, 2, num_layers, heads, dim)

    @property
    def num_pages(self) -> int:
        """Staging pages."""
        return int(self._pages.shape[0])

    def _index(self, pages: list[int]) -> torch.Tensor:
        bad = [p for p in pages if not 0 <= p < self.num_pages]
        if bad:
            raise ValueError(f"KvStaging: page {bad[0]} is outside [0, {self.num_pages})")
        return torch.tensor(pages, dtype=torch.int64)

    def write(self, pages: list[int], kv: KvPages) -> None:
        """Store `kv` (its page j at staging page `pages[j]`)."""
        idx = self._index(pages)
        self._pages[idx, 0] = kv.k.transpose(0, 1).to(self._pages.dtype)
        self._pages[idx, 1] = kv.v.transpose(0, 1).to(self._pages.dtype)

    def read(
        self, pages: list[int], *, start: int, tokens: tuple[int, ...],
        records: SidecarRecords | None,
    ) -> KvPages:  # fmt: skip
        """Copies of the staged pages as `KvPages` (positions `start ..`)."""
        got = self._pages[self._index(pages)].clone()
        return KvPages(got[:, 0].transpose(0, 1).contiguous(),
                       got[:, 1].transpose(0, 1).contiguous(), records, start, tokens)  # fmt: skip

    def release(self) -> None:
        """Drop the view so the shared buffer can be closed."""
        self._pages = torch.empty(0)


@dataclass(slots=True)
class StagingPages:
    """Free list of staging page indices (owned by the decode side)."""

    num_pages: int
    _free: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self._free = list(range(self.num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Pages available."""
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """`n` pages, or None when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        """Return pages."""
        self._free.extend(pages)
