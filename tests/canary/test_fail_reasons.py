"""Each of the six fail reasons from a minimal scenario, and a clean multi-step scenario."""

from __future__ import annotations

import re

import torch

from kvcanary.canary import CanaryConfig
from kvcanary.canary.hashing import HEAD_HASH, mix3
from kvcanary.canary.records import read_record
from kvcanary.contract import ExpectedInputs, LaunchTag, TokenOracle, Violation
from tests.canary.conftest import MakeCanary, forward

FIRST_LINE = re.compile(
    r"^kv_canary violation: launch_tag=(\S+) fail_reason=(\S+) slot_idx=(-?\d+) position=(-?\d+) "
    r"stored_token=(-?\d+) expected_token=(-?\d+) stored_chain_hash=0x[0-9a-f]{16} "
    r"expected_aux=0x[0-9a-f]{16}$"
)


def summary(violations: list[Violation]) -> list[tuple[str, str, int]]:
    out = []
    for v in violations:
        m = FIRST_LINE.match(v.message.splitlines()[0])
        assert m, v.message
        out.append((m.group(1), m.group(2), v.slot_idx))
    return out


def test_clean_prefix_sharing_chunked_extend_and_decode(make_canary: MakeCanary) -> None:
    pool, canary = make_canary(sweep_interval=1, enable_verify_token_assert=True)
    canary.mark_init_finished()
    forward(pool, canary, pool.view([(1, [5, 7, 9])]))  # first chunk
    forward(pool, canary, pool.view([(1, [11, 13])]))  # chunked extend
    pool.share(1, 2, 4)  # request 2 hits the radix prefix of request 1
    forward(pool, canary, pool.view([(2, [20, 21]), (1, [15])], pad_rows=2))
    for _ in range(3):
        forward(pool, canary, pool.view([(1, [3]), (2, [4])]))
    assert canary.drain_violations() == [] and canary.total_violations == 0
    head_k = canary.group("full").buffer("head", "k")
    slots = pool.r2t[1, :3].tolist()
    assert [read_record(head_k, s).prev_hash & (2**64 - 1) for s in slots] == [
        HEAD_HASH, mix3(HEAD_HASH, 5, 0), mix3(mix3(HEAD_HASH, 5, 0), 7, 1)
    ]  # fmt: skip


def test_verify_chain_hash_from_a_wrong_mapping(make_canary: MakeCanary) -> None:
    pool, canary = make_canary()
    forward(pool, canary, pool.view([(1, [5, 7, 9]), (2, [6, 8, 10])]))
    donor = int(pool.r2t[1, 1])
    pool.r2t[2, 1] = donor  # same position, different prefix
    forward(pool, canary, pool.view([(2, [12])]))
    rows = summary(canary.drain_violations())
    successor = int(pool.r2t[2, 2])
    assert sorted(rows) == sorted(
        [
            (stage, "verify_chain_hash", slot)
            for stage in ("HEAD_K_FULL", "TAIL_K_FULL")
            for slot in (donor, successor)
        ]
    )


def test_verify_position_from_a_position_bug(make_canary: MakeCanary) -> None:
    pool, canary = make_canary()
    view = pool.view([(1, [5, 7, 9])])
    view.positions[2] = 3  # written at the wrong position, chain assert not on yet
    forward(pool, canary, view)
    forward(pool, canary, pool.view([(1, [11])]))
    bad = int(pool.r2t[1, 2])
    assert summary(canary.drain_violations()) == [
        ("HEAD_K_FULL", "verify_position", bad),
        ("TAIL_K_FULL", "verify_position", bad),
    ]


def test_verify_real_kv_hash_from_a_byte_flip(make_canary: MakeCanary) -> None:
    pool, canary = make_canary()
    forward(pool, canary, pool.view([(1, [5, 7, 9])]))
    slot = int(pool.r2t[1, 1])
    pool.k[slot, 3] ^= 0xFF
    forward(pool, canary, pool.view([(1, [11])]))
    violations = canary.drain_violations()
    assert summary(violations) == [("TAIL_K_FULL", "verify_real_kv_hash", slot)]
    assert violations[0].step_when_pumped == 1


