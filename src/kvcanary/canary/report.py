"""The violation message (SPEC §7.3; first line frozen, compat) and structured rows (§7.5)."""

from __future__ import annotations

from collections.abc import Sequence

from kvcanary.contract.tags import WRITE_BITS, FailReason, fail_reason_labels, tag_name
from kvcanary.contract.violation import Violation

__all__ = ["canary_kind", "format_violation", "make_violation"]

_MASK64 = (1 << 64) - 1
_SHOWS_EXPECTED_TOKEN = FailReason.WRITE_TOKEN_MISMATCH | FailReason.VERIFY_TOKEN_MISMATCH


def _hex(value: int) -> str:
    return f"{value & _MASK64:#018x}"


def canary_kind(tag: int) -> str:
    """`sweep_k_full` for SWEEP tags, `per_forward_` + lower-cased name otherwise."""
    name = tag_name(tag)
    if name.startswith("unknown("):
        return name
    return name.lower() if name.startswith("SWEEP_") else f"per_forward_{name.lower()}"


def format_violation(
    row: Sequence[int], *, total_violations: int, ring_capacity: int, step_when_pumped: int
) -> str:
    """Render one ring row as the multi-line message of SPEC §7.3."""
    kind, slot, pos, tok, etok, h, aux, bits = (int(x) for x in row)
    tag = tag_name(kind)
    labels = fail_reason_labels(bits)
    first = (
        f"kv_canary violation: launch_tag={tag} fail_reason={'+'.join(labels) or 'none'} "
        f"slot_idx={slot} position={pos} stored_token={tok} expected_token={etok} "
        f"stored_chain_hash={_hex(h)} expected_aux={_hex(aux)}"
    )
    if bits & WRITE_BITS:
        body = (
            f"  actual:   token_id={tok}   position={pos} prev_hash={_hex(h)}\n"
            f"  expected: token_id={etok}   position={aux}"
        )
    else:
        expected = (
            f"token_id={etok} prev_hash={_hex(aux)}"
            if bits & _SHOWS_EXPECTED_TOKEN
            else f"prev_hash={_hex(aux)}"
        )
        body = f"  stored:   token_id={tok}   position={pos} prev_hash={_hex(h)}\n  expected: {expected}"
    return (
        f"{first}\n"
        f"KV cache canary violation detected (kernel_kind={tag}, slot_idx={slot}, position={pos})\n"
        f"canary_kind:       {canary_kind(kind)}\n"
        f"  fail_reasons: {' '.join(labels) or 'none'}\n"
        f"{body}\n"
        f"  total_violations={total_violations} ring_overflow={total_violations > ring_capacity} "
        f"step_when_pumped={step_when_pumped}"
    )


def make_violation(
    row: Sequence[int],
    *,
    total_violations: int,
    ring_capacity: int,
    step_when_pumped: int,
    expected_position: int | None = None,
) -> Violation:
    """The structured record of one ring row, with its formatted message."""
    kind, slot, pos, tok, etok, h, aux, bits = (int(x) for x in row)
    message = format_violation(
        row,
        total_violations=total_violations,
        ring_capacity=ring_capacity,
        step_when_pumped=step_when_pumped,
    )
    return Violation(
        kernel_kind=kind,
        slot_idx=slot,
        position=pos,
        stored_token=tok,
        expected_token=etok,
        stored_chain_hash=h,
        expected_aux=aux,
        fail_reason_bits=bits,
        step_when_pumped=step_when_pumped,
        message=message,
        expected_position=expected_position,
    )
