"""The embedded default workload of `kvcanary run`: seeded, and built to exercise every path.

Requests share a few system prompts (radix hits), their lengths cross chunk boundaries, some are
aborted during prefill or decode, and the pool is small enough to force evictions and retractions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["PlannedRequest", "WorkloadSpec", "build_workload"]


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Shape of the generated workload."""

    num_requests: int = 48
    seed: int = 0
    vocab_size: int = 256
    num_system_prompts: int = 3
    system_prompt_len: int = 48
    user_len: tuple[int, int] = (4, 80)
    max_new_tokens: tuple[int, int] = (4, 24)
    abort_fraction: float = 0.1
    arrivals_per_step: int = 4
    #: engine steps between arrival groups: `arrivals_per_step` requests arrive every this many
    #: steps (1 = every step), so a long run can match the arrival rate to the engine's throughput
    arrival_interval_steps: int = 1

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(
                f"--requests must be >= 1, got {self.num_requests}; ask for at least one"
            )
        if self.arrivals_per_step < 1:
            raise ValueError(f"arrivals_per_step must be >= 1, got {self.arrivals_per_step}")
        if self.arrival_interval_steps < 1:
            raise ValueError(
                f"arrival_interval_steps must be >= 1, got {self.arrival_interval_steps}"
            )


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request: when it arrives, what it asks, and (maybe) when it is aborted."""

    request_id: str
    arrival_step: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    abort_after_steps: int | None


def build_workload(spec: WorkloadSpec) -> list[PlannedRequest]:
    """The seeded request list of `spec`, in arrival order."""
    rng = random.Random(spec.seed)
    systems = [
        tuple(rng.randrange(spec.vocab_size) for _ in range(spec.system_prompt_len))
        for _ in range(spec.num_system_prompts)
    ]
    out = []
    for i in range(spec.num_requests):
        user = tuple(rng.randrange(spec.vocab_size) for _ in range(rng.randint(*spec.user_len)))
        aborted = rng.random() < spec.abort_fraction
        out.append(
            PlannedRequest(
                request_id=f"req-{i}",
                arrival_step=(i // spec.arrivals_per_step) * spec.arrival_interval_steps,
                prompt=rng.choice(systems) + user,
                max_new_tokens=rng.randint(*spec.max_new_tokens),
                # 1-2 steps after arrival lands in prefill; later ones in decode
                abort_after_steps=rng.choice([1, 2, 6, 10]) if aborted else None,
            )
        )
    return out
