"""SPEC §10 oracle vectors (conformance item 40)."""

from __future__ import annotations

from kvcanary.contract import TokenOracle, request_key


def test_oracle_vectors() -> None:
    key = request_key("req-0")
    assert key == -8966579018032821426
    assert key & (2**64 - 1) == 0x83904FE3DBAECB4E
    oracle = TokenOracle(32000)
    assert [oracle.token(key, p) for p in range(3)] == [23152, 19557, 22141]
    assert TokenOracle(151936).token(-1, 3) == 66967


def test_room_id_overrides_the_key() -> None:
    assert request_key("req-0", room_id=42) == 42
    assert request_key("req-0", room_id=-1) == request_key("req-0")


def test_sampler_returns_next_position_and_prompt_is_user_given() -> None:
    oracle = TokenOracle(1000)
    assert oracle.next_token(7, 4) == oracle.token(7, 5)
    assert oracle.expected_token(7, (1, 2, 3), 1) == 2
    assert oracle.expected_token(7, (1, 2, 3), 3) == oracle.token(7, 3)
