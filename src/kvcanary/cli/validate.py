"""Checks of `kvcanary run`/`check-config`/`selftest` inputs, all before any long work.

Each raises `BadInput` with one line naming the flag (or `KVCANARY_*` variable) as the user wrote
it. Sizes are bounded so a huge value is a clear error rather than a hang or an overflow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields

from kvcanary.app.workload import WorkloadSpec
from kvcanary.canary import CanaryConfig, CanaryMode
from kvcanary.cli.errors import BadInput, check_int, explain
from kvcanary.engine.plants import PLANT_NAMES

__all__ = [
    "CANARY_FLAGS",
    "MAX_SEED",
    "canary_config",
    "canary_knobs",
    "check_choice",
    "check_plant_fixture",
    "check_reference_engine_env",
    "check_run_sizes",
    "longest_request",
]

MAX_SEED = 2**63 - 1
#: library field names -> the flags that set them, for `explain`
CANARY_FLAGS: Mapping[str, str] = {
    "kv_canary_real_data": "--kv-canary-real-data",
    "kv_canary_sweep_interval": "--kv-canary-sweep-interval",
    "kv_canary": "--kv-canary",
}
_MAX_TABLE_ENTRIES = 1 << 24  # req_to_token is rows x columns int64: 128 MiB at most


def check_choice(flag: str, value: str, choices: Sequence[str]) -> str:
    """`value` is one of `choices` (case-insensitive), else one line listing them."""
    word = value.strip().lower()
    if word not in choices:
        raise BadInput(f"{flag} got {value!r}; pass one of {', '.join(choices)}")
    return word


def canary_config(
    kv_canary: str,
    real_data: str,
    sweep: int,
    environ: Mapping[str, str],
    *,
    explicit: frozenset[str] = frozenset(),
) -> CanaryConfig:
    """The canary config from the canary flags and `KVCANARY_*`, as one-line errors.

    With `--kv-canary none` the command's own defaults for real data and the sweep do not
    apply (nothing is installed); passing either explicitly with `none` is a contradiction.
    """
    check_int("--kv-canary-sweep-interval", sweep, 0, 1_000_000,
              "pass 0 (off) or a step count, e.g. --kv-canary-sweep-interval 8")  # fmt: skip
    try:
        off = str(kv_canary).strip().lower() in ("none", "off")
        known = str(real_data).strip().lower() in ("none", "partial", "all")
        if off and known:  # an unknown value gets the library's own message below
            for flag in ("--kv-canary-real-data", "--kv-canary-sweep-interval"):
                value = real_data if flag == "--kv-canary-real-data" else sweep
                if flag in explicit and value not in ("none", 0):
                    raise BadInput(f"{flag} {value} contradicts --kv-canary {kv_canary} (nothing "
                                   f"is installed); drop {flag} or pass --kv-canary log")  # fmt: skip
            real_data, sweep = "none", 0
        config = CanaryConfig.from_args_and_env(
            kv_canary=kv_canary, kv_canary_real_data=real_data,
            kv_canary_sweep_interval=sweep, environ=environ,
        )  # fmt: skip
    except ValueError as exc:
        raise BadInput(explain(str(exc), CANARY_FLAGS)) from None
    seed = config.perturb.seed
    if not 0 <= seed <= MAX_SEED:
        raise BadInput(f"KVCANARY_PERTURB_SEED must be between 0 and {MAX_SEED}, got {seed}; "
                       "set a smaller seed")  # fmt: skip
    if config.mode is CanaryMode.NONE and config.perturb.any_enabled:
        name = next(n for n, p in config.perturb.probabilities.items() if p > 0)
        raise BadInput(f"KVCANARY_PERTURB_{name.upper()}_PROB is set but --kv-canary is none "
                       "(no canary to inject into); pass --kv-canary log or unset it")  # fmt: skip
    return config


def canary_knobs(environ: Mapping[str, str]) -> tuple[tuple[str, object], ...]:
    """The `CanaryConfig` fields that `environ`'s `KVCANARY_*` variables set away from their
    defaults, as (name, value), validated as for `kvcanary run` (one-line errors); for a command
    that builds its own canary configs (selftest) and must still honour the user's knobs."""
    configured = canary_config("log", "partial", 0, environ)
    default = canary_config("log", "partial", 0, {})
    return tuple(
        (f.name, getattr(configured, f.name))
        for f in fields(CanaryConfig)
        if f.name != "perturb" and getattr(configured, f.name) != getattr(default, f.name)
    )


