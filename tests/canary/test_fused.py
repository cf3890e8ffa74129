"""Property test: the fused forward (`canary.fused`, the fast kernels' `forward_head` and
`forward_tail`) is the general path. Views the fused checks take (plain int64 arrays, int32 or
int64 tables, TruthTables), drawn small and often out of range, run through the fast canary
(fused wherever it applies) and the reference one (no fused kernels: the general path); every
forward must raise the same documented error or leave byte-equal buffers and identical rings.
Scenarios also draw a tiny serial-launch limit (the fused plan handed to the parallel stages),
record flips (violations) and fault-free runs; a probe asserts each path is really taken."""

from __future__ import annotations

import copy
import os
from typing import Any
from unittest import mock

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcanary.canary import (
    CanaryConfig,
    CanaryLaunchCapacities,
    CanaryMode,
    RealDataMode,
    install,
    runtime,
)
from kvcanary.canary.fused import FusedForward, PackedForward
from kvcanary.contract import BufferGroupSpec, ForwardView, GroupKind, RealKvSource, TruthTable

EXAMPLES = int(os.environ.get("KVCANARY_FUZZ_EXAMPLES", "2600")) // 4
HUGE = [2**62, -(2**62), 2**63 - 1, -(2**63)]


class Gen:
    """Hypothesis draws a seed, NumPy draws the values: mostly valid, sometimes far outside."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.wild = float(self.rng.choice([0.0, 0.0, 0.03, 0.15]))

    def values(self, lo: int, hi: int, size: int) -> list[int]:
        out = self.rng.integers(lo, hi + 1, size=size).tolist()
        for i in np.flatnonzero(self.rng.random(size) < self.wild):
            out[i] = HUGE[int(self.rng.integers(0, len(HUGE)))]
        return out

    def flat(self, data: list[int]) -> Any:
        """A plain int64 array (the fused path), now and then an int32 one or a tensor."""
        arr = np.array(data, dtype=np.int64)
        kind = int(self.rng.integers(0, 80))
        small = bool(arr.size == 0 or (np.abs(arr) < 2**31).all())
        if kind == 0 and small:
            return arr.astype(np.int32)
        if kind == 1:
            return torch.from_numpy(arr)
        return arr

    def table(self, data: list[int], shape: tuple[int, ...]) -> Any:
        """An int32/int64 array or CPU tensor (each taken by the fused path)."""
        arr = np.array(data, dtype=np.int64).reshape(shape)
        small = bool(arr.size == 0 or (np.abs(arr) < 2**31).all())
        if small and self.rng.random() < 0.5:
            arr = arr.astype(np.int32)
        return torch.from_numpy(arr) if self.rng.random() < 0.3 else arr


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    g = Gen(draw(st.integers(0, 2**63 - 1)))
    rng = g.rng
    n = int(rng.integers(2, 13))
    num_rows, width = int(rng.integers(1, 5)), int(rng.integers(0, 8))
    forwards = []
    refill = bool(rng.random() < 0.5)  # one view refilled in place: its shape stays
    b, t = int(rng.integers(0, 5)), int(rng.integers(0, 10))
    pick, linear, nlens = rng.random(), bool(rng.random() < 0.8), int(rng.integers(0, b + 2))
    for _ in range(int(rng.integers(1, 5))):
        if not refill:
            b, t = int(rng.integers(0, 5)), int(rng.integers(0, 10))
            pick, linear = rng.random(), bool(rng.random() < 0.8)
            nlens = int(rng.integers(0, b + 2))
        rows = [int(x) for x in rng.integers(0, num_rows + 1, size=b)]
        extend = g.values(0, 3, b)
        prefix = g.values(0, width, b)
        if rng.random() < 0.6:  # well-formed: padding last, rows fit the table, tokens match
            rows.sort(key=lambda r: r == 0)
            extend = [max(0, min(e, width)) if r else 0 for r, e in zip(rows, extend, strict=True)]
            prefix = [int(rng.integers(0, width - e + 1)) for e in extend]
            t = sum(extend)
        fields = {
            "rows": g.flat(rows),
            "prefix_lens": g.flat(prefix),
            "extend_lens": g.flat(extend),
            "input_ids": g.flat(g.values(0, 9, t)),
            "positions": g.flat(g.values(0, 8, t)),
            "out_slots": g.flat(g.values(-1, n - 1, t)),
            "req_to_token": g.table(g.values(0, n - 1, num_rows * width), (num_rows, width)),
        }
        truth: Any = None
        if pick < 0.5:
            lens = g.values(-1 if rng.random() < 0.1 else 0, width + 2, nlens)
            tokens = g.table(g.values(0, 9, (num_rows + 1) * (width + 1)),
                             (num_rows + 1, width + 1))  # fmt: skip
            truth = TruthTable(tokens, g.table(lens, (len(lens),)))
        elif pick < 0.6:
            truth = [list(range(int(rng.integers(0, width + 2)))) for _ in range(b)]
        lax = int(rng.random() < 0.3)  # a walk with slots one past either end of the group
        forwards.append({
            "fields": fields, "truth": truth, "linear": linear,
            "kv_flip": int(rng.integers(-n * 32, n * 32)),
            "record_flip": int(rng.integers(-4 * n * 32, n * 32)),
            "walk": list(zip(g.values(-lax, n - 1 + lax, 3), g.values(0, 8, 3),
                             g.values(-1 - lax, n - 1 + lax, 3), strict=True)),
        })  # fmt: skip
    return {
        "n": n,
        "width": width,
        "mode": list(RealDataMode)[int(rng.integers(0, 3))],
        "enable_v": bool(rng.random() < 0.15),
        "token_check": bool(rng.random() < 0.6),
        "chain_position": bool(rng.random() < 0.5),
        "verify_capacity": [1, 3, 100, 100, 100][int(rng.integers(0, 5))],
        "serial_limit": ([runtime.SERIAL_LAUNCH_ENTRIES] * 2 + [1, 4])[int(rng.integers(0, 4))],
        "forwards": forwards,
        "refill": refill,
        "stride": [1, 1, 2, 3][int(rng.integers(0, 4))],
    }


def refilled(prev: ForwardView | None, fw: dict[str, Any]) -> ForwardView:
    """`fw`'s view; when `prev` has NumPy arrays (and truth table) of the same shapes, `prev`
    itself with `fw`'s values written into its arrays (cast to their dtypes), as an adapter
    refills one view while its batch keeps its shape (the fused path keeps what it checked of a
    view it saw before)."""
    new = ForwardView(**fw["fields"], truth_tokens=fw["truth"], linear_chain=fw["linear"])
    if prev is None or prev.linear_chain != new.linear_chain:
        return new
    pairs = [(getattr(prev, k), getattr(new, k)) for k in fw["fields"]]
    a, b = prev.truth_tokens, new.truth_tokens
    if type(a) is TruthTable and type(b) is TruthTable:
        pairs += [(a.tokens, b.tokens), (a.lens, b.lens)]
    elif type(a) is not type(b) or not (a is None or type(a) is list):
        return new
    if not all(type(x) is np.ndarray and type(y) is np.ndarray and x.shape == y.shape
               for x, y in pairs):  # fmt: skip
        return new
    for x, y in pairs:
        x[...] = y.astype(x.dtype)  # int64 into int32 wraps, for both kernels alike
    if type(a) is list:
        a[:] = b  # a plain-list truth: the same list object, refilled
    return prev


class Walker:
    def __init__(self) -> None:
        self.entries: list[tuple[int, int, int]] = []

    def walk(self, *, unlocked_only: bool = False, swa_resident_only: bool = False) -> Any:
        return self.entries


def outcome(kernels: str, sc: dict[str, Any], taken: list[str] | None = None,
            refill: bool = False) -> list[Any]:  # fmt: skip
    """Every observable result of running `sc` with `kernels`, errors included; `taken` gets,
    for each forward past HEAD, "staged" (HEAD ran fused, TAIL will) or "other". `refill`:
    views of one shape are one object refilled in place (`refilled`)."""
    k_bytes = torch.zeros(sc["n"], 32, dtype=torch.uint8)
    events: list[Any] = []

    def guarded(step: str, fn: Any) -> bool:
        try:
            fn()
            return True
        except (TypeError, ValueError) as err:  # CanaryContractError is a ValueError
            assert str(err).startswith("kv-canary: "), (step, err)
            events.append((step, type(err).__name__, str(err)))
            return False

    sources = (RealKvSource(k_bytes, 1, 32, 16),)
    groups = [BufferGroupSpec(kind=GroupKind.FULL, num_slots=sc["n"], k_sources=sources,
                              v_sources=sources)]  # fmt: skip
    cfg = CanaryConfig(mode=CanaryMode.LOG, real_data=sc["mode"], enable_v=sc["enable_v"],
                       enable_verify_token_assert=sc["token_check"], sweep_interval=1,
                       ring_capacity=6, stats_print_every_n_steps=0,
                       verify_stride=sc["stride"])  # fmt: skip
    caps = CanaryLaunchCapacities(write_req_capacity=4, write_entry_capacity=8,
                                  verify_capacity=sc["verify_capacity"],
                                  max_seq_len_per_req=sc["width"] + 1)  # fmt: skip
    with mock.patch.object(runtime, "SERIAL_LAUNCH_ENTRIES", sc["serial_limit"]):
        canary = install(cfg, groups, caps, kernels=kernels)
        assert canary is not None
        canary.chain_position_assert_enabled = sc["chain_position"]
        walker = Walker()
        canary.attach_prefix_cache(walker=walker)
        canary.mark_init_finished()
        record = canary.group("full").buffer("tail", "k").reshape(-1)
        view: ForwardView | None = None
        # refilling writes into the arrays: the scenario's own stay as drawn
        forwards = copy.deepcopy(sc["forwards"]) if refill else sc["forwards"]
        for step, fw in enumerate(forwards):
            if refill:
                view = refilled(view, fw)
            else:
                view = ForwardView(**fw["fields"], truth_tokens=fw["truth"],
                                   linear_chain=fw["linear"])  # fmt: skip
            walker.entries = fw["walk"]
            if guarded(f"pre{step}", lambda v=view: canary.pre_forward(view=v)):
                opened = canary._open  # white-box: which path this forward took
                assert opened is not None
                if taken is not None:
                    taken.append("staged" if isinstance(opened, PackedForward) else "other")
                if 0 <= fw["kv_flip"] < k_bytes.numel():
                    k_bytes.view(-1)[fw["kv_flip"]] ^= 1  # the "model" writes some KV byte
                guarded(f"post{step}", lambda v=view: canary.post_forward(view=v))
            if 0 <= fw["record_flip"] < record.size:
                record[fw["record_flip"]] ^= 4  # a stray write into a TAIL record
            guarded(f"end{step}", canary.end_step)
            state = [g.buffer(stage, half).tobytes() for g in canary.groups
                     for stage in ("head", "tail") for half in g.halves]  # fmt: skip
            events.append((step, state, canary.ring.rows.tolist(), canary.total_violations,
                           dict(canary.kernel_run_counter), dict(canary.slot_run_counter)))  # fmt: skip
    return events


def check(sc: dict[str, Any]) -> None:
    assert outcome("fast", sc, refill=sc["refill"]) == outcome("reference", sc, refill=sc["refill"])


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(scenarios())
def test_fused_forward_equals_the_general_path(sc: dict[str, Any]) -> None:
    check(sc)


def test_the_fuzz_takes_every_path_and_reaches_errors_and_violations() -> None:
    """Guard against a vacuous property: fused forwards (staged and launched), general ones,
    fused sweeps and sweeps handed back, contract errors of several kinds and violations all
    occur."""
    seen: dict[str, int] = {"violations": 0, "strided violations": 0}
    paths: list[str] = []
    heads: list[bool] = []
    real_head, real_sweep = FusedForward.head, FusedForward.sweep
    sweeps: list[bool] = []

    def sweep(self: FusedForward, walked: Any) -> bool:
        sweeps.append(real_sweep(self, walked))
        return sweeps[-1]

    def head(self: FusedForward, view: ForwardView, chain: bool, phase: int = 0) -> Any:
        fwd = real_head(self, view, chain, phase)
        heads.append(fwd is not None and not fwd.staged)
        return fwd

    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
    @given(scenarios())
    def probe(sc: dict[str, Any]) -> None:
        for event in outcome("fast", sc, paths, refill=sc["refill"]):
            if isinstance(event[0], str):
                key = " ".join(event[2].split(" ")[1:3])
                seen[key] = seen.get(key, 0) + 1
            else:
                seen["violations"] += event[3] > 0
                seen["strided violations"] += event[3] > 0 and sc["stride"] > 1

    reused = [0]
    real_refilled = refilled

    def counted(prev: ForwardView | None, fw: dict[str, Any]) -> ForwardView:
        out = real_refilled(prev, fw)
        reused[0] += out is prev
        return out

    with (
        mock.patch.object(FusedForward, "head", head),
        mock.patch.object(FusedForward, "sweep", sweep),
        mock.patch(f"{__name__}.refilled", counted),
    ):
        probe()
    assert reused[0] > 20, reused  # views refilled in place: what the fused path keeps
    assert sweeps.count(True) > 100 and sweeps.count(False) > 10, (sweeps.count(True), len(sweeps))
    launched = sum(heads)  # fused plans whose stages the runtime launched
    assert paths.count("staged") > 100, paths.count("staged")
    assert launched > 10, launched
    assert paths.count("other") - launched > 20, (paths.count("other"), launched)
    assert seen["violations"] > 20, seen
    assert seen["strided violations"] > 5, seen  # a verify stride in the comparison, finding
    assert sum(1 for k in seen if k.startswith("forward_view")) >= 2, seen
    assert any(k.startswith("slot") for k in seen), seen


def one_row_view(truth: Any) -> ForwardView:
    """A view of one request writing tokens 5, 6 to slots 1, 2 (its arrays its own, so a test
    can refill them in place)."""
    return ForwardView(rows=np.array([1]), prefix_lens=np.array([0]), extend_lens=np.array([2]),
                       input_ids=np.array([5, 6]), positions=np.array([0, 1]),
                       out_slots=np.array([1, 2]), req_to_token=np.array([[0, 0], [1, 2]]),
                       truth_tokens=truth)  # fmt: skip


def small_canary(kernels: str, token_check: bool) -> Any:
    """A four-slot FULL canary in `log` mode with `kernels`, initialised."""
    groups = [BufferGroupSpec(kind=GroupKind.FULL, num_slots=4)]
    cfg = CanaryConfig(mode=CanaryMode.LOG, enable_verify_token_assert=token_check,
                       stats_print_every_n_steps=0)  # fmt: skip
    caps = CanaryLaunchCapacities(write_req_capacity=4, write_entry_capacity=8,
                                  verify_capacity=100, max_seq_len_per_req=3)  # fmt: skip
    canary = install(cfg, groups, caps, kernels=kernels)
    assert canary is not None
    canary.mark_init_finished()
    return canary


def test_a_kept_view_is_read_again_when_its_truth_table_changes() -> None:
    """The fused path keeps what it checked of a view it saw before; a truth table whose arrays
    were replaced (it is not frozen) must be checked and read again: the fast canary reports the
    token violations the reference one does, forward by forward."""
    tokens = [np.array([[5, 6]]), np.array([[5, 7]])]  # view row 0's truth: two tokens

    def run(kernels: str) -> list[Any]:
        canary = small_canary(kernels, token_check=True)
        truth = TruthTable(tokens[0], np.array([2]))
        view = one_row_view(truth)
        seen = []
        for step in range(4):
            if step == 2:
                truth.tokens = tokens[1]  # the same table object, another token array
            if step >= 1:  # the second forward on: the first's two tokens are a prefix
                view.prefix_lens[0], view.extend_lens[0] = 2, 0
            canary.pre_forward(view=view)
            canary.post_forward(view=view)
            canary.end_step()
            seen.append(canary.total_violations)
        return seen

    fast = run("fast")
    assert fast == run("reference")
    assert fast[1] == 0 and fast[2] > fast[1], fast  # the replaced tokens were read


def test_a_kept_view_with_a_plain_list_truth_runs_again() -> None:
    """A view whose truth is a plain list (not a `TruthTable`), token check off, handed in twice:
    the fused path keeps it like any other (it once read `.tokens` of the list and raised)."""

    def run(kernels: str) -> list[Any]:
        canary = small_canary(kernels, token_check=False)
        view = one_row_view([[5, 6]])
        seen = []
        for step in range(3):
            if step >= 1:
                view.prefix_lens[0], view.extend_lens[0] = 2, 0
            canary.pre_forward(view=view)
            canary.post_forward(view=view)
            canary.end_step()
            seen.append((canary.total_violations, dict(canary.slot_run_counter)))
        return seen

    fast = run("fast")
    assert fast == run("reference")
    assert fast[-1][0] == 0 and sum(fast[-1][1].values()) > 0, fast
