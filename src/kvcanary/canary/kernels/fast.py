"""Numba CPU kernels: plan building, verify, write and the real-KV fold (SPEC §4, §5).

Byte-equal to `kernels.reference` (the tests check it). Buffers are `[num_slots, 4]` u64 word
views of the record buffers; the ring is the `[capacity, 8]` u64 view of the int64 ring, `state[0]` its write index
(numba loses writes through `.view` inside parallel functions, so callers pass the view).
Verify and write are parallel across entries and requests respectively; ring rows are recorded
afterwards by a serial pass in plan order, so the ring is deterministic.

This module is the facade; the kernels live in one module per concept:

* `_intrinsics`: splitmix64 / mix3, the real-KV fold, row-prefetch intrinsics, the ring append;
* `fast_plan`: `build_plan` (and `build_plan_packed`, its arrays in one buffer);
* `fast_verify`: `verify` and its chunked / vectorized violation counters;
* `fast_write_lanes`: the per-entry steps of a write chain, four-lane lockstep, the in-order writer;
* `fast_write`: `write`, its parallel chain tasks and the ring replay;
* `fast_stage`: `stage_serial`, a small stage's verify and write in one call;
* `fast_forward`: `forward_head` / `forward_tail`, a small forward's checks, plan and HEAD in
  one call and its TAIL in another, and `sweep_serial` / `sweep_runs_serial`, a small sweep
  (the runtime's fused path, `canary.fused`; the reference kernels have no twin: the general
  path is its reference).

`verify_serial` and `write_serial` are the two parallel kernels compiled without threads,
byte-equal to them: the runtime launches them for small stages (a decode step), where waking the
thread pool, or waiting for a pool thread that other threads keep off a core, costs more than
the work. `stage_serial` (`fast_stage`) runs the two in one call.

Performance (bench/kernels.py): each module's docstring notes what its kernel does for speed.
Each kernel is one parallel region (a thread barrier): a barrier waits for every worker thread,
which is slow whenever another process holds a core, so no np.zeros (numba runs it as a parallel
loop) in a parallel function.
"""

from __future__ import annotations

from kvcanary.canary.kernels._intrinsics import (
    HEAD_HASH_U64,
    fold_sources,
    mix3,
    prefetch_element,
    splitmix64,
)
from kvcanary.canary.kernels.fast_forward import (
    forward_head,
    forward_tail,
    sweep_runs_serial,
    sweep_serial,
)
from kvcanary.canary.kernels.fast_plan import build_plan, build_plan_packed, stride_verifies
from kvcanary.canary.kernels.fast_stage import stage_serial
from kvcanary.canary.kernels.fast_verify import verify, verify_serial
from kvcanary.canary.kernels.fast_write import write, write_serial

__all__ = [
    "HEAD_HASH_U64",
    "build_plan",
    "build_plan_packed",
    "fold_sources",
    "forward_head",
    "forward_tail",
    "mix3",
    "prefetch_element",
    "splitmix64",
    "stage_serial",
    "stride_verifies",
    "sweep_runs_serial",
    "sweep_serial",
    "verify",
    "verify_serial",
    "write",
    "write_serial",
]
