"""Buffer groups and real-KV sources (SPEC §2.3, §2.4)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

__all__ = ["MAX_SOURCES_PER_HALF", "BufferGroupSpec", "GroupKind", "RealKvSource"]

MAX_SOURCES_PER_HALF = 4


class GroupKind(enum.Enum):
    """FULL covers the whole pool; SWA the sliding-window sub-pool of a hybrid pool."""

    FULL = "full"
    SWA = "swa"


@dataclass(frozen=True, slots=True)
class RealKvSource:
    """A live view of one layer's K (or V) bytes, fingerprinted into REAL_KV_HASH.

    Slot `s` occupies row `s // page_size` starting at byte column
    `(s % page_size) * num_bytes_per_token`. Trailing row bytes are ignored, and the row stride
    comes from the tensor, so a per-layer view into a larger buffer works. `tensor` must be a view
    of the engine's buffer, never a copy; dimensions past 0 are flattened into the row.
    """

    tensor: torch.Tensor
    page_size: int
    num_bytes_per_token: int
    read_bytes: int

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(
                f"kv-canary: RealKvSource.page_size must be >= 1, got {self.page_size}"
            )
        nbpt = self.num_bytes_per_token
        if nbpt <= 0 or nbpt % 16:
            raise ValueError(
                "kv-canary: RealKvSource.num_bytes_per_token must be a positive multiple of 16, "
                f"got {nbpt}"
            )
        if self.read_bytes <= 0 or self.read_bytes % 16 or self.read_bytes > nbpt:
            raise ValueError(
                "kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in "
                f"(0, num_bytes_per_token={nbpt}], got {self.read_bytes}"
            )
        t = self.tensor
        if t.dim() < 2:
            raise ValueError(
                f"kv-canary: RealKvSource.tensor must be at least 2-D, got shape {tuple(t.shape)}"
            )
        stride_bytes = t.stride(0) * t.element_size()
        if stride_bytes % 16:
            raise ValueError(
                "kv-canary: RealKvSource.tensor row stride must be a multiple of 16 bytes, got "
                f"{stride_bytes} bytes (shape={tuple(t.shape)}, strides={t.stride()}, "
                f"dtype={t.dtype})"
            )
        row_bytes = self.row_bytes
        need = self.page_size * nbpt
        if row_bytes < need:
            raise ValueError(
                "kv-canary: RealKvSource row is too narrow for its slot layout: dim-1 is "
                f"{row_bytes} bytes but page_size={self.page_size} x "
                f"num_bytes_per_token={nbpt} needs {need}"
            )

        if not _rows_dense(t):
            raise ValueError(
                "kv-canary: RealKvSource.tensor must be dense past dim 0 (each row one run of "
                f"bytes), got shape={tuple(t.shape)}, strides={t.stride()}"
            )

    @property
    def row_bytes(self) -> int:
        """Bytes in one row: every dimension past 0, times the element size."""
        return math.prod(self.tensor.shape[1:]) * self.tensor.element_size()

    @property
    def row_stride_bytes(self) -> int:
        """Distance in bytes between consecutive rows."""
        return self.tensor.stride(0) * self.tensor.element_size()

    @property
    def num_slots(self) -> int:
        """Slots this source can address."""
        return int(self.tensor.shape[0]) * self.page_size


@dataclass(frozen=True, slots=True, kw_only=True)
class BufferGroupSpec:
    """One buffer group of a KV pool: its slot count, halves, sources and SWA translation.

    Attributes:
        kind: FULL or SWA.
        num_slots: slots in this group's (sub-)pool, slot 0 included.
        has_v: False for K-only (MLA-style latent) pools.
        k_sources, v_sources: up to 4 real-KV sources per half (order is part of the hash).
        full_to_swa: SWA only: the engine's live full->SWA lookup table (0 = evicted/unmapped).
        window: SWA only: window size in tokens.
        kv_token_id_vs_position_offset: 0 for normal pools, +1 for speculative draft pools.
    """

    kind: GroupKind
    num_slots: int
    has_v: bool = True
    k_sources: tuple[RealKvSource, ...] = ()
    v_sources: tuple[RealKvSource, ...] = ()
    full_to_swa: torch.Tensor | None = None
    window: int | None = None
    kv_token_id_vs_position_offset: int = 0

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(
                f"kv-canary: {self.kind.value} group num_slots must be positive, got {self.num_slots}"
            )
        for sources in (self.k_sources, self.v_sources):
            if len(sources) > MAX_SOURCES_PER_HALF:
                raise ValueError(
                    "kv-canary: at most 4 RealKvSource entries supported per buffer half, "
                    f"got {len(sources)}"
                )
        if self.v_sources and not self.has_v:
            raise ValueError("kv-canary: a K-only group (has_v=False) cannot have v_sources")
        is_swa = self.kind is GroupKind.SWA
        if is_swa and (self.full_to_swa is None or self.window is None):
            raise ValueError("kv-canary: a SWA group needs full_to_swa and window")
        if not is_swa and (self.full_to_swa is not None or self.window is not None):
            raise ValueError("kv-canary: full_to_swa and window are only valid for a SWA group")
        if self.window is not None and self.window < 1:
            raise ValueError(f"kv-canary: SWA window must be positive, got {self.window}")
        for half, sources in (("k", self.k_sources), ("v", self.v_sources)):
            for i, src in enumerate(sources):
                if src.num_slots < self.num_slots:
                    raise ValueError(
                        f"kv-canary: {self.kind.value} group {half}_sources[{i}] covers "
                        f"{src.num_slots} slots ({src.tensor.shape[0]} rows x page_size="
                        f"{src.page_size}) but the group has {self.num_slots}; a source needs a "
                        "row for every page of the pool"
                    )


def _rows_dense(t: torch.Tensor) -> bool:
    """True when every dimension past 0 is laid out densely (row-major), so a row's bytes are
    one contiguous run; size-1 dimensions may have any stride."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
