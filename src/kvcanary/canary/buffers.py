"""Per-group canary state: HEAD and TAIL record buffers for each half, sources, SWA table."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvcanary.canary.config import RealDataMode
from kvcanary.canary.plan import as_int_array
from kvcanary.canary.records import new_record_buffer, record_words
from kvcanary.canary.sources import FoldSources
from kvcanary.contract.groups import BufferGroupSpec, GroupKind

__all__ = ["STAGES_WITH_BUFFERS", "GroupBuffers"]

STAGES_WITH_BUFFERS = ("head", "tail")


class GroupBuffers:
    """One buffer group as the canary sees it.

    `halves` are the halves whose endpoints run (`k`, plus `v` when enabled and present); V
    buffers are allocated whenever the pool has V so sidecars can always travel together.
    """

    def __init__(self, spec: BufferGroupSpec, *, real_data: RealDataMode, enable_v: bool) -> None:
        self.spec = spec
        self.name = spec.kind.value
        self.num_slots = spec.num_slots
        self.window = spec.window
        self.offset = spec.kv_token_id_vs_position_offset
        self.lut: npt.NDArray[np.integer[Any]] | None = (
            as_int_array("full_to_swa", spec.full_to_swa) if spec.full_to_swa is not None else None
        )
        self.halves: tuple[str, ...] = ("k", "v") if (enable_v and spec.has_v) else ("k",)
        all_halves = ("k", "v") if spec.has_v else ("k",)
        self._buffers = {
            (stage, half): new_record_buffer(spec.num_slots)
            for stage in STAGES_WITH_BUFFERS
            for half in all_halves
        }
        self._words = {key: record_words(buf) for key, buf in self._buffers.items()}
        self.sources = {
            "k": FoldSources.build(spec.k_sources, real_data),
            "v": FoldSources.build(spec.v_sources, real_data),
        }

    @property
    def is_swa(self) -> bool:
        """True for the sliding-window group."""
        return self.spec.kind is GroupKind.SWA

    def buffer(self, stage: str, half: str) -> npt.NDArray[np.uint8]:
        """The `[num_slots, 32]` record buffer of `stage` (head/tail; sweep reads tail)."""
        return self._buffers["tail" if stage == "sweep" else stage, half]

    def words(self, stage: str, half: str) -> npt.NDArray[np.uint64]:
        """The same buffer as `[num_slots, 4]` u64 words."""
        return self._words["tail" if stage == "sweep" else stage, half]

    def stage_sources(self, stage: str, half: str) -> FoldSources:
        """HEAD folds nothing; TAIL and SWEEP fold the half's real-KV sources."""
        return self.sources[half] if stage != "head" else _EMPTY

    def translate(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Map full-pool slots into this group (identity for FULL; -1 preserved)."""
        if self.lut is None:
            return slots
        bad = (slots < -1) | (slots >= len(self.lut))
        if bad.any():
            raise ValueError(
                f"kv-canary: SWA slot {int(slots[bad][0])} is outside "
                f"full_to_swa_index_mapping length {len(self.lut)}"
            )
        return np.where(slots == -1, -1, self.lut[np.maximum(slots, 0)]).astype(np.int64)


_EMPTY = FoldSources.empty()
