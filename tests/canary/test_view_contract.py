"""ForwardView validation, phase errors, capacities per forward and SWA translation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcanary.canary import CanaryConfig, CanaryContractError, CanaryMode, RealDataMode, install
from kvcanary.contract import BufferGroupSpec, ExpectedInputs, ForwardView, GroupKind, LaunchTag
from tests.canary.conftest import MakeCanary, capacities, forward
from tests.canary.handpool import HandPool


def with_(view: ForwardView, **changes: object) -> ForwardView:
    return dataclasses.replace(view, **changes)  # type: ignore[arg-type]


def contract_message(
    make_canary: MakeCanary, exc: type[Exception], mutate: object, **kw: object
) -> str:
    pool, canary = make_canary(**kw)
    view = mutate(pool.view([(1, [1, 2]), (2, [3])]))  # type: ignore[operator]
    with pytest.raises(exc) as err:
        canary.pre_forward(view=view)
    return str(err.value)


def test_view_shape_messages(make_canary: MakeCanary) -> None:
    t = torch.tensor
    assert contract_message(
        make_canary, TypeError, lambda v: with_(v, positions=v.positions.float())
    ) == ("kv-canary: forward_view.positions must have an int32 or int64 dtype, got torch.float32")
    assert contract_message(
        make_canary, CanaryContractError, lambda v: with_(v, prefix_lens=t([0]))
    ) == ("kv-canary: forward_view rows and prefix_lens lengths differ: 2 vs 1")
    assert contract_message(
        make_canary, CanaryContractError, lambda v: with_(v, out_slots=v.out_slots[:2])
    ) == ("kv-canary: forward_view input_ids and out_slots lengths differ: 3 vs 2")
    assert contract_message(
        make_canary,
        CanaryContractError,
        lambda v: with_(v, rows=t([0, 2]), prefix_lens=t([0, 0]), extend_lens=t([2, 1])),
    ) == ("kv-canary: forward_view padding row at index 0 precedes an active row")
    assert contract_message(
        make_canary, CanaryContractError, lambda v: with_(v, extend_lens=t([2, 5]))
    ) == ("kv-canary: forward_view active rows need 7 tokens but only 3 were given")
    assert contract_message(
        make_canary, CanaryContractError, lambda v: v, caps={"req_to_token_pool_size": 1}
    ) == (
        "kv-canary: forward_view.batch_size=2 exceeds pre-allocated write_req_capacity=1; raise "
        "--cuda-graph-max-bs or check CanaryLaunchCapacities.from_args"
    )
    assert contract_message(
        make_canary,
        CanaryContractError,
        lambda v: v,
        caps={"max_prefill_tokens": 2, "req_to_token_pool_size": 2},
    ) == (
        "kv-canary: forward_view token count=3 exceeds pre-allocated write_entry_capacity=2; raise "
        "--chunked-prefill-size / --max-prefill-tokens or check CanaryLaunchCapacities.from_args"
    )
    assert contract_message(
        make_canary, ValueError, lambda v: with_(v, out_slots=t([1, 2, 999]))
    ) == ("kv-canary: slot 999 is outside the full group's 64 slots")
    from kvcanary.contract import TokenOracle

    expected = ExpectedInputs(tokens=torch.tensor([1, 2]), positions=torch.tensor([0, 1, 0]))
    assert contract_message(make_canary, ValueError, lambda v: with_(v, expected_inputs=expected),
                            enable_write_input_assert=True, oracle=TokenOracle(10)) == (
        "kv-canary: expected_inputs.tokens shape (2,) != num_tokens 3; caller must slice before invoking")  # fmt: skip


def test_phase_errors(make_canary: MakeCanary) -> None:
    pool, canary = make_canary()
    view = pool.view([(1, [1])])
    with pytest.raises(CanaryContractError) as err:
        canary.post_forward(view=view)
    assert str(err.value) == "kv-canary: post_forward called without a matching pre_forward"
    canary.pre_forward(view=view)
    with pytest.raises(CanaryContractError) as err:
        canary.pre_forward(view=view)
    assert str(err.value) == "kv-canary: pre_forward called twice without post_forward"
    with pytest.raises(CanaryContractError) as err:
        canary.end_step()
    assert str(err.value) == "kv-canary: end_step called while a forward is open"


def test_snapshot_protects_tail_from_in_place_position_edits(make_canary: MakeCanary) -> None:
    pool, canary = make_canary()
    view = pool.view([(1, [1, 2])])
    canary.pre_forward(view=view)
    view.positions.add_(5)  # a model mutating positions in place
    pool.write_kv(with_(view, positions=view.positions - 5))
    canary.post_forward(view=view)
    canary.end_step()
    forward(pool, canary, pool.view([(1, [3])]))
    assert canary.total_violations == 0


def test_chunked_prefill_yields_the_same_records(make_canary: MakeCanary) -> None:
    a, ca = make_canary()
    forward(a, ca, a.view([(1, [5, 7, 9, 11])]))
    b, cb = make_canary()
    forward(b, cb, b.view([(1, [5, 7])]))
    forward(b, cb, b.view([(1, [9, 11])]))
    for stage in ("head", "tail"):
        assert (
            ca.group("full").buffer(stage, "k")[1:5] == cb.group("full").buffer(stage, "k")[1:5]
        ).all()


def swa_canary(
    kernels: str, window: int, lut_len: int = 64
) -> tuple[HandPool, object, torch.Tensor]:
    pool = HandPool()
    lut = torch.arange(lut_len, dtype=torch.int64)  # identity mapping into a same-size SWA pool
    groups = [pool.group(None), BufferGroupSpec(kind=GroupKind.SWA, num_slots=pool.num_slots, has_v=False,
                                                full_to_swa=lut, window=window)]  # fmt: skip
    cfg = CanaryConfig(
        mode=CanaryMode.LOG, real_data=RealDataMode.NONE, stats_print_every_n_steps=0
    )
    canary = install(cfg, groups, capacities(pool), kernels=kernels)
    return pool, canary, lut


@pytest.mark.parametrize("kernels", ["fast", "reference"])
def test_swa_window_and_evicted_predecessor(kernels: str) -> None:
    pool, canary, lut = swa_canary(kernels, window=2)
    forward(pool, canary, pool.view([(1, [1, 2, 3, 4, 5])]))
    lut[int(pool.r2t[1, 0])] = 0  # position 0 left the window: evicted
    lut[int(pool.r2t[1, 2])] = 0  # position 2 is the predecessor of the first in-window entry
    forward(pool, canary, pool.view([(1, [6])]))
    assert canary.total_violations == 0
    assert canary.slot_run_counter[LaunchTag.HEAD_K_SWA] == 5 + 2 + 1  # verify [3, 5) only
    # a stale mapping inside the window is caught by the SWA group alone
    lut[int(pool.r2t[1, 4])] = int(pool.r2t[1, 1])
    forward(pool, canary, pool.view([(1, [7])]))
    tags = {v.tag for v in canary.drain_violations()}
    assert tags == {LaunchTag.HEAD_K_SWA, LaunchTag.TAIL_K_SWA}


@pytest.mark.parametrize("kernels", ["fast", "reference"])
def test_swa_lut_index_out_of_range(kernels: str) -> None:
    pool, canary, _ = swa_canary(kernels, window=4, lut_len=40)
    view = pool.view([(1, [1])])
    with pytest.raises(ValueError) as err:
        canary.pre_forward(view=with_(view, out_slots=torch.tensor([50])))
    assert str(err.value) == "kv-canary: SWA slot 50 is outside full_to_swa_index_mapping length 40"