def check_reference_engine_env(config: CanaryConfig, model: str) -> None:
    """What the reference engine cannot do: no SWA group; the write-input assert needs the
    token oracle, which only `--model oracle` has."""
    perturb = config.perturb
    if perturb.any_enabled and perturb.target_group == "swa":
        raise BadInput("KVCANARY_PERTURB_TARGET_GROUP=swa, but the reference engine has no swa "
                       "group (the fault would never fire); set KVCANARY_PERTURB_TARGET_GROUP=full")  # fmt: skip
    if perturb.probability("swa_lut_tamper") > 0:
        raise BadInput("KVCANARY_PERTURB_SWA_LUT_TAMPER_PROB needs a sliding-window group, which "
                       "the reference engine has no; unset it")  # fmt: skip
    if config.enable_write_input_assert and model != "oracle":
        raise BadInput(f"KVCANARY_ENABLE_WRITE_INPUT_ASSERT=1 needs the token oracle, but --model "
                       f"is {model}; add --model oracle (or unset the variable)")  # fmt: skip
    if config.enable_token_oracle and model != "oracle":
        raise BadInput(f"KVCANARY_ENABLE_TOKEN_ORACLE=1 needs the token oracle, but --model is "
                       f"{model}; add --model oracle (or unset the variable)")  # fmt: skip


def check_plant_fixture(plants: Sequence[str], model: str, draft_tokens: int) -> None:
    """A planted bug the run could never trigger is bad input, not a silent clean run: the
    speculative-rollback plant needs drafts that get rejected, so speculation on and the tiny
    model (the token oracle's drafts are always accepted)."""
    if "spec_rollback_stale" not in plants:
        return
    if draft_tokens == 0:
        raise BadInput("--plant spec_rollback_stale needs speculative decoding, but "
                       "--speculative-num-draft-tokens is 0 (it would never fire); pass "
                       "--speculative-num-draft-tokens 2")  # fmt: skip
    if model == "oracle":
        raise BadInput("--plant spec_rollback_stale needs rejected drafts, but --model oracle "
                       "accepts every draft (it would never fire); drop --model oracle (use the "
                       "tiny model)")  # fmt: skip


def longest_request(spec: WorkloadSpec) -> int:
    """The most tokens (prompt + output) one request of the embedded workload can ask for."""
    return spec.system_prompt_len + spec.user_len[1] + spec.max_new_tokens[1]


def check_run_sizes(
    *,
    requests: int,
    seed: int,
    num_slots: int,
    max_running_requests: int,
    max_batch_size: int,
    chunked_prefill_size: int,
    max_prefill_tokens: int,
    speculative_num_draft_tokens: int,
    max_context_len: int,
    plants: Sequence[str],
) -> None:
    """Every size flag of `kvcanary run`, alone and together."""
    check_int("--requests", requests, 1, 100_000, "pass 1 to 100000 (bench/soak.py runs more)")
    check_int("--seed", seed, 0, MAX_SEED, "pass a smaller non-negative seed")
    check_int("--num-slots", num_slots, 2, 1 << 20, "slot 0 is reserved; pass 2 to 1048576")
    check_int("--max-running-requests", max_running_requests, 1, 4096)
    check_int("--max-batch-size", max_batch_size, 1, 4096)
    if chunked_prefill_size != -1:
        check_int("--chunked-prefill-size", chunked_prefill_size, 1, 1 << 16,
                  "pass -1 (unlimited) or 1 to 65536")  # fmt: skip
    check_int("--speculative-num-draft-tokens", speculative_num_draft_tokens, 0, 16,
              "pass 0 (off) to 16")  # fmt: skip
    check_int("--max-prefill-tokens", max_prefill_tokens, speculative_num_draft_tokens + 1,
              1 << 16, f"a step must fit one verify of --speculative-num-draft-tokens "
              f"{speculative_num_draft_tokens} + 1 tokens; pass "
              f"{speculative_num_draft_tokens + 1} to 65536")  # fmt: skip
    check_int("--max-context-len", max_context_len, 1, 1 << 16)
    if max_running_requests * max_context_len > _MAX_TABLE_ENTRIES:
        raise BadInput(f"--max-running-requests {max_running_requests} x --max-context-len "
                       f"{max_context_len} = {max_running_requests * max_context_len} req_to_token "
                       f"entries, over the {_MAX_TABLE_ENTRIES} limit; lower one of them")  # fmt: skip
    longest = longest_request(WorkloadSpec())
    if max_context_len < longest - 1:
        raise BadInput(f"--max-context-len {max_context_len} is smaller than one request of the "
                       f"workload (up to {longest} tokens); pass --max-context-len {longest - 1} "
                       "or more")  # fmt: skip
    if num_slots < longest:
        raise BadInput(f"--num-slots {num_slots} cannot hold one request of the workload (up to "
                       f"{longest} tokens plus reserved slot 0); pass --num-slots {longest} or "
                       "more")  # fmt: skip
    for name in plants:
        if name not in PLANT_NAMES:
            raise BadInput(f"--plant got {name!r}; pass one of {', '.join(PLANT_NAMES)}")
    if len(set(plants)) != len(plants):
        raise BadInput(f"--plant repeats a name ({', '.join(plants)}); pass each plant once")
