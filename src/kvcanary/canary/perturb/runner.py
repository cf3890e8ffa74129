"""One mode's per-opportunity machinery: draw, cap, skip and record (SPEC §11.1)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvcanary.canary.perturb.journal import Journal
from kvcanary.canary.perturb.rng import ModeRng
from kvcanary.canary.perturb_seam import PerturbRecord

__all__ = ["ModeRunner"]

T = TypeVar("T")


@dataclass
class ModeRunner:
    """A mode's probability, random stream and journal access.

    `max_fires` (None = unlimited) caps how many injections the mode makes; once reached the mode
    stops drawing. It is a test and operations convenience, not a SPEC knob.
    """

    mode: str
    p: float
    rng: ModeRng
    journal: Journal
    max_fires: int | None = None
    fired: int = 0

    @property
    def enabled(self) -> bool:
        """True while the mode has p > 0 and has not reached its cap."""
        return self.p > 0 and (self.max_fires is None or self.fired < self.max_fires)

    def draw(self) -> bool:
        """The opportunity's `rng.random() < p` draw (no draw when disabled)."""
        return self.enabled and self.rng.fires(self.p)

    def pick(self, candidates: Sequence[T]) -> T:
        """A uniform pick from a canonically ordered, non-empty list."""
        return self.rng.pick(candidates)

    def skip(self, step: int, reason: str) -> None:
        """Log that this fired draw found nothing to corrupt."""
        self.journal.skip(self.mode, step=step, reason=reason)

    def record(
        self, *, step: int, slot: int, position: int, group: str, **extras: object
    ) -> PerturbRecord:
        """Journal one injection and count it against the cap."""
        self.fired += 1
        return self.journal.record(
            self.mode, step=step, slot=slot, position=position, group=group, **extras
        )
