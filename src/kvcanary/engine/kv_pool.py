"""The token-slot KV pool: one K and one V tensor per layer, addressed by slot.

Slot `s` of layer `l` holds K at `k(l)[s]` and V at `v(l)[s]`, each `[num_kv_heads, head_dim]`.
Slot 0 exists but is reserved: the slot allocator never hands it out (SPEC §2.7), so a
`req_to_token` entry of 0 means "no slot". The pool knows nothing about requests; it stores,
gathers and exposes its layer-0 bytes to the canary as `RealKvSource` views.
"""

from __future__ import annotations

from typing import Final, final

import torch

from kvcanary.contract import BufferGroupSpec, GroupKind, RealKvSource

__all__ = ["READ_MODES", "KvPool"]

#: Real-KV fingerprint modes accepted by `KvPool.buffer_group` (SPEC §2.4, §12).
READ_MODES: Final = ("none", "partial", "all")

_SUPPORTED_DTYPES: Final = (torch.float32, torch.bfloat16)
_PARTIAL_READ_BYTES: Final = 16


@final
class KvPool:
    """Per-layer K and V storage of shape `[num_slots, num_kv_heads, head_dim]`, zero-initialised.

    Both halves live in one tensor each (`[num_layers, num_slots, heads, dim]`), so `k(layer)` is
    a view and writes through any view land in the live pool.
    """

    __slots__ = ("_k", "_v")

    def __init__(
        self,
        *,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """A zeroed pool; `num_kv_heads * head_dim * element_size` must be a multiple of 16."""
        if num_slots < 2:
            raise ValueError(f"KvPool needs slot 0 plus at least one usable slot, got {num_slots}")
        if min(num_layers, num_kv_heads, head_dim) < 1:
            raise ValueError(
                "KvPool num_layers, num_kv_heads and head_dim must be positive, got "
                f"{num_layers}, {num_kv_heads}, {head_dim}"
            )
        if dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"KvPool dtype must be float32 or bfloat16, got {dtype}")
        bytes_per_token = num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        if bytes_per_token % 16:
            raise ValueError(
                "KvPool bytes per token (num_kv_heads * head_dim * element_size) must be a "
                f"multiple of 16, got {bytes_per_token}"
            )
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self._k = torch.zeros(shape, dtype=dtype)
        self._v = torch.zeros(shape, dtype=dtype)

    @property
    def num_slots(self) -> int:
        """Slots per layer, slot 0 included."""
        return int(self._k.shape[1])

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return int(self._k.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        """Element type of K and V."""
        return self._k.dtype

    @property
    def num_bytes_per_token(self) -> int:
        """Bytes one slot occupies in one layer's K (or V): heads * head_dim * element size."""
        return int(self._k.shape[2] * self._k.shape[3]) * self._k.element_size()

    def k(self, layer: int) -> torch.Tensor:
        """The live K buffer of `layer`, `[num_slots, num_kv_heads, head_dim]` (a view)."""
        return self._k[layer]

    def v(self, layer: int) -> torch.Tensor:
        """The live V buffer of `layer`, `[num_slots, num_kv_heads, head_dim]` (a view)."""
        return self._v[layer]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `k[i]`, `v[i]` (each `[n, heads, dim]`) at `slots[i]`; slot -1 means skip."""
        if slots.dim() != 1 or k.shape[0] != slots.shape[0] or v.shape[0] != slots.shape[0]:
            raise ValueError(
                f"KvPool.write: slots {tuple(slots.shape)}, k {tuple(k.shape)} and "
                f"v {tuple(v.shape)} disagree"
            )
        index = slots.to(torch.int64)
        keep = index >= 0
        if not bool(keep.all()):
            index, k, v = index[keep], k[keep], v[keep]
        self._k[layer, index] = k.to(self._k.dtype)
        self._v[layer, index] = v.to(self._v.dtype)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V of `layer` at `slots` (any integer dtype), each `[n, heads, dim]`."""
        index = slots.to(torch.int64)
        return self._k[layer, index], self._v[layer, index]

    def real_kv_sources(self, read_bytes: int) -> tuple[RealKvSource, RealKvSource]:
        """Byte views `[num_slots, num_bytes_per_token]` of the live layer-0 K and V buffers."""
        return self._source(self._k, read_bytes), self._source(self._v, read_bytes)

    def _source(self, half: torch.Tensor, read_bytes: int) -> RealKvSource:
        nbpt = self.num_bytes_per_token
        return RealKvSource(
            tensor=half[0].view(torch.uint8).view(self.num_slots, nbpt),
            page_size=1,
            num_bytes_per_token=nbpt,
            read_bytes=read_bytes,
        )

    def buffer_group(self, read_mode: str) -> BufferGroupSpec:
        """The FULL buffer group of this pool; `read_mode` is `none`, `partial` or `all`."""
        mode = read_mode.strip().lower()
        if mode not in READ_MODES:
            raise ValueError(f"read_mode must be one of none/partial/all, got {read_mode!r}")
        if mode == "none":
            return BufferGroupSpec(kind=GroupKind.FULL, num_slots=self.num_slots)
        read_bytes = _PARTIAL_READ_BYTES if mode == "partial" else self.num_bytes_per_token
        k_source, v_source = self.real_kv_sources(read_bytes)
        return BufferGroupSpec(
            kind=GroupKind.FULL,
            num_slots=self.num_slots,
            k_sources=(k_source,),
            v_sources=(v_source,),
        )
