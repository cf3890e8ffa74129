"""Property test: arbitrary engine input through the public API of both kernel implementations
(SPEC §14.2; issue 12). Views (shapes, dtypes, values), SWA tables, real-KV sources, walkers
and capacities are drawn freely, small and often out of range; for every input the fast and
the reference canary must either raise the same documented error (TypeError / ValueError /
CanaryContractError with a `kv-canary: ` message) or leave byte-equal buffers and identical
rings. The reference kernel refuses any out-of-range row instead of wrapping, so an unchecked
slot shows up as an IndexError; a crash of the fast kernel kills the run. `test_fuzz_boundscheck`
repeats a smaller run with numba's bounds checking on, in a subprocess with its own cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcanary
from kvcanary.canary import (
    CanaryConfig,
    CanaryLaunchCapacities,
    CanaryMode,
    RealDataMode,
    install,
)
from kvcanary.contract import BufferGroupSpec, ForwardView, GroupKind, RealKvSource

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = int(os.environ.get("KVCANARY_FUZZ_EXAMPLES", "2600"))
HUGE = [2**62, -(2**62), 2**63 - 1, -(2**63)]


class Gen:
    """Fast generation: hypothesis draws a seed, NumPy draws the values (SPEC-shaped but free)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def values(self, lo: int, hi: int, size: int) -> list[int]:
        """Mostly in `[lo, hi]`, sometimes far outside (huge, negative)."""
        out = self.rng.integers(lo, hi + 1, size=size).tolist()
        for i in np.flatnonzero(self.rng.random(size) < 0.06):
            out[i] = HUGE[int(self.rng.integers(0, len(HUGE)))]
        return out

    def int_field(self, data: list[int], shape: tuple[int, ...]) -> Any:
        """`data` as an int64/int32 tensor or array, or now and then something without a
        dtype, a wrong dtype or a wrong rank."""
        kind = int(self.rng.integers(0, 60))
        arr = np.array(data, dtype=np.int64).reshape(shape)
        if kind == 0:
            return arr.tolist()
        if kind == 1:
            return torch.from_numpy(arr).float()
        if kind == 2:
            return torch.from_numpy(arr.reshape(-1, 1) if arr.ndim == 1 else arr.reshape(-1))
        small = bool(arr.size == 0 or (np.abs(arr) < 2**31).all())
        if kind < 15 and small:
            return torch.from_numpy(arr.astype(np.int32))
        if kind < 20:
            return arr
        return torch.from_numpy(arr)


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    g = Gen(draw(st.integers(0, 2**63 - 1)))
    rng = g.rng
    n = int(rng.integers(1, 11))
    num_rows, width = int(rng.integers(1, 5)), int(rng.integers(0, 7))
    n_swa = int(rng.integers(1, 9))
    lut = g.values(-1, n_swa + 1, int(rng.integers(0, n + 3)))
    forwards = []
    for _ in range(int(rng.integers(1, 4))):
        b, t = int(rng.integers(0, 5)), int(rng.integers(0, 9))
        rows = [int(x) for x in rng.integers(0, num_rows + 1, size=b)]
        if rng.random() < 0.3:
            rows = g.values(-1, num_rows, b)
        flat = {
            name: g.values(lo, hi, t)
            for name, lo, hi in (("input_ids", 0, 9), ("positions", -1, 8), ("out_slots", -2, n))
        }
        fields = {
            "rows": g.int_field(rows, (b,)),
            "prefix_lens": g.int_field(g.values(-1, width + 1, b), (b,)),
            "extend_lens": g.int_field(g.values(-1, 3, b), (b,)),
            **{k: g.int_field(v, (t,)) for k, v in flat.items()},
            "req_to_token": g.int_field(g.values(-2, n, num_rows * width), (num_rows, width)),
        }
        truth = None
        if rng.random() < 0.5:
            truth = [rng.integers(0, 10, size=int(rng.integers(0, width + 2))).tolist()
                     for _ in range(int(rng.integers(0, b + 1)))]  # fmt: skip
        m = int(rng.integers(0, 7))
        walk = list(zip(g.values(-2, n, m), g.values(-1, 8, m), g.values(-2, n, m), strict=True))
        forwards.append(
            {
                "fields": fields,
                "truth": truth,
                "walk": walk,
                "linear": bool(rng.random() < 0.8),
                "kv_flip": int(rng.integers(-n * 32, n * 32)),
            }
        )
    return {
        "n": n,
        "num_rows": num_rows,
        "width": width,
        "swa": bool(rng.random() < 0.3),
        "n_swa": n_swa,
        "lut": lut,
        "window": int(rng.integers(1, 5)),
        "mode": list(RealDataMode)[int(rng.integers(0, 3))],
        "source_rows": [n, n, n + 1, max(n - 1, 0)][int(rng.integers(0, 4))],
        "enable_v": bool(rng.random() < 0.5),
        "token_check": bool(rng.random() < 0.5),
        "init_finished": bool(rng.random() < 0.5),
        "verify_capacity": [1, 3, 100, 100][int(rng.integers(0, 4))],
        "forwards": forwards,
    }


class Walker:
    def __init__(self) -> None:
        self.entries: list[tuple[int, int, int]] = []

    def walk(self, *, unlocked_only: bool = False, swa_resident_only: bool = False) -> Any:
        return self.entries