def test_write_token_from_the_write_input_assert(make_canary: MakeCanary) -> None:
    oracle = TokenOracle(100)
    pool, canary = make_canary(enable_write_input_assert=True, oracle=oracle)
    view = pool.view([(1, [5, 7, 9])])
    expected = ExpectedInputs(tokens=torch.tensor([5, 7, 8]), positions=torch.tensor([0, 1, 2]))
    view = type(view)(
        **{**{f: getattr(view, f) for f in view.__slots__}, "expected_inputs": expected}
    )  # type: ignore[attr-defined]
    forward(pool, canary, view)
    slot = int(pool.r2t[1, 2])
    violations = canary.drain_violations()
    assert summary(violations) == [
        ("HEAD_K_FULL", "write_token", slot),
        ("TAIL_K_FULL", "write_token", slot),
    ]
    assert violations[0].expected_token == 8 and violations[0].expected_aux == 2
    assert violations[0].message.splitlines()[-3:-1] == [
        f"  actual:   token_id=9   position=2 prev_hash={mix3(mix3(HEAD_HASH, 5, 0), 7, 1):#018x}",
        "  expected: token_id=8   position=2",
    ]
    forward(pool, canary, pool.view([(1, [11])]))
    assert canary.drain_violations() == []  # the next step verifies clean


def test_write_position_from_the_chain_position_assert(make_canary: MakeCanary) -> None:
    pool, canary = make_canary()
    forward(pool, canary, pool.view([(1, [5, 7])]))
    canary.mark_init_finished()
    view = pool.view([(1, [9])])
    view.positions[0] = 3  # should be 2
    forward(pool, canary, view)
    slot = int(pool.r2t[1, 2])
    violations = canary.drain_violations()
    assert summary(violations) == [
        ("HEAD_K_FULL", "write_position", slot),
        ("TAIL_K_FULL", "write_position", slot),
    ]
    assert (
        violations[0].stored_token,
        violations[0].expected_token,
        violations[0].expected_aux,
    ) == (9, 9, 2)


def test_verify_token_from_a_sampled_token_mixup(make_canary: MakeCanary) -> None:
    pool, canary = make_canary(enable_verify_token_assert=True)
    forward(pool, canary, pool.view([(1, [5, 7, 9])]))
    pool.tokens[1][1] = 70  # the request's truth says 70 was sampled; KV holds 7
    forward(pool, canary, pool.view([(1, [11])]))
    slot = int(pool.r2t[1, 1])
    violations = canary.drain_violations()
    assert summary(violations) == [
        ("HEAD_K_FULL", "verify_token", slot),
        ("TAIL_K_FULL", "verify_token", slot),
    ]
    assert violations[0].message.splitlines()[-2].startswith("  expected: token_id=70 prev_hash=0x")


def test_tampered_head_record_is_reported_by_head_only(make_canary: MakeCanary) -> None:
    pool, canary = make_canary()
    forward(pool, canary, pool.view([(1, [5, 7, 9])]))
    slot = int(pool.r2t[1, 0])
    canary.group("full").words("head", "k")[slot, 1] ^= 1
    forward(pool, canary, pool.view([(1, [11])]))
    tags = {v.tag for v in canary.drain_violations()}
    assert tags == {LaunchTag.HEAD_K_FULL}


def test_install_none_mode_returns_none() -> None:
    from kvcanary.canary import install
    from tests.canary.conftest import capacities
    from tests.canary.handpool import HandPool

    pool = HandPool()
    assert install(CanaryConfig(), [pool.group()], capacities(pool)) is None


def test_write_input_assert_without_oracle_fails_install(make_canary: MakeCanary) -> None:
    import pytest

    with pytest.raises(ValueError) as err:
        make_canary(enable_write_input_assert=True)
    assert str(err.value) == (
        "kv-canary: enable_write_input_assert=True requires a token oracle; pass token_oracle=... to install(...)"
    )
