"""SPEC §14.2 with both kernel implementations: every slot the canary would read or write is
range-checked before any kernel runs, with the exact messages, and shape errors of the view
(lists, ranks, rows that do not fit `req_to_token`) are contract errors, never crashes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from kvcanary.canary import (
    Canary,
    CanaryConfig,
    CanaryContractError,
    CanaryMode,
    RealDataMode,
    install,
)
from kvcanary.contract import BufferGroupSpec, ExpectedInputs, ForwardView, GroupKind, RealKvSource
from kvcanary.contract.oracle import TokenOracle
from tests.canary.conftest import capacities, forward
from tests.canary.handpool import HandPool

KERNELS = ["fast", "reference"]
SWA_SLOTS = 40


def full_canary(kernels: str, **config: object) -> tuple[HandPool, Canary]:
    pool = HandPool()
    pool.r2t = pool.r2t.to(torch.int64)
    cfg = dataclasses.replace(
        CanaryConfig(mode=CanaryMode.LOG, real_data=RealDataMode.PARTIAL,
                     stats_print_every_n_steps=0), **config)  # fmt: skip
    oracle = TokenOracle(100) if cfg.enable_write_input_assert else None
    canary = install(cfg, [pool.group(16)], capacities(pool), oracle, kernels=kernels)
    assert canary is not None
    return pool, canary


def swa_canary(kernels: str) -> tuple[HandPool, Canary, torch.Tensor]:
    """FULL (64 slots) + SWA (40 slots, window 3) with an identity table below 40."""
    pool = HandPool()
    pool.r2t = pool.r2t.to(torch.int64)
    lut = torch.arange(pool.num_slots, dtype=torch.int64) % SWA_SLOTS
    groups = [pool.group(None), BufferGroupSpec(kind=GroupKind.SWA, num_slots=SWA_SLOTS, has_v=False,
                                                full_to_swa=lut, window=3)]  # fmt: skip
    cfg = CanaryConfig(
        mode=CanaryMode.LOG, real_data=RealDataMode.NONE, stats_print_every_n_steps=0
    )
    canary = install(cfg, groups, capacities(pool), kernels=kernels)
    assert canary is not None
    return pool, canary, lut


def with_history(pool: HandPool, canary: Canary) -> ForwardView:
    """Row 1 gets 5 tokens (slots 1-5); returns a decode view extending it by one."""
    forward(pool, canary, pool.view([(1, [1, 2, 3, 4, 5])]))
    return pool.view([(1, [6])])


def message(kernels: str, edit: Callable[[HandPool, ForwardView], ForwardView | None]) -> str:
    pool, canary = full_canary(kernels)
    view = with_history(pool, canary)
    view = edit(pool, view) or view
    with pytest.raises(CanaryContractError) as err:
        canary.pre_forward(view=view)
    return str(err.value)


def slot_msg(value: int, group: str = "full", n: int = 64) -> str:
    return f"kv-canary: slot {value} is outside the {group} group's {n} slots"


def set_r2t(pos: int, value: int) -> Callable[[HandPool, ForwardView], None]:
    def edit(pool: HandPool, view: ForwardView) -> None:
        pool.r2t[1, pos] = value

    return edit


def set_out(value: int) -> Callable[[HandPool, ForwardView], ForwardView]:
    def edit(pool: HandPool, view: ForwardView) -> ForwardView:
        return dataclasses.replace(view, out_slots=torch.tensor([value]))

    return edit


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize(
    ("edit", "bad"),
    [
        (set_r2t(2, 64), 64),  # verify slot
        (set_r2t(2, -5), -5),  # verify slot, negative: no wrap
        (set_r2t(2, -1), -1),  # -1 is no sentinel for a verify slot
        (set_r2t(0, -2), -2),  # verify slot of position 0 and predecessor of position 1
        (set_r2t(4, 10**15), 10**15),  # the seed (position prefix_len - 1)
        (set_r2t(4, -7), -7),  # a negative seed
        (set_out(64), 64),  # out_slots
        (set_out(-2), -2),  # out_slots: only -1 means "no write"
        (set_out(-(2**63)), -(2**63)),
    ],
)
def test_full_group_slots_outside_the_group(
    kernels: str, edit: Callable[[HandPool, ForwardView], ForwardView | None], bad: int
) -> None:
    assert message(kernels, edit) == slot_msg(bad)


@pytest.mark.parametrize("kernels", KERNELS)
def test_minus_one_write_slot_and_zero_seed_are_sentinels(kernels: str) -> None:
    pool, canary = full_canary(kernels)
    view = with_history(pool, canary)
    forward(pool, canary, dataclasses.replace(view, out_slots=torch.tensor([-1])))
    assert canary.total_violations == 0
    assert canary.group("full").buffer("head", "k")[6].tolist() == [0] * 32  # nothing written


@pytest.mark.parametrize("kernels", KERNELS)
def test_seed_is_checked_when_verify_is_skipped_for_overflow(kernels: str) -> None:
    pool, canary = full_canary(kernels)
    view = with_history(pool, canary)
    canary.capacities = dataclasses.replace(canary.capacities, verify_capacity=1)
    pool.r2t[1, 4] = 64
    with pytest.raises(CanaryContractError) as err:
        canary.pre_forward(view=view)
    assert str(err.value) == slot_msg(64)
    pool.r2t[1, 4] = 5
    forward(pool, canary, view)  # the same forward with a valid seed: verify skipped, writes run
    assert canary.group("full").buffer("head", "k").view("int64")[6, :2].tolist() == [6, 5]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("target", ["verify", "prev", "seed", "write"])
@pytest.mark.parametrize("value", [SWA_SLOTS, 999, -1, -3])
def test_swa_table_values_outside_the_swa_group(kernels: str, target: str, value: int) -> None:
    pool, canary, lut = swa_canary(kernels)
    forward(pool, canary, pool.view([(1, [1, 2, 3, 4, 5])]))
    view = pool.view([(1, [6])])
    full_slot = {"verify": 3, "prev": 2, "seed": 5, "write": 6}[target]
    lut[full_slot] = value
    with pytest.raises(CanaryContractError) as err:
        canary.pre_forward(view=view)
    assert str(err.value) == slot_msg(value, "swa", SWA_SLOTS)


@pytest.mark.parametrize("kernels", KERNELS)
def test_swa_table_index_outside_the_table(kernels: str) -> None:
    pool, canary, _ = swa_canary(kernels)
    canary.group("swa").lut = canary.group("swa").lut[:4]  # type: ignore[index]
    with pytest.raises(ValueError) as err:
        canary.pre_forward(view=pool.view([(1, [1, 2, 3, 4, 5])]))
    assert str(err.value) == "kv-canary: SWA slot 4 is outside full_to_swa_index_mapping length 4"


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            dict(prefix_lens=torch.tensor([32])),
            "kv-canary: forward_view row at index 0 (req_to_token row 1) needs prefix_len + "
            "extend_len = 33 positions but req_to_token is only 32 wide",
        ),
        (
            dict(prefix_lens=torch.tensor([2**63 - 1])),
            "kv-canary: forward_view row at index 0 (req_to_token row 1) needs prefix_len + "
            f"extend_len = {2**63} positions but req_to_token is only 32 wide",
        ),
        (
            dict(rows=torch.tensor([8])),
            "kv-canary: forward_view row at index 0 names req_to_token row 8, but req_to_token "
            "has 8 rows",
        ),
        (
            dict(rows=torch.tensor([-1])),
            "kv-canary: forward_view row at index 0 names req_to_token row -1, but req_to_token "
            "has 8 rows",
        ),
        (
            dict(prefix_lens=torch.tensor([-4])),
            "kv-canary: forward_view row at index 0 (req_to_token row 1) has a negative "
            "prefix_len -4",
        ),
        (
            dict(extend_lens=torch.tensor([2**62])),
            f"kv-canary: forward_view active rows need {2**62} tokens but only 1 were given",
        ),
        (
            dict(rows=torch.tensor([[1]])),
            "kv-canary: forward_view.rows must be 1-D, got shape (1, 1)",
        ),
        (
            dict(positions=torch.tensor(5)),
            "kv-canary: forward_view.positions must be 1-D, got shape ()",
        ),
        (
            dict(req_to_token=torch.zeros(64, dtype=torch.int64)),
            "kv-canary: forward_view.req_to_token must be 2-D, got shape (64,)",
        ),
    ],
)
def test_rows_that_do_not_fit_req_to_token(
    kernels: str, changes: dict[str, object], expected: str
) -> None:
    assert message(kernels, lambda _, v: dataclasses.replace(v, **changes)) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("kernels", KERNELS)
def test_huge_extend_lens_do_not_overflow_the_token_count(kernels: str) -> None:
    pool, canary = full_canary(kernels)
    view = pool.view([(1, [1]), (2, [2])])
    bad = dataclasses.replace(view, extend_lens=torch.tensor([2**62, 2**62]))
    with pytest.raises(CanaryContractError) as err:
        canary.pre_forward(view=bad)
    assert str(err.value) == (
        f"kv-canary: forward_view active rows need {2**63} tokens but only 2 were given"
    )


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize(
    ("value", "shown"),
    [([6], "list"), ((6,), "tuple"), (None, "NoneType"), (torch.tensor([6.0]), "torch.float32")],
)
def test_expected_inputs_without_an_int_dtype(kernels: str, value: object, shown: str) -> None:
    pool, canary = full_canary(kernels, enable_write_input_assert=True)
    view = pool.view([(1, [6])])
    expected = ExpectedInputs(tokens=value, positions=torch.tensor([0]))  # type: ignore[arg-type]
    with pytest.raises(TypeError) as err:
        canary.pre_forward(view=dataclasses.replace(view, expected_inputs=expected))
    assert str(err.value) == (
        f"kv-canary: forward_view.expected_inputs.tokens must have an int32 or int64 dtype, got {shown}"
    )


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("truth", [[["a", "b"]], [[1.5]], [[2**70]], [5], ["xy"], [[[1, 2]]]])
def test_truth_tokens_that_are_not_int_sequences(kernels: str, truth: object) -> None:
    pool, canary = full_canary(kernels, enable_verify_token_assert=True)
    view = pool.view([(1, [6])])
    with pytest.raises(TypeError) as err:
        canary.pre_forward(view=dataclasses.replace(view, truth_tokens=truth))  # type: ignore[arg-type]
    assert str(err.value).startswith(
        "kv-canary: forward_view.truth_tokens must be one sequence of int64 token ids per active row"
    )


def test_a_source_must_cover_the_group() -> None:
    k = torch.zeros(10, 32, dtype=torch.uint8)
    with pytest.raises(ValueError) as err:
        BufferGroupSpec(kind=GroupKind.FULL, num_slots=64, k_sources=(RealKvSource(k, 2, 16, 16),))
    assert str(err.value) == (
        "kv-canary: full group k_sources[0] covers 20 slots (10 rows x page_size=2) but the group "
        "has 64; a source needs a row for every page of the pool"
    )
    BufferGroupSpec(kind=GroupKind.FULL, num_slots=20, k_sources=(RealKvSource(k, 2, 16, 16),))


def test_a_source_must_be_dense_past_dim_0() -> None:
    k = torch.zeros(64, 4, 64, dtype=torch.uint8)[:, :, :32]  # rows with gaps
    with pytest.raises(ValueError) as err:
        RealKvSource(k, 1, 128, 16)
    assert str(err.value) == (
        "kv-canary: RealKvSource.tensor must be dense past dim 0 (each row one run of bytes), "
        "got shape=(64, 4, 32), strides=(256, 64, 1)"
    )
    RealKvSource(torch.zeros(64, 1, 32, dtype=torch.uint8).transpose(1, 2), 1, 32, 16)
