"""Speculative decoding on ints: drafters propose the next k tokens, `count_accepted` checks them.

Two drafters, chosen per request by `SamplingSpec.oracle`:

- **Oracle**: the token oracle's own tokens, so a target sampling the oracle accepts all drafts.
- **Prompt lookup** (n-gram): find the most recent earlier occurrence of the sequence's last
  n tokens (n = max_ngram .. 1) and propose what followed it; when nothing matches, repeat the
  last token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcanary.contract import TokenOracle
from kvcanary.engine.plan import SamplingSpec

__all__ = ["Drafter", "count_accepted", "propose_ngram"]


@dataclass(frozen=True, slots=True)
class Drafter:
    """Proposes drafts for one request; stateless."""

    vocab_size: int
    max_ngram: int = 3

    def propose(self, tokens: Sequence[int], k: int, sampling: SamplingSpec) -> list[int]:
        """`k` draft tokens for positions `len(tokens) .. len(tokens) + k - 1`."""
        if k <= 0:
            return []
        if sampling.oracle:
            oracle = TokenOracle(self.vocab_size)
            start = len(tokens)
            return [oracle.token(sampling.oracle_key, start + i) for i in range(k)]
        return propose_ngram(tokens, k, self.max_ngram)


def propose_ngram(tokens: Sequence[int], k: int, max_ngram: int = 3) -> list[int]:
    """Prompt-lookup drafts: continue the latest earlier match of the longest suffix n-gram
    (padded with its last token), or repeat the last token."""
    total = len(tokens)
    if total == 0 or k <= 0:
        return []
    for n in range(min(max_ngram, total - 1), 0, -1):
        suffix = list(tokens[total - n :])
        for start in range(total - n - 1, -1, -1):
            if list(tokens[start : start + n]) == suffix:
                cont = list(tokens[start + n : start + n + k])
                return cont + [cont[-1]] * (k - len(cont))
    return [tokens[-1]] * k


def count_accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """Accepted drafts of one verify: the longest prefix with `sampled[i] == drafts[i]`, where
    `sampled[i]` is the target's token after input `i` (the last token, then the drafts)."""
    accepted = 0
    while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
        accepted += 1
    return accepted
