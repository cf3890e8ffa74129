"""Fault-injection rules shared by every mode (SPEC §11.1, §12; conformance 42, 43, 45)."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest

from kvcanary.canary import CanaryConfig, PerturbConfig, install
from kvcanary.canary.config import PERTURB_MODES
from kvcanary.canary.perturb import Perturber, mode_seed
from kvcanary.contract import TokenOracle
from tests.canary.conftest import capacities, forward
from tests.canary.handpool import HandPool
from tests.canary.perturb_engine import SimEngine, two_decoders

DISABLED = "kv_canary perturb: disabled during warmup window (first 3 forward steps)"
ENABLED = "kv_canary perturb: enabled after warmup window at step=3"


def all_modes(p: float, **kw: object) -> SimEngine:
    """Every mode at `p` (SWA group present, sweeps every step, write assert on)."""
    kw = {"swa_window": 3, "sweep_interval": 1, "write_assert": True, "max_fires": None} | kw
    return SimEngine(probs=dict.fromkeys(PERTURB_MODES, p), **kw)  # type: ignore[arg-type]


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_mode_seed_is_blake2b_little_endian() -> None:
    digest = hashlib.blake2b(b"kvcanary-perturb:late_write:7", digest_size=8).digest()
    assert mode_seed("late_write", 7) == int.from_bytes(digest, "little")
    assert mode_seed("late_write", 7) != mode_seed("stale_prefix", 7)


def test_warmup_gate_blocks_every_mode_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvcanary")
    e = all_modes(1.0, warmup=3)
    e.canary.mark_init_finished()
    e.add("a", [1, 2, 3, 4])
    e.add("b", [5, 6, 7, 8])
    for _ in range(3):
        e.step(["a", "b"])
    assert e.spy.injections() == [] and e.spy.diffs == [] and e.rows == []
    for _ in range(3):
        e.step(["a", "b"])
    assert e.spy.injections() and min(r.step for r in e.spy.injections()) == 3
    logged = messages(caplog)
    assert logged.count(DISABLED) == 1 and logged.count(ENABLED) == 1
    assert logged.index(DISABLED) < logged.index(ENABLED)


def test_same_seed_same_trace_same_journal() -> None:
    def journal(seed: int) -> list[object]:
        e = all_modes(0.5, seed=seed)
        e.canary.mark_init_finished()
        return list(two_decoders(e, steps=8).spy.injections())

    first = journal(11)
    assert first and journal(11) == first
    assert journal(12) != first


@pytest.mark.parametrize(("mode", "other"), [("real_kv_used", "canary_tamper"),
                                              ("canary_tamper", "real_kv_post_forward"),
                                              ("req_to_token", "real_kv_used")])  # fmt: skip
def test_another_mode_does_not_change_draws(mode: str, other: str) -> None:
    def records(probs: dict[str, float]) -> list[object]:
        e = two_decoders(SimEngine(probs=probs, max_fires=None, seed=3), steps=10)
        return [r for r in e.spy.injections() if r.mode == mode]

    alone = records({mode: 0.5})
    assert alone and records({mode: 0.5, other: 0.5}) == alone


def test_journal_line_is_compact_json_in_key_order(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvcanary")
    e = two_decoders(SimEngine(probs={"canary_tamper": 1.0}, seed=5))
    (rec,) = e.spy.injections()
    (line,) = [m for m in messages(caplog) if m.startswith("kv_canary perturb: {")]
    body = line.removeprefix("kv_canary perturb: ")
    assert " " not in body
    keys = list(json.loads(body))
    assert keys[:6] == ["mode", "step", "slot", "position", "group", "seed"]
    assert keys[6:] == list(rec.extras)
    assert json.loads(body)["seed"] == 5 == rec.seed


def test_skips_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvcanary")
    e = SimEngine(probs={"next_token_swap": 1.0}, write_assert=True)
    e.add("a", [1, 2, 3])
    for _ in range(3):
        e.step(["a"])
    assert "kv_canary perturb next_token_swap: skipped step=2 reason=batch_too_small" in messages(
        caplog
    )
    assert e.spy.injections() == []


@pytest.mark.parametrize("mode", ["req_to_token", "double_alloc", "position_off_by_one"])
def test_mutating_modes_skip_an_immutable_view(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvcanary")
    e = SimEngine(probs={mode: 1.0}, mutable=False)
    e.canary.mark_init_finished()
    two_decoders(e)
    assert e.spy.injections() == [] and e.spy.diffs == [] and e.rows == []
    assert f"kv_canary perturb {mode}: skipped step=2 reason=immutable_view" in messages(caplog)


def build(env: dict[str, str]) -> CanaryConfig:
    return CanaryConfig.from_args_and_env(
        kv_canary="log", kv_canary_real_data="partial", environ=env
    )


@pytest.mark.parametrize("mode", ["REAL_KV_USED", "CANARY_TAMPER", "LATE_WRITE", "STALE_PREFIX",
                                  "REAL_KV_UNUSED_CACHE", "REAL_KV_POST_FORWARD"])  # fmt: skip
def test_target_group_messages(mode: str) -> None:
    knob = {f"KVCANARY_PERTURB_{mode}_PROB": "1"}
    with pytest.raises(ValueError) as err:
        build(knob)
    assert str(err.value) == (
        "kv-canary: KVCANARY_PERTURB_TARGET_GROUP must be explicitly set to 'full' or 'swa'"
    )
    for bad in ("any", "ANY", "both"):
        with pytest.raises(ValueError) as err:
            build(knob | {"KVCANARY_PERTURB_TARGET_GROUP": bad})
        assert str(err.value) == (
            "kv-canary: KVCANARY_PERTURB_TARGET_GROUP must be one of 'full' / 'swa', "
            f"got {bad.lower()!r}"
        )
    cfg = build(knob | {"KVCANARY_PERTURB_TARGET_GROUP": " Swa "})
    assert cfg.perturb.target_group == "swa"


def test_fixed_group_modes_need_no_target_group() -> None:
    env = {"KVCANARY_PERTURB_DOUBLE_ALLOC_PROB": "1", "KVCANARY_PERTURB_SWA_LUT_TAMPER_PROB": "1"}
    assert build(env).perturb.target_group is None


def test_install_builds_a_perturber_from_the_environment() -> None:
    env = {"KVCANARY_PERTURB_REAL_KV_USED_PROB": "1", "KVCANARY_PERTURB_TARGET_GROUP": "full",
           "KVCANARY_PERTURB_WARMUP_STEPS": "1", "KVCANARY_PERTURB_SEED": "9"}  # fmt: skip
    pool = HandPool()
    canary = install(
        build(env), [pool.group(16)], capacities(pool), TokenOracle(100), kernels="reference"
    )
    assert canary is not None
    forward(pool, canary, pool.view([(1, [1, 2, 3])]))
    assert canary.injections() == []
    forward(pool, canary, pool.view([(1, [4])]))
    (rec,) = canary.injections()
    assert (rec.mode, rec.step, rec.seed) == ("real_kv_used", 1, 9)
    assert {(v.tag.name, v.slot_idx) for v in canary.drain_violations()} == {
        ("TAIL_K_FULL", rec.slot)
    }
    plain = install(build({}), [pool.group(16)], capacities(pool))
    assert plain is not None and plain.injections() == []


def test_perturber_must_be_bound() -> None:
    p = Perturber(PerturbConfig(probabilities={"double_alloc": 1.0}))
    with pytest.raises(RuntimeError, match="before bind"):
        p.at_end_step(step=0, sweep_due=True)
