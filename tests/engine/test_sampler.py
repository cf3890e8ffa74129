"""Sampler: greedy, reproducible temperature sampling, and the token oracle."""

from __future__ import annotations

import pytest
import torch

from kvcanary.contract import TokenOracle, request_key
from kvcanary.engine.plan import SamplingSpec
from kvcanary.engine.sampler import Sampler, sampling_seed, temperature_sample

VOCAB = 128


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(TokenOracle(VOCAB))


def test_greedy_is_argmax(sampler: Sampler) -> None:
    x = logits(3)
    assert sampler.sample(x, SamplingSpec(), [4, 5, 6]) == tuple(x.argmax(-1).tolist())


def test_non_positive_temperature_is_greedy(sampler: Sampler) -> None:
    x = logits(2)
    spec = SamplingSpec(greedy=False, temperature=0.0)
    assert sampler.sample(x, spec, [0, 1]) == tuple(x.argmax(-1).tolist())


def test_temperature_sampling_depends_only_on_seed_position_and_logits(sampler: Sampler) -> None:
    x = logits(1, seed=1)[0]
    spec = SamplingSpec(greedy=False, temperature=5.0, seed=11)
    draws = [sampler.sample(x[None], spec, [p])[0] for p in range(40)]
    # Same (seed, position, logits) -> same token, whatever ran in between.
    assert [sampler.sample(x[None], spec, [p])[0] for p in reversed(range(40))] == draws[::-1]
    # The token at last position p is drawn for position p + 1.
    assert draws[3] == temperature_sample(x, 5.0, 11, 4)
    # Hot sampling really samples: many distinct tokens, and another seed draws differently.
    assert len(set(draws)) > 10
    other = SamplingSpec(greedy=False, temperature=5.0, seed=12)
    assert [sampler.sample(x[None], other, [p])[0] for p in range(40)] != draws


def test_batched_temperature_equals_one_at_a_time(sampler: Sampler) -> None:
    x = logits(4, seed=2)
    spec = SamplingSpec(greedy=False, temperature=1.5, seed=3)
    batched = sampler.sample(x, spec, [7, 8, 9, 10])
    assert batched == tuple(sampler.sample(x[i : i + 1], spec, [7 + i])[0] for i in range(4))


def test_low_temperature_approaches_greedy(sampler: Sampler) -> None:
    x = logits(6, seed=4) * 10
    spec = SamplingSpec(greedy=False, temperature=1e-3, seed=5)
    assert sampler.sample(x, spec, range(6)) == tuple(x.argmax(-1).tolist())


def test_sampling_seed_is_a_stable_u64() -> None:
    assert sampling_seed(0, 0) == sampling_seed(0, 0)
    assert sampling_seed(0, 1) != sampling_seed(1, 0)
    assert 0 <= sampling_seed(-5, 2**40) < 2**64


def test_oracle_ignores_logits_and_follows_the_spec_vectors() -> None:
    sampler = Sampler(TokenOracle(32000))
    key = request_key("req-0")
    spec = SamplingSpec(oracle=True, oracle_key=key)
    # token(key, 0..2) = 23152, 19557, 22141 (SPEC §10): last positions -1, 0, 1.
    assert sampler.sample(None, spec, [-1, 0, 1]) == (23152, 19557, 22141)
    assert sampler.sample(torch.zeros(1, 32000), spec, [0]) == (19557,)


def test_non_oracle_sampling_needs_matching_logits(sampler: Sampler) -> None:
    with pytest.raises(ValueError, match="needs logits"):
        sampler.sample(None, SamplingSpec(), [0])
    with pytest.raises(ValueError, match="logit rows"):
        sampler.sample(logits(2), SamplingSpec(), [0])
