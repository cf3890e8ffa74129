"""Numba `stage_serial`: a stage's verify and write in one call, on the calling thread.

A decode step's HEAD or TAIL launch is small (hundreds to a few thousand entries), so the Python
around two kernel calls (two dispatches of some twenty arguments, two scratch passes) costs
about as much as the verify itself: measured on a captured vLLM decode step, a HEAD stage
10.3 -> 7.9 us and a TAIL stage 16.4 -> 14.1 us fused. The runtime fuses only serial launches
outside `recover` mode, whose incident attribution re-reads the records between the two passes.
"""

from __future__ import annotations

from numba import njit

from kvcanary.canary.kernels.fast_verify import verify_serial
from kvcanary.canary.kernels.fast_write import write_serial


@njit(cache=True)
def stage_serial(  # type: ignore[no-untyped-def]
    buf, v_slot, v_prev, v_pos, v_tok, do_verify, seeds, req_offsets, w_slots, in_order,
    input_ids, positions, do_assert, exp_tok, exp_pos, chain_position, s0, s1, s2, s3, params,
    count, tag, ring, state,
):  # fmt: skip
    """`verify_serial` (when `do_verify`; a plan that overflowed verifies nothing) then
    `write_serial` over one buffer and one ring; returns the ring's write index after the verify
    (its rows come first, then the write's)."""
    if do_verify:
        verify_serial(buf, v_slot, v_prev, v_pos, v_tok, s0, s1, s2, s3, params, count, tag, ring,
                      state)  # fmt: skip
    verified = state[0]
    write_serial(
        buf, seeds, req_offsets, w_slots, in_order, input_ids, positions, do_assert, exp_tok,
        exp_pos, chain_position, s0, s1, s2, s3, params, count, tag, ring, state,
    )  # fmt: skip
    return verified
