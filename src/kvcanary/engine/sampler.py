"""Next-token selection: greedy, seeded temperature sampling, or the token oracle.

Temperature sampling draws from a generator seeded by `(SamplingSpec.seed, position)`, where
`position` is the position of the token being sampled. The draw therefore depends only on the
request's seed, the position and the logits, not on batch composition or history, so a request
that is preempted and re-prefilled samples the same tokens again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcanary.contract import TokenOracle, splitmix64
from kvcanary.engine.plan import SamplingSpec

__all__ = ["Sampler", "sampling_seed", "temperature_sample"]


def sampling_seed(seed: int, position: int) -> int:
    """The u64 generator seed of the token sampled at `position` for a request seeded `seed`."""
    return splitmix64(splitmix64(seed) ^ position)


def temperature_sample(logits: torch.Tensor, temperature: float, seed: int, position: int) -> int:
    """Draw one token from `softmax(logits / temperature)` (`logits` is `[vocab]`).

    A non-positive temperature falls back to the argmax.
    """
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    gen = torch.Generator().manual_seed(sampling_seed(seed, position))
    return int(torch.multinomial(probs, 1, generator=gen))


@dataclass(frozen=True, slots=True)
class Sampler:
    """Picks tokens for one chunk at a time; `oracle` serves chunks whose spec is `oracle`."""

    oracle: TokenOracle

    def sample(
        self,
        logits: torch.Tensor | None,
        spec: SamplingSpec,
        last_positions: Sequence[int],
    ) -> tuple[int, ...]:
        """One token per entry of `last_positions` (the position of the input it follows).

        `logits` is `[len(last_positions), vocab]`, or None for a weightless model, which only
        supports oracle sampling.
        """
        if spec.oracle:
            return tuple(self.oracle.next_token(spec.oracle_key, p) for p in last_positions)
        if logits is None:
            raise ValueError("non-oracle sampling needs logits; the oracle model has none")
        if logits.shape[0] != len(last_positions):
            raise ValueError(
                f"Sampler got {logits.shape[0]} logit rows for {len(last_positions)} positions"
            )
        if spec.greedy or spec.temperature <= 0:
            return tuple(int(t) for t in logits.argmax(dim=-1).tolist())
        return tuple(
            temperature_sample(row, spec.temperature, spec.seed, p + 1)
            for row, p in zip(logits, last_positions, strict=True)
        )
