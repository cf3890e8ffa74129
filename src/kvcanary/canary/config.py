"""CanaryConfig: every canary knob, validated once at the edge (SPEC §12).

`CanaryConfig.from_args_and_env` is the only place that reads `KVCANARY_*` variables; nothing
below it looks at the environment again.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "MAX_RING_CAPACITY",
    "MAX_VERIFY_STRIDE",
    "PERTURB_MODES",
    "VERIFY_STRIDE_SPAN",
    "CanaryConfig",
    "CanaryMode",
    "PerturbConfig",
    "RealDataMode",
]

logger = logging.getLogger("kvcanary")

PERTURB_MODES: tuple[str, ...] = (
    "req_to_token",
    "real_kv_used",
    "real_kv_unused_cache",
    "real_kv_post_forward",
    "next_token_swap",
    "canary_tamper",
    "late_write",
    "stale_prefix",
    "double_alloc",
    "position_off_by_one",
    "swa_lut_tamper",
)
_GROUP_TARGETED = (
    "real_kv_used",
    "real_kv_unused_cache",
    "real_kv_post_forward",
    "canary_tamper",
    "late_write",
    "stale_prefix",
)
_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True,
               "0": False, "false": False, "no": False, "off": False}  # fmt: skip


class CanaryMode(enum.Enum):
    """`none`: not installed; `log`: report and keep serving; `raise`: fail on first mismatch;
    `recover`: report as `log` and hand the engine incidents to act on (SPEC §14.3)."""

    NONE = "none"
    LOG = "log"
    RAISE = "raise"
    RECOVER = "recover"


class RealDataMode(enum.Enum):
    """How many bytes of each slot's real KV are fingerprinted: none, 16 (partial) or all."""

    NONE = "none"
    PARTIAL = "partial"
    ALL = "all"


def parse_mode(value: str) -> CanaryMode:
    """Parse `--kv-canary` (case-insensitive, stripped; `off` means `none`)."""
    word = str(value).strip().lower()
    word = "none" if word == "off" else word
    try:
        return CanaryMode(word)
    except ValueError:
        raise ValueError(
            f"kv-canary: kv_canary must be one of none/log/raise/recover, got {value!r}"
        ) from None


def parse_real_data(value: str) -> RealDataMode:
    """Parse `--kv-canary-real-data` (case-insensitive, stripped)."""
    try:
        return RealDataMode(str(value).strip().lower())
    except ValueError:
        raise ValueError(
            f"kv-canary: kv_canary_real_data must be one of none/partial/all, got {value!r}"
        ) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class PerturbConfig:
    """Fault-injection knobs (SPEC §11): per-mode probabilities, seed, warm-up, target group."""

    probabilities: Mapping[str, float] = field(default_factory=dict)
    seed: int = 0
    warmup_steps: int = 50
    target_group: str | None = None

    def probability(self, mode: str) -> float:
        """The probability of `mode` (0.0 when unset)."""
        return float(self.probabilities.get(mode, 0.0))

    @property
    def any_enabled(self) -> bool:
        """True when some mode has p > 0."""
        return any(p > 0 for p in self.probabilities.values())


