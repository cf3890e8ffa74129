"""The no-cache reference: greedy decoding by recomputing the whole sequence every step.

No pool, no radix cache, no `req_to_token`: each step runs `TinyLlama.forward` over the full
sequence with `DenseKv`, which attends over the keys and values of the tokens it was just given.
Because the block math is the same `TinyLlama.forward` the paged engine runs, the two must agree
token for token; any difference comes from the paged bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import torch

from kvcanary.engine.model import TinyLlama, causal_attention

__all__ = ["DenseKv", "greedy_reference", "reference_logits"]


@final
class DenseKv:
    """`KvAccess` for a forward that holds the whole sequence: plain causal self-attention."""

    __slots__ = ()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of `q` over `k`, `v` of the same tokens, starting at position 0."""
        return causal_attention(q, k, v, 0)


def reference_logits(model: TinyLlama, tokens: Sequence[int]) -> torch.Tensor:
    """Logits `[len(tokens), vocab]` of the whole sequence, computed without any cache."""
    if not tokens:
        raise ValueError("reference_logits needs at least one token")
    input_ids = torch.as_tensor(list(tokens), dtype=torch.int64)
    positions = torch.arange(len(tokens), dtype=torch.int64)
    return model.forward(input_ids, positions, DenseKv())


def greedy_reference(model: TinyLlama, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """The `max_new_tokens` greedy tokens that follow `prompt`, one full forward per token."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be non-negative, got {max_new_tokens}")
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(reference_logits(model, tokens)[-1].argmax())
        tokens.append(token)
        out.append(token)
    return out