def outcome(kernels: str, sc: dict[str, Any]) -> list[Any]:
    """Every observable result of running `sc` with `kernels`, errors included."""
    k_bytes = torch.zeros(max(sc["source_rows"], 1), 32, dtype=torch.uint8)
    events: list[Any] = []

    def guarded(step: str, fn: Any) -> bool:
        try:
            fn()
            return True
        except (TypeError, ValueError) as err:  # CanaryContractError is a ValueError
            assert str(err).startswith("kv-canary: "), (step, err)
            events.append((step, type(err).__name__, str(err)))
            return False

    def build() -> Any:
        sources = (RealKvSource(k_bytes[: sc["source_rows"]], 1, 32, 16),)
        groups = [BufferGroupSpec(kind=GroupKind.FULL, num_slots=sc["n"], k_sources=sources,
                                  v_sources=sources)]  # fmt: skip
        if sc["swa"]:
            groups.append(BufferGroupSpec(kind=GroupKind.SWA, num_slots=sc["n_swa"], has_v=False,
                                          full_to_swa=torch.tensor(sc["lut"], dtype=torch.int64),
                                          window=sc["window"]))  # fmt: skip
        cfg = CanaryConfig(mode=CanaryMode.LOG, real_data=sc["mode"], enable_v=sc["enable_v"],
                           enable_verify_token_assert=sc["token_check"], sweep_interval=1,
                           ring_capacity=6, stats_print_every_n_steps=0)  # fmt: skip
        caps = CanaryLaunchCapacities(write_req_capacity=4, write_entry_capacity=8,
                                      verify_capacity=sc["verify_capacity"],
                                      max_seq_len_per_req=sc["width"] + 1)  # fmt: skip
        return install(cfg, groups, caps, kernels=kernels)

    holder: list[Any] = []
    if not guarded("install", lambda: holder.append(build())):
        return events
    canary = holder[0]
    walker = Walker()
    canary.attach_prefix_cache(walker=walker)
    if sc["init_finished"]:
        canary.mark_init_finished()
    for step, fw in enumerate(sc["forwards"]):
        view = ForwardView(**fw["fields"], truth_tokens=fw["truth"], linear_chain=fw["linear"])
        walker.entries = fw["walk"]
        if guarded(f"pre{step}", lambda v=view: canary.pre_forward(view=v)):
            if fw["kv_flip"] >= 0 and fw["kv_flip"] < k_bytes.numel():
                k_bytes.view(-1)[fw["kv_flip"]] ^= 1  # the "model" writes some KV byte
            guarded(f"post{step}", lambda v=view: canary.post_forward(view=v))
        guarded(f"end{step}", canary.end_step)
        state = [g.buffer(stage, half).tobytes() for g in canary.groups
                 for stage in ("head", "tail") for half in ("k", "v") if half in g.halves]  # fmt: skip
        events.append((step, state, canary.ring.rows.tolist(), canary.total_violations))
    return events


def check(sc: dict[str, Any]) -> None:
    assert outcome("fast", sc) == outcome("reference", sc)


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(scenarios())
def test_fuzz_kernels_agree_or_raise_documented_errors_a(sc: dict[str, Any]) -> None:
    check(sc)


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(scenarios())
def test_fuzz_kernels_agree_or_raise_documented_errors_b(sc: dict[str, Any]) -> None:
    check(sc)


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(scenarios())
def test_fuzz_kernels_agree_or_raise_documented_errors_c(sc: dict[str, Any]) -> None:
    check(sc)


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(scenarios())
def test_fuzz_kernels_agree_or_raise_documented_errors_d(sc: dict[str, Any]) -> None:
    check(sc)


def test_fuzz_reaches_errors_and_clean_runs() -> None:
    """Guard against a vacuous property: the generator yields errors of several kinds, and runs
    that get past every check with violations recorded."""
    seen: dict[str, int] = {"ok_runs": 0, "violations": 0}

    @settings(max_examples=400, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
    @given(scenarios())
    def probe(sc: dict[str, Any]) -> None:
        for event in outcome("fast", sc):
            if isinstance(event[0], str):
                key = event[2].split(" ")[1] + ":" + event[2].split(" ")[2]
                seen[key] = seen.get(key, 0) + 1
            else:
                seen["ok_runs"] += 1
                seen["violations"] += event[3] > 0

    probe()
    assert seen["ok_runs"] > 50 and seen["violations"] > 10, seen
    assert (
        seen.get("slot:" + "-1", 0) + sum(v for k, v in seen.items() if k.startswith("slot:")) > 0
    )
    assert any(k.startswith("forward_view") for k in seen), seen


@pytest.mark.slow
def test_fuzz_boundscheck() -> None:
    """A smaller fuzz run with numba's bounds checking on, in a subprocess whose numba cache
    is a fresh temporary folder (the boundscheck build never mixes with the normal cache)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ)
        src = str(Path(kvcanary.__file__).resolve().parents[1])
        env.update(
            NUMBA_BOUNDSCHECK="1",
            NUMBA_CACHE_DIR=cache,
            KVCANARY_FUZZ_EXAMPLES="150",
            PYTHONPATH=os.pathsep.join([src, str(ROOT), env.get("PYTHONPATH", "")]),
        )
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
             f"{__file__}::test_fuzz_kernels_agree_or_raise_documented_errors_a"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
        assert "1 passed" in result.stdout
        assert any(Path(cache).rglob("*.nbi"))  # the boundscheck build went to its own cache