#: the most violation-ring rows a config may ask for (1 GiB)
MAX_RING_CAPACITY = 1 << 24
#: the largest `verify_stride`: a slot's verify may lag its corruption by up to that many steps
MAX_VERIFY_STRIDE = 64
#: positions per rotation unit of `verify_stride`: a request's positions `[64u, 64u + 64)`
#: are verified together, so a thinned plan keeps runs of consecutive slots
VERIFY_STRIDE_SPAN = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class CanaryConfig:
    """Every canary knob. Frozen; derived values are properties."""

    mode: CanaryMode = CanaryMode.NONE
    real_data: RealDataMode = RealDataMode.NONE
    sweep_interval: int = 0
    ring_capacity: int = 1024
    stats_print_every_n_steps: int = 100
    enable_write_input_assert: bool = False
    enable_verify_token_assert: bool = False
    enable_v: bool = False
    enable_token_oracle: bool = False
    # HEAD and TAIL verify each request's position units in rotation, one step in `verify_stride`
    # (docs/spec.md, "Verify stride"); 1 verifies every attended slot every forward (SPEC §5.1)
    verify_stride: int = 1
    perturb: PerturbConfig = field(default_factory=PerturbConfig)

    def __post_init__(self) -> None:
        if self.sweep_interval < 0:
            raise ValueError(
                "kv-canary: kv_canary_sweep_interval must be non-negative, "
                f"got {self.sweep_interval}"
            )
        if self.sweep_interval > 0 and self.mode is CanaryMode.NONE:
            raise ValueError(
                f"kv-canary: kv_canary_sweep_interval={self.sweep_interval} requires kv_canary "
                "mode log, raise or recover"
            )
        if self.ring_capacity <= 0:
            raise ValueError(
                f"kv-canary: ViolationLog ring_capacity must be positive, got {self.ring_capacity}"
            )
        if self.ring_capacity > MAX_RING_CAPACITY:  # rows are allocated up front, 64 bytes each
            raise ValueError(
                f"kv-canary: ViolationLog ring_capacity must be at most {MAX_RING_CAPACITY} (64 "
                f"bytes a row, allocated up front), got {self.ring_capacity}; set "
                f"KVCANARY_RING_CAPACITY to {MAX_RING_CAPACITY} or less"
            )
        _validate_stride(self)
        _validate_perturb(self)

    @property
    def enabled(self) -> bool:
        """True unless the mode is `none`."""
        return self.mode is not CanaryMode.NONE

    @property
    def recover(self) -> bool:
        """True in mode `recover`: detections become incidents (SPEC §14.3)."""
        return self.mode is CanaryMode.RECOVER

    @property
    def verify_token_check(self) -> bool:
        """The verify-token assert: on when enabled, and always in mode `recover` (where the
        engine provides truth tokens)."""
        return self.enable_verify_token_assert or self.recover

    @classmethod
    def from_args_and_env(
        cls,
        *,
        kv_canary: str = "none",
        kv_canary_real_data: str = "none",
        kv_canary_sweep_interval: int = 0,
        environ: Mapping[str, str],
    ) -> CanaryConfig:
        """Build the config from CLI values and a `KVCANARY_*` environment mapping."""
        env = _EnvReader(environ)
        probabilities = {
            mode: p
            for mode in PERTURB_MODES
            if (p := env.probability(f"KVCANARY_PERTURB_{mode.upper()}_PROB")) > 0
        }
        group = environ.get("KVCANARY_PERTURB_TARGET_GROUP")
        perturb = PerturbConfig(
            probabilities=probabilities,
            seed=env.integer("KVCANARY_PERTURB_SEED", 0, non_negative=False),
            warmup_steps=env.integer("KVCANARY_PERTURB_WARMUP_STEPS", 50),
            target_group=None if group is None else group.strip().lower(),
        )
        config = cls(
            mode=parse_mode(kv_canary),
            real_data=parse_real_data(kv_canary_real_data),
            sweep_interval=kv_canary_sweep_interval,
            ring_capacity=env.integer("KVCANARY_RING_CAPACITY", 1024, non_negative=False),
            stats_print_every_n_steps=env.integer("KVCANARY_STATS_PRINT_EVERY_N_STEPS", 100),
            enable_write_input_assert=env.boolean("KVCANARY_ENABLE_WRITE_INPUT_ASSERT"),
            enable_verify_token_assert=env.boolean("KVCANARY_ENABLE_VERIFY_TOKEN_ASSERT"),
            enable_v=env.boolean("KVCANARY_ENABLE_V"),
            enable_token_oracle=env.boolean("KVCANARY_ENABLE_TOKEN_ORACLE"),
            verify_stride=env.integer("KVCANARY_VERIFY_STRIDE", 1, non_negative=False),
            perturb=perturb,
        )
        env.warn_unknown()
        return config


