"""CanaryLaunchCapacities (SPEC §6; conformance items 20-22)."""

from __future__ import annotations

import pytest

from kvcanary.canary import CanaryLaunchCapacities

NAMES = ("req_to_token_pool_size", "max_seq_len_per_req", "pool_slot_count", "cuda_graph_max_bs",
         "speculative_num_draft_tokens", "max_prefill_tokens", "chunked_prefill_size")  # fmt: skip


def caps(*values: object) -> CanaryLaunchCapacities:
    return CanaryLaunchCapacities.from_args(**dict(zip(NAMES, values, strict=True)))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((64, 4096, 10000, 160, 4, 16384, 8192), (160, 8192, 30000)),
        ((64, 4096, 10000, None, None, 16384, -1), (64, 16384, 30000)),
        ((512, 4096, 10000, 160, 8, 2048, None), (512, 4096, 30000)),
    ],
)
def test_worked_examples(args: tuple[object, ...], expected: tuple[int, int, int]) -> None:
    c = caps(*args)
    assert (c.write_req_capacity, c.write_entry_capacity, c.verify_capacity) == expected
    assert c.max_seq_len_per_req == 4096


def test_chunk_zero_is_a_limit_of_zero() -> None:
    assert caps(4, 16, 100, 0, 0, 64, 0).write_entry_capacity == 4
    assert caps(4, 16, 100, 0, 0, 64, None).write_entry_capacity == 64


@pytest.mark.parametrize(
    ("index", "value", "message"),
    [
        (0, 0, "kv-canary: req_to_token_pool_size must be positive, got 0"),
        (1, -2, "kv-canary: max_seq_len_per_req must be positive, got -2"),
        (2, 0, "kv-canary: pool_slot_count must be positive, got 0"),
        (3, -1, "kv-canary: cuda_graph_max_bs must be non-negative, got -1"),
        (4, -1, "kv-canary: speculative_num_draft_tokens must be non-negative, got -1"),
        (5, 0, "kv-canary: max_prefill_tokens must be positive, got 0"),
    ],
)
def test_messages_exact(index: int, value: int, message: str) -> None:
    args: list[object] = [64, 4096, 10000, 160, 4, 16384, 8192]
    args[index] = value
    with pytest.raises(ValueError) as err:
        caps(*args)
    assert str(err.value) == message


def test_checked_in_order() -> None:
    with pytest.raises(ValueError, match="req_to_token_pool_size"):
        caps(0, 0, 0, -1, -1, 0, None)
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        caps(1, 1, 1, 0, -1, 0, None)


@pytest.mark.parametrize("bad", [True, 1.5, "3"])
def test_non_int_is_a_type_error(bad: object) -> None:
    with pytest.raises(TypeError) as err:
        caps(64, bad, 10000, 160, 4, 16384, 8192)
    assert str(err.value) == f"kv-canary: max_seq_len_per_req must be an int, got {type(bad)}"
