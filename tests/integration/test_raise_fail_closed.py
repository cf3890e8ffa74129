"""Raise mode fails closed: after a KV byte or a `req_to_token` entry of a running request is
corrupted, the next step raises `CanaryViolationError` before any of its tokens reaches a request.
Log mode reports the same fault at the same slot and serves every request to completion."""

from __future__ import annotations

import pytest
import torch

from kvcanary.app.session import Stack, build_stack
from kvcanary.canary import CanaryMode, CanaryViolationError, RealDataMode
from kvcanary.contract import Violation, fail_reason_labels
from kvcanary.engine.request import Request, RequestStatus
from tests.integration.stacks import assert_clean, canary_config, run_settings

PROMPTS = {
    "a": (5, 17, 9, 44, 2, 81, 3, 3, 60, 12, 7),
    "b": (5, 17, 9, 44, 100, 101, 6),
    "c": (90, 1, 2, 3, 4, 5, 6, 7, 8, 120, 33, 70, 71),
}
MAX_NEW = 10
KV_BYTE, TABLE_ENTRY = "kv-byte", "req-to-token"


def build(mode: CanaryMode, model_kind: str) -> Stack:
    cfg = run_settings(
        canary_config(mode=mode, real_data=RealDataMode.PARTIAL, sweep=1, oracle=model_kind == "oracle"),
        model_kind=model_kind,
        num_slots=128,
        max_context_len=32,
        chunked_prefill_size=4,
        max_prefill_tokens=16,
    )  # fmt: skip
    stack = build_stack(cfg)
    for rid, prompt in PROMPTS.items():
        stack.engine.add_request(rid, prompt, MAX_NEW, stack.sampling(rid))
    return stack


def serve_until_all_decode(stack: Stack) -> None:
    """Clean steps until every request has sampled at least two tokens."""
    engine = stack.engine
    for _ in range(50):
        if all(len(engine.request(rid).output) >= 2 for rid in PROMPTS):
            break
        engine.step()
    assert all(engine.request(rid).status is RequestStatus.RUNNING for rid in PROMPTS)
    assert all(len(engine.request(rid).output) >= 2 for rid in PROMPTS)
    assert_clean(stack)


def corrupt(stack: Stack, fault: str) -> tuple[int, int, str]:
    """Corrupt request `a`'s position 1; returns the slot, stored position and fail reason the
    canary must report (a row's position is the record's stored position, SPEC §7)."""
    victim = stack.engine.request("a")
    slot = int(stack.table.tensor[victim.row, 1])
    assert slot == victim.slots[1] and slot != 0
    if fault == KV_BYTE:
        raw = stack.pool.k(0)[slot].view(torch.uint8)  # the live layer-0 K bytes of the slot
        raw.view(-1)[0] ^= 0x5A
        return slot, 1, "verify_real_kv_hash"
    other = stack.engine.request("c")
    wrong = other.slots[5]  # a live slot holding another request's token at position 5
    assert wrong not in victim.slots
    stack.table.tensor[victim.row, 1] = wrong
    return wrong, 5, "verify_position"


def reported(v: Violation, slot: int, position: int, reason: str) -> bool:
    return (
        v.slot_idx == slot
        and v.position == position
        and reason in fail_reason_labels(v.fail_reason_bits)
    )


def snapshot(stack: Stack) -> dict[str, tuple[int, int, list[int]]]:
    reqs: dict[str, Request] = {rid: stack.engine.request(rid) for rid in PROMPTS}
    return {rid: (r.num_computed, len(r.slots), list(r.output)) for rid, r in reqs.items()}


@pytest.mark.parametrize("model_kind", ["tiny", "oracle"])
@pytest.mark.parametrize("fault", [KV_BYTE, TABLE_ENTRY])
def test_raise_mode_stops_before_tokens_are_applied(fault: str, model_kind: str) -> None:
    stack = build(CanaryMode.RAISE, model_kind)
    serve_until_all_decode(stack)
    slot, position, reason = corrupt(stack, fault)
    before = snapshot(stack)
    generated = stack.engine.stats().tokens_generated

    with pytest.raises(CanaryViolationError):
        stack.engine.step()

    assert snapshot(stack) == before, "the failed step changed a request"
    assert stack.engine.stats().tokens_generated == generated
    assert any(reported(v, slot, position, reason) for v in stack.hooks.violations), [
        v.message for v in stack.hooks.violations
    ]
    if fault == KV_BYTE:  # the table is intact, so the discarded plan left no trace
        stack.engine.scheduler.check_integrity()


@pytest.mark.parametrize("model_kind", ["tiny", "oracle"])
@pytest.mark.parametrize("fault", [KV_BYTE, TABLE_ENTRY])
def test_log_mode_reports_the_same_fault_and_keeps_serving(fault: str, model_kind: str) -> None:
    stack = build(CanaryMode.LOG, model_kind)
    serve_until_all_decode(stack)
    slot, position, reason = corrupt(stack, fault)
    before = {rid: len(stack.engine.request(rid).output) for rid in PROMPTS}

    result = stack.engine.step()  # no exception: log mode reports and serves on

    assert result.plan is not None
    assert any(len(stack.engine.request(rid).output) > n for rid, n in before.items())
    flagged = [v for v in stack.hooks.violations if reported(v, slot, position, reason)]
    assert flagged, [v.message for v in stack.hooks.violations]
    assert stack.canary is not None and stack.canary.total_violations >= len(flagged) > 0

    finished = stack.engine.run_until_idle(max_steps=200)
    assert {f.request_id for f in finished} | {
        rid for rid in PROMPTS if stack.engine.request(rid).status is RequestStatus.FINISHED
    } == set(PROMPTS)
    assert all(len(stack.engine.request(rid).output) == MAX_NEW for rid in PROMPTS)