def _validate_stride(config: CanaryConfig) -> None:
    stride = config.verify_stride
    if type(stride) is not int or not 1 <= stride <= MAX_VERIFY_STRIDE:
        raise ValueError(
            f"kv-canary: KVCANARY_VERIFY_STRIDE must be an integer in [1, {MAX_VERIFY_STRIDE}], "
            f"got {stride!r}; set it to 1 to verify every attended slot every forward"
        )
    if stride > 1 and config.recover:
        raise ValueError(
            f"kv-canary: KVCANARY_VERIFY_STRIDE={stride} cannot be used with kv_canary=recover "
            "(recover must verify every attended slot before each forward); set "
            "KVCANARY_VERIFY_STRIDE=1"
        )
    if stride > 1 and config.perturb.any_enabled:
        raise ValueError(
            f"kv-canary: KVCANARY_VERIFY_STRIDE={stride} cannot be combined with fault injection "
            "(its detection deadlines assume every slot verified each forward); set "
            "KVCANARY_VERIFY_STRIDE=1"
        )


def _validate_perturb(config: CanaryConfig) -> None:
    perturb = config.perturb
    for name, p in perturb.probabilities.items():
        if name not in PERTURB_MODES:
            raise ValueError(
                f"kv-canary: unknown perturb mode {name!r}; choose from {PERTURB_MODES}"
            )
        if not 0.0 <= p <= 1.0:
            knob = f"KVCANARY_PERTURB_{name.upper()}_PROB"
            raise ValueError(f"kv-canary: {knob} must be a probability in [0, 1], got {p!r}")
    group = perturb.target_group
    if group is not None and group not in ("", "full", "swa"):
        raise ValueError(
            f"kv-canary: KVCANARY_PERTURB_TARGET_GROUP must be one of 'full' / 'swa', got {group!r}"
        )
    if any(perturb.probability(m) > 0 for m in _GROUP_TARGETED) and not group:
        raise ValueError(
            "kv-canary: KVCANARY_PERTURB_TARGET_GROUP must be explicitly set to 'full' or 'swa'"
        )
    real_kv = ("real_kv_used", "real_kv_unused_cache", "real_kv_post_forward")
    if any(perturb.probability(m) > 0 for m in real_kv) and config.real_data is RealDataMode.NONE:
        raise ValueError(
            "kv-canary: real-KV perturb modes require --kv-canary-real-data partial or all"
        )
    if perturb.probability("next_token_swap") > 0 and not config.enable_write_input_assert:
        raise ValueError(
            "kv-canary: KVCANARY_PERTURB_NEXT_TOKEN_SWAP_PROB > 0 requires "
            "KVCANARY_ENABLE_WRITE_INPUT_ASSERT=1"
        )


class _EnvReader:
    """Typed reads of `KVCANARY_*` variables, remembering which names were understood."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ
        self._known: set[str] = {
            "KVCANARY_PERTURB_TARGET_GROUP",
            *(f"KVCANARY_PERTURB_{m.upper()}_PROB" for m in PERTURB_MODES),
        }

    def _get(self, name: str) -> str | None:
        self._known.add(name)
        return self._environ.get(name)

    def boolean(self, name: str) -> bool:
        raw = self._get(name)
        if raw is None:
            return False
        try:
            return _BOOL_WORDS[raw.strip().lower()]
        except KeyError:
            raise ValueError(
                f"kv-canary: {name} must be a boolean (1/0/true/false/yes/no/on/off), got {raw!r}"
            ) from None

    def integer(self, name: str, default: int, *, non_negative: bool = True) -> int:
        raw = self._get(name)
        if raw is None:
            return default
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"kv-canary: {name} must be an integer, got {raw!r}") from None
        if non_negative and value < 0:
            raise ValueError(f"kv-canary: {name} must be non-negative, got {value}")
        return value

    def probability(self, name: str) -> float:
        raw = self._environ.get(name)
        if raw is None:
            return 0.0
        try:
            value = float(raw.strip())
        except ValueError:
            value = float("nan")
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"kv-canary: {name} must be a probability in [0, 1], got {raw!r}")
        return value

    def warn_unknown(self) -> None:
        for name in sorted(self._environ):
            if name.startswith("KVCANARY_") and name not in self._known:
                logger.warning("kv-canary: ignoring unknown environment variable %s", name)
