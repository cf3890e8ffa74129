"""Per-mode random streams (SPEC §11.1 "Seeding").

Each mode draws from its own `random.Random(mode_seed(mode, seed))`, so enabling one mode never
shifts another mode's draws, and the same seed and engine trace give the same journal.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import TypeVar

__all__ = ["ModeRng", "mode_seed"]

T = TypeVar("T")


def mode_seed(mode: str, seed: int) -> int:
    """Little-endian u64 of BLAKE2b (digest_size=8) over `kvcanary-perturb:{mode}:{seed}`."""
    digest = hashlib.blake2b(f"kvcanary-perturb:{mode}:{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class ModeRng:
    """One mode's stream: `fires(p)` is the per-opportunity draw, `pick` a uniform choice.

    Candidate lists handed to `pick` must already be in the canonical order (view row, then
    position, then slot) so a pick is reproducible from the trace alone.
    """

    def __init__(self, mode: str, seed: int) -> None:
        self.mode = mode
        self.seed = mode_seed(mode, seed)
        self._rng = random.Random(self.seed)

    def fires(self, p: float) -> bool:
        """Draw `random() < p` (always consumes one draw)."""
        return self._rng.random() < p

    def index(self, n: int) -> int:
        """`randrange(n)` for `n >= 1`."""
        return self._rng.randrange(n)

    def pick(self, candidates: Sequence[T]) -> T:
        """One element of a non-empty, canonically ordered sequence."""
        return candidates[self._rng.randrange(len(candidates))]
