"""The sampler-exit mode (SPEC §11.2 `next_token_swap`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcanary.canary.perturb.runner import ModeRunner
from kvcanary.canary.perturb.targets import HALF, ViewArrays

__all__ = ["SampledRows", "next_token_swap"]


@dataclass(frozen=True, slots=True)
class SampledRows:
    """Per active view row of the last forward: its req_to_token row and last input position."""

    req_rows: npt.NDArray[np.int64]
    last_positions: npt.NDArray[np.int64]

    @classmethod
    def of(cls, view: ViewArrays) -> SampledRows:
        """Copy what the swap record needs from the forward that produced the tokens."""
        offsets = view.write_offsets()
        rows = view.active_rows()
        last = [
            int(view.positions[end - 1]) if end > start and end <= len(view.positions) else -1
            for start, end in (offsets[r] for r in rows)
        ]
        return cls(
            np.asarray([int(view.rows[r]) for r in rows], dtype=np.int64),
            np.asarray(last, dtype=np.int64),
        )

    def describe(self, i: int) -> tuple[int, int]:
        """(req_row, position of the sampled token) of batch row `i`, or (-1, -1) if unknown."""
        if i >= len(self.req_rows):
            return -1, -1
        last = int(self.last_positions[i])
        return int(self.req_rows[i]), (last + 1 if last >= 0 else -1)


def next_token_swap(
    run: ModeRunner, rows: SampledRows | None, tokens: list[int], step: int
) -> list[int]:
    """Swap two batch rows' sampled tokens (batch >= 2, tokens differ). Record slot -1 and the
    sampled position `p + 1` of the first row; the write-input assert reports both rows' next
    writes as `write_token`."""
    if len(tokens) < 2:
        run.skip(step, "batch_too_small")
        return tokens
    i = run.rng.index(len(tokens))
    j = run.rng.index(len(tokens) - 1)
    j += 1 if j >= i else 0
    i, j = min(i, j), max(i, j)
    if tokens[i] == tokens[j]:
        run.skip(step, "identical_tokens")
        return tokens
    out = list(tokens)
    out[i], out[j] = tokens[j], tokens[i]
    known = rows if rows is not None else SampledRows(np.zeros(0, np.int64), np.zeros(0, np.int64))
    (req_i, pos_i), (req_j, pos_j) = known.describe(i), known.describe(j)
    run.record(
        step=step, slot=-1, position=pos_i, group="full", req_row=req_i, half=HALF,
        batch_row=i, other_batch_row=j, other_req_row=req_j, other_position=pos_j,
        original_token=tokens[i], new_token=tokens[j],
    )  # fmt: skip
    return out
