"""Per-group canary state: HEAD and TAIL record buffers for each half, sources, SWA table."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvcanary.canary.config import RealDataMode
from kvcanary.canary.plan import new_write_marks
from kvcanary.canary.records import new_record_buffer, record_words
from kvcanary.canary.sources import FoldSources
from kvcanary.canary.view_checks import as_int_array, check_slot_range, slot_error
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
            as_int_array("full_to_swa", spec.full_to_swa, 1)
            if spec.full_to_swa is not None
            else None
        )
        self.write_marks = new_write_marks(spec.num_slots)  # build_group_plan's scratch
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

    def translate(
        self, slots: npt.NDArray[np.int64], *, allow_none: bool = True
    ) -> npt.NDArray[np.int64]:
        """Map full-pool slots (walker output) into this group, range-checked (SPEC §14.2).

        Identity for FULL, the SWA table for SWA; -1 is kept when `allow_none` (a walker's
        `prev_slot`) and an error otherwise (its `slot`). A value outside the table raises the
        SWA message; any result outside `[0, num_slots)` the slot message. Vectorised.
        """
        if self.lut is None:
            check_slot_range(
                slots, group_name=self.name, num_slots=self.num_slots, allow_none=allow_none
            )
            return slots
        bad = (slots < -1) | (slots >= len(self.lut))
        if bad.any():
            raise ValueError(
                f"kv-canary: SWA slot {int(slots[bad][0])} is outside "
                f"full_to_swa_index_mapping length {len(self.lut)}"
            )
        if not allow_none and (slots == -1).any():
            raise slot_error(-1, self.name, self.num_slots)
        none = slots == -1
        out = np.where(none, -1, self.lut[np.maximum(slots, 0)]).astype(np.int64)
        check_slot_range(
            out[~none], group_name=self.name, num_slots=self.num_slots, allow_none=False
        )
        return out


_EMPTY = FoldSources.empty()
