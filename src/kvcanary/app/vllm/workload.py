"""Seeded prompt mixes for vLLM: shared prefixes (prefix-cache hits), prompts longer than the
token budget (chunked prefill), enough concurrent context to overflow a small KV budget
(preemption)."""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["VllmRequest", "VllmWorkload"]


@dataclass(frozen=True)
class VllmRequest:
    """One request: prompt token ids and how many tokens to generate."""

    prompt: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class VllmWorkload:
    """`num_requests` prompts drawn from `families` shared prefixes of 1-6 blocks plus a unique
    tail; output lengths in `[min_tokens, max_tokens]`."""

    num_requests: int = 200
    seed: int = 0
    vocab_size: int = 512
    families: int = 6
    block_size: int = 32
    max_prefix_blocks: int = 6
    max_tail: int = 96
    min_tokens: int = 4
    max_tokens: int = 24

    def __post_init__(self) -> None:
        if self.num_requests <= 0:
            raise ValueError(
                f"requests must be positive, got {self.num_requests}; pass --requests 1 or more"
            )
        if self.families <= 0:
            raise ValueError(f"families must be positive, got {self.families}")

    def requests(self) -> list[VllmRequest]:
        """The seeded request list (same seed, same list)."""
        rng = random.Random(self.seed)
        tok = lambda: rng.randrange(1, self.vocab_size)  # noqa: E731
        prefixes = [
            [tok() for _ in range(self.block_size * rng.randint(1, self.max_prefix_blocks))]
            for _ in range(self.families)
        ]
        out = []
        for _ in range(self.num_requests):
            shared = prefixes[rng.randrange(self.families)]
            # a prefix of the family prompt: hits end at different block boundaries
            keep = rng.randint(1, len(shared) // self.block_size) * self.block_size
            tail = [tok() for _ in range(rng.randint(1, self.max_tail))]
            out.append(
                VllmRequest(
                    prompt=tuple(shared[:keep] + tail),
                    max_tokens=rng.randint(self.min_tokens, self.max_tokens),
                )
            )
        return out
