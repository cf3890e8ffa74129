"""Request: one generation request as the scheduler tracks it (ints and lists, no tensors)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvcanary.engine.plan import SamplingSpec
from kvcanary.engine.radix_cache import RadixHandle

__all__ = ["Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    """Lifecycle: WAITING -> RUNNING -> FINISHED, with RUNNING -> WAITING on retraction and
    ABORTED reachable from WAITING or RUNNING."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"  # ended by KV corruption that recomputes did not clear (SPEC §14.3)


@dataclass(slots=True, eq=False)
class Request:
    """A request and its KV bookkeeping.

    The sequence is `prompt + output`. Positions `[0, num_computed)` have their KV in the cache;
    `slots[p]` is the slot of position `p` for `p < len(slots)` (slots past `num_computed` are
    scheduled but not yet computed). The request owns one allocator reference per entry of
    `slots`. `row` is its `req_to_token` row (0 while it has none); `handle` locks the radix
    prefix it matched on admission.
    """

    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    output: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0
    row: int = 0
    slots: list[int] = field(default_factory=list)
    handle: RadixHandle | None = None
    admit_seq: int = -1  # order of the latest admission; larger = admitted more recently
    last_scheduled: int = -1  # scheduler step that last gave this request a chunk
    recoveries: int = 0  # recomputes after canary incidents (bounded by the retry budget)
    recover_target: int = 0  # positions computed before the latest recompute (0: none open)
    recover_step: int = -1  # scheduler step of the latest recompute
    error: str | None = None  # why a FAILED request ended

    @property
    def seq_len(self) -> int:
        """Tokens in the sequence so far (prompt + output)."""
        return len(self.prompt) + len(self.output)

    @property
    def tokens(self) -> list[int]:
        """A copy of the whole sequence, prompt then output."""
        return [*self.prompt, *self.output]

    @property
    def remaining_new_tokens(self) -> int:
        """Tokens still to generate."""
        return self.max_new_tokens - len(self.output)

    @property
    def is_done(self) -> bool:
        """Whether generation reached `max_new_tokens`."""
        return len(self.output) >= self.max_new_tokens

    @property
    def finish_reason(self) -> str | None:
        """`length` when finished, `abort`, `kv_corruption` when failed, None while active."""
        return {
            RequestStatus.FINISHED: "length",
            RequestStatus.ABORTED: "abort",
            RequestStatus.FAILED: "kv_corruption",
        }.get(self.status)

    @property
    def num_to_compute(self) -> int:
        """Tokens whose KV must still be computed before the next sample (1 when decoding)."""
        return self.seq_len - self.num_computed
