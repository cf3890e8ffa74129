"""StepPlan: the only object the scheduler hands to the runner, and what comes back.

Plain ints and tuples, no tensors. The scheduler has already allocated every `out_slots` entry
and written it into the request's `req_to_token` row before the plan reaches the runner.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from kvcanary.contract.incident import Incident

__all__ = [
    "ChunkOutput",
    "ForwardKind",
    "Runner",
    "SamplingSpec",
    "ScheduledChunk",
    "StepOutput",
    "StepPlan",
]


class ForwardKind(enum.Enum):
    """What one forward does; a step runs at most one forward."""

    EXTEND = "extend"  # prefill chunks, possibly mixed with decodes
    DECODE = "decode"  # one token per request
    VERIFY = "verify"  # speculative target-verify: last token + k drafts per request


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """How to pick the next token of one request.

    `greedy` takes the argmax; otherwise `temperature` sampling with a generator seeded from
    `(seed, position)` so a re-prefilled request samples the same tokens. `oracle` ignores the
    logits and returns `TokenOracle.next_token(oracle_key, last_position)`.
    """

    greedy: bool = True
    temperature: float = 1.0
    seed: int = 0
    oracle: bool = False
    oracle_key: int = 0


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One request's share of a forward.

    Positions `[0, prefix_len)` are already in the KV cache, reachable through row `row` of
    `req_to_token`. This chunk computes `input_ids` at positions `prefix_len + j` and writes their
    KV to `out_slots[j]` (already in `req_to_token[row, prefix_len + j]`).

    `num_samples` is how many next-token samples the runner returns: 0 for a non-final prefill
    chunk, 1 for a final prefill chunk or a decode (sampled after the last input), and
    `len(input_ids)` for a speculative verify (one after every input).
    """

    request_id: str
    row: int
    prefix_len: int
    input_ids: tuple[int, ...]
    out_slots: tuple[int, ...]
    num_samples: int
    sampling: SamplingSpec
    prompt_len: int
    truth_tokens: tuple[int, ...]  # prompt + outputs committed so far (for verify-token)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """All chunks of one forward, in batch order."""

    kind: ForwardKind
    chunks: tuple[ScheduledChunk, ...]

    @property
    def num_tokens(self) -> int:
        """Total token entries written by this forward."""
        return sum(len(c.input_ids) for c in self.chunks)


@dataclass(frozen=True, slots=True)
class ChunkOutput:
    """The runner's result for one chunk: `num_samples` sampled tokens, in position order."""

    request_id: str
    sampled: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepOutput:
    """The runner's result for one StepPlan, chunk for chunk, plus the canary incidents of its
    forward (mode `recover`; their view rows are chunk indices)."""

    chunks: tuple[ChunkOutput, ...]
    incidents: tuple[Incident, ...] = ()


class Runner(Protocol):
    """Runs one StepPlan: builds tensors and the ForwardView, calls the canary's `pre_forward` /
    `post_forward` around the model forward, samples. Raising leaves no token applied."""

    def run(self, plan: StepPlan) -> StepOutput:
        """Run the forward described by `plan` and return one ChunkOutput per chunk, in order."""
        ...
