"""CanaryConfig parsing and every SPEC §12 validation message (conformance items 26, 45, 46)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvcanary.canary import CanaryConfig, CanaryMode, RealDataMode


def build(env: dict[str, str] | None = None, **kw: object) -> CanaryConfig:
    args: dict[str, object] = {
        "kv_canary": "log",
        "kv_canary_real_data": "none",
        "kv_canary_sweep_interval": 0,
    }
    args.update(kw)
    return CanaryConfig.from_args_and_env(environ=env or {}, **args)  # type: ignore[arg-type]


def test_mode_parsing_is_case_insensitive_and_stripped() -> None:
    assert build(kv_canary=" LOG ").mode is CanaryMode.LOG
    assert build(kv_canary="OFF").mode is CanaryMode.NONE
    assert build(kv_canary="Raise").mode is CanaryMode.RAISE
    assert build(kv_canary_real_data=" Partial ").real_data is RealDataMode.PARTIAL
    assert build(kv_canary=" ReCoVeR ").mode is CanaryMode.RECOVER


def test_recover_implies_the_verify_token_assert() -> None:
    assert build(kv_canary="recover").verify_token_check
    assert build(kv_canary="recover").recover
    assert not build(kv_canary="log").verify_token_check
    assert build({"KVCANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1"}).verify_token_check
    assert build(kv_canary="recover", kv_canary_sweep_interval=3).sweep_interval == 3


def test_defaults() -> None:
    cfg = build()
    assert (cfg.ring_capacity, cfg.stats_print_every_n_steps) == (1024, 100)
    assert not (cfg.enable_v or cfg.enable_write_input_assert or cfg.enable_verify_token_assert)
    assert cfg.perturb.warmup_steps == 50 and cfg.perturb.seed == 0 and not cfg.perturb.any_enabled
    assert cfg.verify_stride == 1  # every attended slot, every forward (SPEC §5.1)
    assert build({"KVCANARY_VERIFY_STRIDE": " 8 "}, kv_canary="raise").verify_stride == 8


BAD = [
    (dict(kv_canary="maybe"), {}, "kv-canary: kv_canary must be one of none/log/raise/recover, got 'maybe'"),
    (dict(kv_canary_real_data="some"), {}, "kv-canary: kv_canary_real_data must be one of none/partial/all, got 'some'"),
    (dict(kv_canary_sweep_interval=-1), {}, "kv-canary: kv_canary_sweep_interval must be non-negative, got -1"),
    (dict(kv_canary="none", kv_canary_sweep_interval=5), {}, "kv-canary: kv_canary_sweep_interval=5 requires kv_canary mode log, raise or recover"),
    ({}, {"KVCANARY_RING_CAPACITY": "0"}, "kv-canary: ViolationLog ring_capacity must be positive, got 0"),
    ({}, {"KVCANARY_ENABLE_V": "perhaps"}, "kv-canary: KVCANARY_ENABLE_V must be a boolean (1/0/true/false/yes/no/on/off), got 'perhaps'"),
    ({}, {"KVCANARY_STATS_PRINT_EVERY_N_STEPS": "ten"}, "kv-canary: KVCANARY_STATS_PRINT_EVERY_N_STEPS must be an integer, got 'ten'"),
    ({}, {"KVCANARY_PERTURB_WARMUP_STEPS": "-3"}, "kv-canary: KVCANARY_PERTURB_WARMUP_STEPS must be non-negative, got -3"),
    ({}, {"KVCANARY_PERTURB_REQ_TO_TOKEN_PROB": "1.5"}, "kv-canary: KVCANARY_PERTURB_REQ_TO_TOKEN_PROB must be a probability in [0, 1], got '1.5'"),
    ({}, {"KVCANARY_PERTURB_CANARY_TAMPER_PROB": "1"}, "kv-canary: KVCANARY_PERTURB_TARGET_GROUP must be explicitly set to 'full' or 'swa'"),
    ({}, {"KVCANARY_PERTURB_CANARY_TAMPER_PROB": "1", "KVCANARY_PERTURB_TARGET_GROUP": " "}, "kv-canary: KVCANARY_PERTURB_TARGET_GROUP must be explicitly set to 'full' or 'swa'"),
    ({}, {"KVCANARY_PERTURB_CANARY_TAMPER_PROB": "1", "KVCANARY_PERTURB_TARGET_GROUP": "any"}, "kv-canary: KVCANARY_PERTURB_TARGET_GROUP must be one of 'full' / 'swa', got 'any'"),
    ({}, {"KVCANARY_PERTURB_REAL_KV_USED_PROB": "0.5", "KVCANARY_PERTURB_TARGET_GROUP": "full"}, "kv-canary: real-KV perturb modes require --kv-canary-real-data partial or all"),
    ({}, {"KVCANARY_PERTURB_NEXT_TOKEN_SWAP_PROB": "1"}, "kv-canary: KVCANARY_PERTURB_NEXT_TOKEN_SWAP_PROB > 0 requires KVCANARY_ENABLE_WRITE_INPUT_ASSERT=1"),
    ({}, {"KVCANARY_VERIFY_STRIDE": "0"}, "kv-canary: KVCANARY_VERIFY_STRIDE must be an integer in [1, 64], got 0; set it to 1 to verify every attended slot every forward"),
    ({}, {"KVCANARY_VERIFY_STRIDE": "65"}, "kv-canary: KVCANARY_VERIFY_STRIDE must be an integer in [1, 64], got 65; set it to 1 to verify every attended slot every forward"),
    ({}, {"KVCANARY_VERIFY_STRIDE": "two"}, "kv-canary: KVCANARY_VERIFY_STRIDE must be an integer, got 'two'"),
    (dict(kv_canary="recover"), {"KVCANARY_VERIFY_STRIDE": "4"}, "kv-canary: KVCANARY_VERIFY_STRIDE=4 cannot be used with kv_canary=recover (recover must verify every attended slot before each forward); set KVCANARY_VERIFY_STRIDE=1"),
    ({}, {"KVCANARY_VERIFY_STRIDE": "2", "KVCANARY_PERTURB_REQ_TO_TOKEN_PROB": "0.5"}, "kv-canary: KVCANARY_VERIFY_STRIDE=2 cannot be combined with fault injection (its detection deadlines assume every slot verified each forward); set KVCANARY_VERIFY_STRIDE=1"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "env", "message"), BAD)
def test_validation_messages_are_exact(
    args: dict[str, object], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError) as err:
        build(env, **args)
    assert str(err.value) == message


def test_booleans_accept_all_spellings() -> None:
    for word, value in [
        ("1", True),
        ("yes", True),
        ("ON", True),
        ("true", True),
        ("0", False),
        ("No", False),
        ("off", False),
    ]:
        assert build({"KVCANARY_ENABLE_V": word}).enable_v is value


def test_target_group_is_normalised() -> None:
    cfg = build(
        {"KVCANARY_PERTURB_CANARY_TAMPER_PROB": "1", "KVCANARY_PERTURB_TARGET_GROUP": " SWA "}
    )
    assert cfg.perturb.target_group == "swa" and cfg.perturb.probability("canary_tamper") == 1.0


def test_frozen_and_independent_of_later_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"KVCANARY_RING_CAPACITY": "7"}
    cfg = build(env)
    env["KVCANARY_RING_CAPACITY"] = "9"
    monkeypatch.setenv("KVCANARY_RING_CAPACITY", "11")
    assert cfg.ring_capacity == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ring_capacity = 3  # type: ignore[misc]


def test_unknown_variable_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        build({"KVCANARY_BOGUS": "1"})
    assert "kv-canary: ignoring unknown environment variable KVCANARY_BOGUS" in caplog.messages
