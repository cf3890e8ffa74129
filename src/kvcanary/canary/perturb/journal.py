"""The injection journal and its log lines (SPEC §11.1 "Journal", "Skips")."""

from __future__ import annotations

import json
import logging

from kvcanary.canary.perturb_seam import PerturbRecord

__all__ = ["Journal", "byte_text"]

logger = logging.getLogger("kvcanary")


def byte_text(value: int) -> str:
    """A byte as the journal writes it: `0x%02x`."""
    return f"0x{value & 0xFF:02x}"


class Journal:
    """Append-only list of `PerturbRecord`s, each logged at INFO as compact JSON.

    Key order in the JSON is mode, step, slot, position, group, seed, then the extras in the order
    the mode supplied them.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._records: list[PerturbRecord] = []

    def record(
        self, mode: str, *, step: int, slot: int, position: int, group: str, **extras: object
    ) -> PerturbRecord:
        """Append and log one injection; returns the frozen record."""
        rec = PerturbRecord(
            mode=mode,
            step=step,
            slot=slot,
            position=position,
            group=group,
            seed=self.seed,
            extras=dict(extras),
        )
        self._records.append(rec)
        logger.info("kv_canary perturb: %s", to_json(rec))
        return rec

    @staticmethod
    def skip(mode: str, *, step: int, reason: str) -> None:
        """Log a fired draw that found nothing to corrupt."""
        logger.info("kv_canary perturb %s: skipped step=%d reason=%s", mode, step, reason)

    def records(self) -> list[PerturbRecord]:
        """A copy of the journal, in injection order."""
        return list(self._records)


def to_json(rec: PerturbRecord) -> str:
    """The compact JSON form of one record (keys in journal order)."""
    body: dict[str, object] = {
        "mode": rec.mode,
        "step": rec.step,
        "slot": rec.slot,
        "position": rec.position,
        "group": rec.group,
        "seed": rec.seed,
    }
    body.update(rec.extras)
    return json.dumps(body, separators=(",", ":"))
